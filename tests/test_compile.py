"""The kernels compile for sm_90 ahead of time (no GPU): what only the interpreter takes fails."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fgrpo_kernels.backends.triton import configs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile") / "report.csv"
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    cmd = [sys.executable, str(ROOT / "bench" / "compile_report.py"), "--quick", "--arch", "90",
           "--csv", str(out)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return list(csv.DictReader(out.open()))


def test_compile_report_sm90(report):
    kernels = {r["kernel"] for r in report}
    assert {
        "_logprob_fwd_kernel",
        "_logprob_bwd_kernel",
        "_logits_stats_kernel",
        "_logits_grad_kernel",
        "_fgrpo_epilogue_kernel",
        "_grpo_epilogue_kernel",
        "_gift_epilogue_kernel",
    } == kernels
    for r in report:
        assert r["arch"] == "sm_90a"
        assert 0 < int(r["regs"]) <= 255, r
        if "logprob" in r["kernel"]:
            assert int(r["smem"]) > 0, r


def test_compile_report_covers_every_bf16_autotune_candidate(report):
    for kind in ("fwd", "bwd"):
        rows = {(r["tile"], int(r["warps"]), int(r["stages"])) for r in report
                if r["kernel"] == f"_logprob_{kind}_kernel"}  # fmt: skip
        want = {(f"{c.block_n}x{c.block_v}x{c.block_k}", c.num_warps, c.num_stages)
                for c in configs.CANDIDATES[(kind, "lowp")]}  # fmt: skip
        assert rows == want


def test_regression_no_register_spills_sm90(report):
    """Bug: the first backward kernel formed every tile index in int64 (rows, vocab columns,
    the dlogits store offsets and column mask); bf16 128x128x64 on sm_90 then used 255 registers
    and spilled 168 bytes. Tiles now add int32 in-tile offsets to an int64 base."""
    for r in report:
        assert int(r["spill_st"]) == 0 and int(r["spill_ld"]) == 0, r


def test_compile_report_covers_every_single_pass_row_kernel_variant(report):
    """The single pass's row kernels (`kernels.logits_rows`) at `configs.ROW_CONFIG`, for each
    operand dtype (bias and dlogits), with and without bias and entropy."""
    cfg = configs.ROW_CONFIG
    for kernel in ("_logits_stats_kernel", "_logits_grad_kernel"):
        rows = {(r["dtype"], r["bias"], r["entropy"]) for r in report if r["kernel"] == kernel}
        want = {(d, b, e) for d in ("fp32", "bf16", "fp16") for b in "01" for e in "01"}
        assert rows == want, kernel
        tiles = {(r["tile"], int(r["warps"])) for r in report if r["kernel"] == kernel}
        assert tiles == {(f"{c.block_n}x{c.block_v}", c.num_warps) for c in configs.ROW_CANDIDATES}
        tile = f"{cfg.block_n}x{cfg.block_v}"
        default = {(r["dtype"], r["bias"], r["entropy"]) for r in report
                   if r["kernel"] == kernel and r["tile"] == tile}  # fmt: skip
        assert default == want, kernel
