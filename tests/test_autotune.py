"""Autotuning: every candidate tile config computes the right gradients (interpreter), the
launchers time each candidate and keep the fastest per key, failures are skipped."""

from __future__ import annotations

import pytest
import torch

import fgrpo_kernels
from fgrpo_kernels.backends.triton import autotune, configs
from tests.test_logprob_triton import check_against_reference, make_inputs, rel_err, run_reference

KEY_DTYPES = {
    "lowp": (torch.bfloat16, torch.bfloat16),
    "lowp_fp32w": (torch.bfloat16, torch.float32),
    "tf32": (torch.float32, torch.float32),
    "fp32": (torch.float32, torch.float32),
}
# every (precision key, candidate) once: the same tiles serve the forward and the backward
CASES = sorted({(key, cfg) for (_, key), cands in configs.CANDIDATES.items() for cfg in cands},
               key=str)  # fmt: skip


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("FGRPO_BACKEND", "triton")
    monkeypatch.setattr(autotune, "_chosen", {})


def check_fast_fp32(inputs, tol):
    """fp32 inputs with fast_fp32 (TF32 tiles) against float64."""
    hidden, weight, bias, targets, g_logp, _ = inputs
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
    logp = fgrpo_kernels.fused_linear_logprobs(
        leaves[0], leaves[1], targets, leaves[2], fast_fp32=True
    )
    (logp * g_logp).sum().backward()
    want = run_reference(*inputs, entropy=False)
    assert rel_err(logp, want[0]) <= tol
    for got, ref in zip(leaves, want[2], strict=True):
        assert rel_err(got.grad, ref) <= tol


def case_id(case) -> str:
    key, c = case
    return f"{key}-{c.block_n}x{c.block_v}x{c.block_k}-w{c.num_warps}-s{c.num_stages}"


@pytest.mark.parametrize("key, cfg", CASES, ids=map(case_id, CASES))
def test_every_candidate_config_matches_reference(key, cfg):
    dt, wdt = KEY_DTYPES[key]
    inputs = make_inputs(37, 67, 301, dt, wdt, bias=True, seed=3)
    with configs.forced(cfg):
        if key == "tf32":
            check_fast_fp32(inputs, 1e-2)
        else:
            check_against_reference(inputs, 1e-5 if dt == torch.float32 else 2e-2, 0.8)


def test_launchers_time_every_candidate_and_keep_the_fastest(monkeypatch):
    """Tuning forced on under the interpreter: each bf16 candidate runs through the real
    forward and backward launchers; the fake clock makes the last one the fastest."""
    key = ("lowp", "bf16")
    cands = configs.CANDIDATES[("fwd", "lowp")]
    monkeypatch.setattr(configs, "candidates",
                        lambda kind, *a: configs.CANDIDATES[(kind, "lowp")])  # fmt: skip
    real_choose = autotune.choose
    monkeypatch.setattr(autotune, "choose", lambda k, c, run, tune: real_choose(k, c, run, True))
    launched = []

    def fake_clock(fn):
        fn()
        launched.append(1)
        return 1.0 / len(launched)

    monkeypatch.setattr(autotune, "time_ms", fake_clock)
    inputs = make_inputs(21, 45, 200, torch.bfloat16, torch.bfloat16, bias=True)
    check_against_reference(inputs, 2e-2, 0.9)
    picked = autotune.chosen()
    assert {k[0] for k in picked} == {"fwd", "bwd"}, key
    assert set(picked.values()) == {cands[-1]}
    assert len(launched) == 2 * len(cands)
    check_against_reference(inputs, 2e-2, 0.9)  # cached: no more timing
    assert len(launched) == 2 * len(cands)


def test_choose_skips_failing_candidates_and_caches(monkeypatch):
    cands = configs.CANDIDATES[("fwd", "lowp")]
    times = {cands[0]: 3.0, cands[1]: 1.0, cands[2]: None, cands[3]: 2.0}
    calls = []

    def run(cfg):
        calls.append(cfg)
        if times[cfg] is None:
            raise RuntimeError("out of resources: shared memory")
        return times[cfg]

    monkeypatch.setattr(autotune, "time_ms", lambda fn: fn())
    assert autotune.choose(("k",), cands, run, tune=True) == cands[1]
    assert autotune.choose(("k",), cands, run, tune=True) == cands[1]
    assert len(calls) == len(cands)
    assert autotune.choose(("k2",), cands, run, tune=False) == cands[0]
    monkeypatch.setenv(autotune.ENV, "0")
    assert autotune.choose(("k3",), cands, run, tune=True) == cands[0]
    assert len(calls) == len(cands)


def test_choose_raises_when_every_candidate_fails(monkeypatch):
    monkeypatch.setattr(autotune, "time_ms", lambda fn: fn())

    def run(cfg):
        raise RuntimeError(f"nope {cfg.block_n}")

    with pytest.raises(RuntimeError, match="nope"):
        autotune.choose(("k",), configs.CANDIDATES[("bwd", "fp32")], run, tune=True)


def test_bad_autotune_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv(autotune.ENV, "yes")
    with pytest.raises(ValueError, match=f"^{autotune.ENV}"):
        autotune.choose(("k",), configs.CANDIDATES[("bwd", "fp32")], lambda c: 0, tune=True)


@pytest.mark.parametrize("n, want", [(1, 1), (2, 2), (3, 4), (4096, 4096), (4097, 8192)])
def test_bucket_is_the_next_power_of_two(n, want):
    assert autotune.bucket(n) == want


def test_tuning_sets_are_small_and_avoid_the_spilling_tiles():
    """2-4 distinct candidates per key; no 128×256 or 256×128 tiles (they spill on sm_90a)."""
    for (_, key), cands in configs.CANDIDATES.items():
        assert 2 <= len(cands) <= 4 and len(set(cands)) == len(cands), key
        for cfg in cands:
            assert cfg.block_n * cfg.block_v <= 128 * 256, cfg
