"""The README's examples run as written."""

import re
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
EXAMPLES = re.findall(r"<!-- example -->\n```python\n(.*?)```", README, re.S)


def test_readme_has_examples():
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_readme_example_runs(index, monkeypatch):
    monkeypatch.setenv("FGRPO_BACKEND", "cpu")
    exec(compile(EXAMPLES[index], f"README.md example {index}", "exec"), {})
