"""The kernels compile for sm_90 ahead of time (no GPU): what only the interpreter takes fails."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_compile_report_sm90(tmp_path):
    out = tmp_path / "report.csv"
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    cmd = [sys.executable, str(ROOT / "bench" / "compile_report.py"), "--quick", "--arch", "90",
           "--csv", str(out)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    rows = list(csv.DictReader(out.open()))
    assert {r["kernel"] for r in rows} == {"_logprob_fwd_kernel", "_logprob_bwd_kernel"}
    for r in rows:
        assert r["arch"] == "sm_90a"
        assert 0 < int(r["regs"]) <= 255, r
        assert int(r["spill_st"]) >= 0 and int(r["smem"]) > 0, r
