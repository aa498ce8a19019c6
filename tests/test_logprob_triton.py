"""The Triton log-prob kernels (interpreted on the CPU) against the float64 reference."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import fgrpo_kernels
from fgrpo_kernels import reference
from fgrpo_kernels.backends.triton import configs, launch

# the package exports the launchers under the modules' names: fetch the modules themselves
logprob_fwd = importlib.import_module("fgrpo_kernels.backends.triton.logprob_fwd")
logprob_bwd = importlib.import_module("fgrpo_kernels.backends.triton.logprob_bwd")

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}
KC = configs.KernelConfig


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("FGRPO_BACKEND", "triton")


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-30) -> float:
    """||a − b|| / max(||b||, floor), in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(floor))


def assert_close(name: str, got, want, tol: float) -> None:
    # Outputs near 0 (logp of a p ≈ 1 token, a gradient whose logp and entropy terms cancel on
    # one row) carry fp32's absolute error, not a relative one: norms floored at 0.1 per element.
    floor = 0.1 * want.numel() ** 0.5
    err = rel_err(got, want, floor)
    assert err <= tol, f"{name}: relative error ||a-b||/||b|| = {err:.3e} > {tol:.0e}"


def make_inputs(N, H, V, dtype, wdtype, bias, ignore_frac=0.2, scale=1.0, seed=0, ignore=-100):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * (2.0 * scale / H**0.5)).to(wdtype)
    b = (torch.randn(V, generator=g) * 0.5).to(wdtype) if bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    targets[torch.rand(N, generator=g) < ignore_frac] = ignore
    up = torch.randn(2, N, generator=g)
    return hidden, weight, b, targets, up[0], up[1]


def run(hidden, weight, bias, targets, g_logp, g_ent, temperature=1.0, entropy=True, ignore=-100,
        grads=(True, True, True)):  # fmt: skip
    """Our fwd + bwd: (logp, entropy | None, (dh, dw, db))."""
    leaves = [t.detach().clone().requires_grad_(r) if t is not None else None
              for t, r in zip((hidden, weight, bias), grads, strict=True)]  # fmt: skip
    out = fgrpo_kernels.fused_linear_logprobs(
        leaves[0], leaves[1], targets, leaves[2], temperature, ignore, return_entropy=entropy
    )
    logp, ent = out if entropy else (out, None)
    loss = (logp * g_logp).sum() + ((ent * g_ent).sum() if entropy else 0.0)
    if any(t is not None and t.requires_grad for t in leaves):
        loss.backward()
    return logp, ent, tuple(None if t is None else t.grad for t in leaves)


def run_reference(hidden, weight, bias, targets, g_logp, g_ent, temperature=1.0, entropy=True,
                  ignore=-100):  # fmt: skip
    leaves = [None if t is None else t.detach().double().requires_grad_() for t in
              (hidden, weight, bias)]  # fmt: skip
    out = reference.logprobs(leaves[0], leaves[1], targets, leaves[2], temperature, ignore,
                             return_entropy=entropy)  # fmt: skip
    logp, ent = out if entropy else (out, None)
    loss = (logp * g_logp.double()).sum() + ((ent * g_ent.double()).sum() if entropy else 0.0)
    loss.backward()
    return logp, ent, tuple(None if t is None else t.grad for t in leaves)


def check_against_reference(inputs, tol, temperature=1.0, entropy=True, ignore=-100):
    got = run(*inputs, temperature=temperature, entropy=entropy, ignore=ignore)
    want = run_reference(*inputs, temperature=temperature, entropy=entropy, ignore=ignore)
    hidden, weight, bias = inputs[:3]
    assert got[0].dtype == torch.float32 and got[0].shape == want[0].shape
    assert_close("logp", got[0], want[0], tol)
    if entropy:
        assert got[1].dtype == torch.float32
        assert_close("entropy", got[1], want[1], tol)
    for name, inp, g, w in zip(("d_hidden", "d_weight", "d_bias"), (hidden, weight, bias),
                               got[2], want[2], strict=True):  # fmt: skip
        if inp is None:
            continue
        assert g.dtype == inp.dtype and g.shape == inp.shape, name
        assert_close(name, g, w, tol)
    return got


@st.composite
def problems(draw):
    dtype, wdtype = draw(st.sampled_from([
        (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16), (torch.bfloat16, torch.float32),
    ]))  # fmt: skip
    block_v = draw(st.sampled_from([16, 32]))
    cfg = KC(draw(st.sampled_from([16, 32])), block_v, draw(st.sampled_from([16, 32])), 1, 1)
    return {
        "N": draw(st.integers(1, 40)),
        "H": draw(st.sampled_from([17, 33, 45, 67])),
        "V": draw(st.integers(5, 260)),
        "dtype": dtype,
        "wdtype": wdtype,
        "bias": draw(st.booleans()),
        "temperature": draw(st.sampled_from([1.0, 0.7, 2.3])),
        "entropy": draw(st.booleans()),
        "cfg": cfg,
        "splits": draw(st.integers(1, 4)),
        "wave": block_v * draw(st.integers(1, 3)),
        "seed": draw(st.integers(0, 2**16)),
    }


@given(p=problems())
def test_matches_reference(p):
    inputs = make_inputs(p["N"], p["H"], p["V"], p["dtype"], p["wdtype"], p["bias"], seed=p["seed"])
    with configs.forced(p["cfg"], splits=p["splits"], wave=p["wave"]):
        check_against_reference(inputs, TOL[p["dtype"]], p["temperature"], p["entropy"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_interpreter_config(dtype):
    """No forcing: the launchers' own choice of tiles, splits and waves."""
    inputs = make_inputs(37, 45, 301, dtype, dtype, bias=True)
    check_against_reference(inputs, TOL[dtype], temperature=0.9)


def test_backward_is_deterministic():
    inputs = make_inputs(33, 45, 150, torch.float32, torch.float32, bias=True)
    with configs.forced(KC(16, 16, 16, 1, 1), splits=3, wave=32):
        first = run(*inputs, temperature=0.8)[2]
        second = run(*inputs, temperature=0.8)[2]
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


class GemmSpy:
    def __init__(self, monkeypatch):
        self.calls = []
        real = logprob_bwd.gemm

        def spy(out, a, b, accumulate, how=None):
            # dH multiplies the strip [rows, wave], dW its transpose (not contiguous here)
            self.calls.append("dH" if a.is_contiguous() else "dW")
            return real(out, a, b, accumulate, how)

        monkeypatch.setattr(logprob_bwd, "gemm", spy)


@pytest.mark.parametrize(
    "grads, want",
    [((True, False, True), {"dH"}), ((False, True, True), {"dW"}), ((False, False, True), set())],
    ids=["frozen_lm_head", "frozen_hidden", "bias_only"],
)
def test_skips_unneeded_gemms(monkeypatch, grads, want):
    inputs = make_inputs(20, 33, 100, torch.float32, torch.float32, bias=True)
    spy = GemmSpy(monkeypatch)
    with configs.forced(KC(16, 16, 16, 1, 1), splits=2, wave=32):
        logp, ent, got = run(*inputs, grads=grads)
    assert set(spy.calls) == want
    if want:
        assert len(spy.calls) == 4  # one GEMM per wave: cdiv(100, 32) waves
    _, _, ref = run_reference(*inputs)
    for need, g, r in zip(grads, got, ref, strict=True):
        assert (g is None) != need
        if need:
            assert_close("grad", g, r, 1e-5)


def test_weight_frozen_in_place():
    """weight.requires_grad=False as users freeze an lm_head: works, weight.grad stays None."""
    hidden, weight, bias, targets, gl, _ = make_inputs(9, 17, 70, torch.bfloat16, torch.bfloat16,
                                                      bias=False)  # fmt: skip
    hidden.requires_grad_()
    logp = fgrpo_kernels.fused_linear_logprobs(hidden, weight, targets)
    (logp * gl).sum().backward()
    assert weight.grad is None and hidden.grad is not None and hidden.grad.dtype == torch.bfloat16


def test_large_logits_stay_finite():
    inputs = make_inputs(24, 33, 200, torch.float32, torch.float32, bias=True, scale=1e3)
    got = run(*inputs)
    want = run_reference(*inputs)
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all()
    assert all(torch.isfinite(g).all() for g in got[2])
    assert_close("logp", got[0], want[0], 1e-5)
    # peaked softmax: entropy ≈ 0, judged absolutely. Measured here: 5e-8 for the max-relative
    # accumulation, 5e-4 for the cancelling H = lse − Σ p·z.
    assert (got[1].double() - want[1]).abs().max() < 1e-6
    for name, g, w in zip(("d_hidden", "d_weight", "d_bias"), got[2], want[2], strict=True):
        assert_close(name, g, w, 1e-5)


class AllocationLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.nbytes)
        return out


def test_never_materialises_n_by_v():
    """No torch op (ours or the interpreter's) returns a tensor as large as a bf16 [N, V]."""
    N, H, V = 96, 17, 300  # N·V = 28800 > V·H, N·H and the strip N·wave
    inputs = make_inputs(N, H, V, torch.bfloat16, torch.float32, bias=True)
    with configs.forced(KC(16, 32, 16, 1, 1), splits=3, wave=64), AllocationLog() as log:
        run(*inputs)
    assert 0 < log.largest < N * V * 2, log.largest


def test_rejects_float64_naming_hidden():
    hidden, weight, _, targets, _, _ = make_inputs(4, 17, 40, torch.float64, torch.float64, False)
    with pytest.raises(TypeError, match="^hidden"):
        fgrpo_kernels.fused_linear_logprobs(hidden, weight, targets)


def test_interpreter_upcasts_low_precision_dots():
    fwd, bwd = logprob_fwd._logprob_fwd_kernel, logprob_bwd._logprob_bwd_kernel
    assert launch.interpreted(fwd) and launch.interpreted(bwd)
    assert launch.dot_flags(fwd, torch.bfloat16, False) == (True, "ieee")
    assert launch.dot_flags(bwd, torch.float32, True) == (False, "tf32")


# ------------------------------------------------------------------ named edge and regression cases

EDGES = {
    # (N, H, V, cfg, splits, wave, ignore_index)
    "single_token": (1, 17, 37, KC(16, 16, 16, 1, 1), 2, 16, -100),
    "vocab_smaller_than_tile": (5, 17, 7, KC(16, 32, 16, 1, 1), 4, 32, -100),
    "more_splits_than_tiles": (6, 33, 40, KC(16, 16, 16, 1, 1), 9, 16, -100),
    "hidden_smaller_than_k_tile": (7, 5, 50, KC(16, 16, 32, 1, 1), 2, 32, -100),
    "ignore_index_inside_vocab": (12, 33, 50, KC(16, 16, 16, 1, 1), 3, 16, 0),
}


@pytest.mark.parametrize("case", sorted(EDGES))
def test_edge_cases(case):
    N, H, V, cfg, splits, wave, ignore = EDGES[case]
    inputs = make_inputs(N, H, V, torch.float32, torch.float32, bias=True, ignore=ignore)
    inputs[3][-1] = V - 1  # a target in the last, partial tile
    with configs.forced(cfg, splits=splits, wave=wave):
        check_against_reference(inputs, 1e-5, temperature=1.3, ignore=ignore)


def test_all_rows_ignored_give_zero():
    inputs = make_inputs(10, 17, 40, torch.float32, torch.float32, bias=True, ignore_frac=1.0)
    logp, ent, grads = run(*inputs)
    assert not logp.any() and not ent.any()
    assert all(not g.any() for g in grads)


# ------------------------------------------------------------------ the tuning table's bounds


@given(N=st.integers(1, 1 << 17), V=st.integers(1, 1 << 18), want=st.none() | st.integers(1, 64),
       key=st.sampled_from(sorted(configs.CANDIDATES)), pick=st.integers(0, 3))  # fmt: skip
def test_vocab_splits_are_never_empty(N, V, want, key, pick):
    cands = configs.CANDIDATES[key]
    cfg = cands[pick % len(cands)]
    with configs.forced(splits=want):
        n_splits, per_split = configs.vocab_splits(N, V, cfg, torch.device("cpu"))
    n_tiles = -(-V // cfg.block_v)
    assert 1 <= n_splits <= n_tiles
    assert n_splits * per_split >= n_tiles > (n_splits - 1) * per_split  # the last split has work


# ------------------------------------------------------------------ regressions of bugs found


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_regression_no_nan_in_masked_vocab_columns():
    """Bug: the forward's entropy term e·u was formed before masking, 0·(−inf) = NaN in the
    columns past V (hidden by the where, but a NaN per padded column; numpy warns of it)."""
    inputs = make_inputs(7, 17, 37, torch.float32, torch.float32, bias=True)
    with configs.forced(KC(16, 32, 16, 1, 1), splits=1, wave=32):
        check_against_reference(inputs, 1e-5)
