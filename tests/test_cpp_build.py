"""The C++ backend's build cache: one directory per (sources, flags, torch, Python, install
location); every build prints one line with its reason and duration; a finished build loads as
it is; two checkouts on one machine alternate runs without a rebuild."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fgrpo_kernels.backends.cpu import cpp

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(
    r"^fgrpo_kernels: building the C\+\+ CPU backend \((?P<reason>.+)\) in (?P<dir>\S+) \.\.\. "
    r"(?P<outcome>done in|failed after) \d+ s$"
)


@pytest.fixture
def fake_compiler(monkeypatch, tmp_path):
    """cpp_extension.load only writes the library; loads are recorded, not performed."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    calls = {"built": [], "loaded": []}

    def load(**kw):
        calls["built"].append(Path(kw["build_directory"]))
        (Path(kw["build_directory"]) / f"{kw['name']}.so").write_bytes(b"")

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(cpp, "_load_library", calls["loaded"].append)
    monkeypatch.setattr(cpp, "_register_fakes", lambda: None)
    return calls


def checkout(tmp_path: Path, name: str) -> Path:
    src = tmp_path / name / "csrc"
    shutil.copytree(cpp.csrc_dir(), src)
    return src


def build(monkeypatch, capsys, src: Path) -> list[str]:
    monkeypatch.setattr(cpp, "csrc_dir", lambda: src)
    cpp._build_and_load()
    return capsys.readouterr().err.splitlines()


def reason_of(lines: list[str]) -> str:
    assert len(lines) == 1, lines
    match = LINE.match(lines[0])
    assert match, lines[0]
    return match["reason"]


def test_every_build_prints_one_line_with_its_reason_and_duration(
    fake_compiler, monkeypatch, tmp_path, capsys
):
    a = checkout(tmp_path, "a")
    lines = build(monkeypatch, capsys, a)
    assert reason_of(lines) == f"first build for the sources in {a.resolve()}"
    first = LINE.match(lines[0])["dir"]
    assert json.loads((Path(first) / cpp.MARKER).read_text())["csrc"] == str(a.resolve())

    # a finished build loads as it is, even when a git checkout gave the sources new mtimes
    later = time.time() + 3600
    for f in a.iterdir():
        os.utime(f, (later, later))
    assert build(monkeypatch, capsys, a) == []
    assert fake_compiler["built"] == [Path(first)]
    assert fake_compiler["loaded"][-1].parent == Path(first)

    # an edited source builds into its own directory, saying why
    (a / "logprob.h").write_text((a / "logprob.h").read_text() + "// edited\n")
    lines = build(monkeypatch, capsys, a)
    assert reason_of(lines) == "the C++ sources changed"
    assert LINE.match(lines[0])["dir"] != first

    # another checkout with the same sources is a first build of its own, not a rebuild of a
    b = checkout(tmp_path, "b")
    assert reason_of(build(monkeypatch, capsys, b)).startswith("first build for the sources in")
    assert build(monkeypatch, capsys, a) == [] and build(monkeypatch, capsys, b) == []

    # another torch for the same sources and checkout
    monkeypatch.setattr(cpp.torch, "__version__", "9.9.9")
    assert reason_of(build(monkeypatch, capsys, b)) == "another torch or Python (torch 9.9.9)"


def test_an_interrupted_or_failed_build_says_so(fake_compiler, monkeypatch, tmp_path, capsys):
    from torch.utils import cpp_extension

    a = checkout(tmp_path, "a")

    def broken(**kw):
        raise RuntimeError("simulated compiler error")

    monkeypatch.setattr(cpp_extension, "load", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        build(monkeypatch, capsys, a)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and LINE.match(lines[0])["outcome"] == "failed after", lines
    monkeypatch.undo()  # the real load is back; fake it again with the fixture's recorder
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(
        cpp_extension, "load", lambda **kw: Path(kw["build_directory"], kw["name"] + ".so").touch()
    )
    monkeypatch.setattr(cpp, "_load_library", lambda path: None)
    monkeypatch.setattr(cpp, "_register_fakes", lambda: None)
    assert reason_of(build(monkeypatch, capsys, a)) == (
        "an earlier build in this directory did not finish"
    )


def _run(root: Path, ext: Path) -> tuple[str, list[str]]:
    """One fresh process on checkout `root`: its C++ sources' directory and its build lines."""
    env = dict(
        os.environ,
        PYTHONPATH=str(root),
        TORCH_EXTENSIONS_DIR=str(ext),
        FGRPO_BACKEND="cpu",
        FGRPO_CPU_BACKEND="cpp",
    )
    code = (
        "import torch, fgrpo_kernels as f\n"
        "from fgrpo_kernels.backends.cpu import cpp\n"
        "y = f.fused_linear_logprobs(torch.ones(2, 3), torch.eye(4, 3), torch.tensor([0, 1]))\n"
        "print(cpp.csrc_dir(), round(float(y.sum()), 5))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    builds = [line for line in out.stderr.splitlines() if LINE.match(line)]
    return out.stdout.strip(), builds


def test_two_checkouts_alternate_without_a_rebuild(tmp_path):
    """Real builds in fresh processes: this repository (A) and a copy of it (B) share one
    extensions directory. Each builds once (A's finished build is reused when this session
    has one); then A, B, A, B load without building."""
    ext = tmp_path / "ext"
    ext.mkdir()
    tag, isa_flags = cpp._isa()
    here = cpp.build_directory(tag, cpp.build_info(ROOT / "csrc", tag, cpp._flags(isa_flags)))
    if (here / cpp.MARKER).is_file():
        shutil.copytree(here, ext / here.name)
    copy = tmp_path / "b"
    shutil.copytree(ROOT / "csrc", copy / "csrc")
    shutil.copytree(ROOT / "fgrpo_kernels", copy / "fgrpo_kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    runs = [(name, *_run(root, ext)) for name, root in [("A", ROOT), ("B", copy)] * 2]
    (a1, out_a, build_a), (b1, out_b, build_b), *again = runs
    assert out_a.split()[0] == str((ROOT / "csrc").resolve())
    assert out_b.split()[0] == str((copy / "csrc").resolve())
    assert out_a.split()[1] == out_b.split()[1]
    assert len(build_a) <= 1 and len(build_b) == 1, (build_a, build_b)
    assert "first build for the sources in" in build_b[0]
    for name, out, builds in again:
        assert builds == [], f"{name} rebuilt: {builds}"
        assert out == (out_a if name == "A" else out_b)
