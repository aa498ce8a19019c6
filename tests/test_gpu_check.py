"""bench/gpu_check.py --tiny runs end to end on the CPU and writes its documented schema."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402


def test_gpu_check_tiny(tmp_path):
    env = dict(os.environ, TRITON_DEFAULT_FP_FUSION="1")
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--tiny", "--iters", "2",
           "--out", str(tmp_path)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    corr = list(csv.DictReader((tmp_path / "correctness.csv").open()))
    tim = list(csv.DictReader((tmp_path / "timing.csv").open()))
    assert tuple(corr[0]) == gpu_check.CORRECTNESS_COLUMNS
    assert tuple(tim[0]) == gpu_check.TIMING_COLUMNS
    assert {r["case"] for r in corr} == set(gpu_check.CASES) | {"determinism"}
    assert all(r["ok"] == "1" and float(r["rel_err"]) <= float(r["tol"]) for r in corr)
    modes = {(r["mode"], r["N"]) for r in tim}
    assert modes == {(m, n) for m in ("fwd", "fwd+bwd", "fwd+bwd frozen_w") for n in ("8", "16")}
    for r in tim:
        assert r["status"] == "ok", r
        assert float(r["ms_median"]) >= float(r["ms_min"]) > 0
        assert float(r["ratio_to_floor"]) > 0
    md = (tmp_path / "gpu_check.md").read_text()
    assert "## Correctness" in md and "## Timing" in md
