"""The README's examples run as written."""

import os
import re
import subprocess
import sys
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


TRL_EXAMPLE = re.findall(r"<!-- trl-example -->\n```python\n(.*?)```", README, re.S)


def test_trl_example_script_trains(tmp_path):
    """The TRL drop-in's complete example runs as a script and logs a finite loss."""
    pytest.importorskip("trl")
    assert len(TRL_EXAMPLE) == 1
    script = tmp_path / "trl_example.py"
    script.write_text(TRL_EXAMPLE[0])
    env = dict(os.environ, FGRPO_BACKEND="cpu")
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"step 3: loss -?\d+\.\d{4}, reward \d\.\d{3}", last), last
