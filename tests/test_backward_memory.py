"""The Triton backward's tiling: scratch bounded whatever N·H, both loop orders exact, and the
peak extra memory of a backward measured (interpreter, fresh process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fgrpo_kernels
from fgrpo_kernels.backends.triton import configs
from tests.test_logprob_triton import KC, check_against_reference, make_inputs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("FGRPO_BACKEND", "triton")


@given(N=st.integers(1, 1 << 21), H=st.integers(1, 16384), V=st.integers(1, 1 << 18),
       align=st.sampled_from([(16, 32), (128, 128), (128, 256)]), fp32_dh=st.booleans(),
       fp32_dw=st.booleans(),
       scratch=st.sampled_from([1 << 12, 1 << 20, configs.SCRATCH]))  # fmt: skip
def test_plan_bounds_every_scratch_buffer(N, H, V, align, fp32_dh, fp32_dw, scratch):
    with configs.forced(scratch=scratch):
        plan = configs.backward_plan(N, H, V, *align, fp32_dh=fp32_dh, fp32_dw=fp32_dw)
    an, av = align
    assert 1 <= plan.chunk <= N and 1 <= plan.wave <= V
    assert plan.chunk == N or plan.chunk % an == 0
    assert plan.wave == V or plan.wave % av == 0
    # strip [chunk, wave]; block accumulators and operand copies [chunk, H], [wave, H]
    assert plan.chunk * plan.wave <= max(scratch, an * av, an * plan.wave, plan.chunk * av)
    assert plan.chunk * H <= max(scratch, an * H)
    assert plan.wave * H <= max(scratch, av * H)
    # a full fp32 copy only when both axes take several tiles, and then the smaller one
    full_dh = fp32_dh and plan.full_dh(N, V)
    full_dw = fp32_dw and plan.full_dw(N, V)
    several = plan.chunk < N and plan.wave < V
    assert not (full_dh or full_dw) or several
    if several and fp32_dh and fp32_dw:
        assert (full_dw and V <= N) or (full_dh and N < V)


def test_plan_at_the_sizes_of_the_issue():
    """N 1M, H 16k, V 152k, bf16: dW accumulates over N-chunks in fp32 (4·V·H = 9.3 GiB), not
    the 4·N·H = 64 GiB fp32 dH plus an N·H strip that did not fit an H200."""
    N, H, V = 1 << 20, 16384, 151936
    plan = configs.backward_plan(N, H, V, 128, 256, fp32_dh=True, fp32_dw=True)
    assert plan.rows_outer and plan.full_dw(N, V) and not plan.full_dh(N, V)
    assert plan.chunk * H <= configs.SCRATCH and plan.chunk * plan.wave <= configs.SCRATCH


# (hidden dtype, weight dtype): fp32 accumulates in the gradients themselves, bf16 in fp32
# buffers, bf16 + fp32 weight mixes both
DTYPES = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "bf16_fp32w": (torch.bfloat16, torch.float32),
    "fp16": (torch.float16, torch.float16),
}


@pytest.mark.parametrize("rows_outer", [True, False], ids=["rows_outer", "cols_outer"])
@pytest.mark.parametrize("dtypes", sorted(DTYPES))
def test_both_loop_orders_match_reference(dtypes, rows_outer):
    """3 N-chunks × 4 waves: block accumulators, the full fp32 copy and in-place fp32 gradients
    all finish every block exactly once."""
    dt, wdt = DTYPES[dtypes]
    inputs = make_inputs(37, 33, 120, dt, wdt, bias=True)
    tol = 1e-5 if dt == torch.float32 else 2e-2
    with configs.forced(KC(16, 16, 16, 1, 1), splits=2, chunk=16, wave=32, rows_outer=rows_outer):
        check_against_reference(inputs, tol, temperature=0.8)


def _proc_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def backward_peak_child() -> None:
    """In a fresh interpreter process: the resident-set rise during one bf16 backward, beyond
    its gradients, as JSON on stdout (malloc returns big blocks to the OS when freed)."""
    torch.manual_seed(0)
    n, h, v = 8192, 1024, 160
    hidden = torch.randn(n, h).bfloat16().requires_grad_()
    weight = (torch.randn(v, h) / h**0.5).bfloat16().requires_grad_()
    with configs.forced(KC(256, 256, 256, 1, 1), scratch=1 << 18):
        loss = fgrpo_kernels.fused_linear_logprobs(hidden, weight, torch.randint(0, v, (n,)))
        loss = loss.sum()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # NB: the high-water mark restarts from the current resident set
        before = _proc_kib("VmRSS:")
        loss.backward()
        rise = (_proc_kib("VmHWM:") - before) * 1024
    grads = hidden.grad.nbytes + weight.grad.nbytes
    print(json.dumps({"extra_mib": (rise - grads) / 2**20, "fp32_dh_mib": 4 * n * h / 2**20}))


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_regression_backward_extra_memory_is_a_fixed_scratch():
    """Bug: the backward kept an fp32 dH [N, H] (4·N·H bytes), an N·H strip and a final
    full-size cast alive together, ~8·N·H bytes beyond the inputs. Measured here, bf16 N 8192
    × H 1024 (the fp32 dH alone: 32 MiB): 56.6 MiB extra before, 6-10 MiB after (scratch of
    2^18 elements: blocks of 256 rows)."""
    env = dict(os.environ, TRITON_INTERPRET="1", FGRPO_BACKEND="triton",
               MALLOC_MMAP_THRESHOLD_=str(1 << 20))  # fmt: skip
    code = "from tests.test_backward_memory import backward_peak_child; backward_peak_child()"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600, check=True, cwd=ROOT)  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # Bound at 3/4 of the fp32 dH: a clean-clone CI run (2026-12-07) read 16.07 MiB once, the
    # bf16 dH (16 MiB) resident beside the scratch; the bug's 56.6 MiB and the fp32 dH still fail.
    assert result["extra_mib"] < result["fp32_dh_mib"] * 3 / 4, result
