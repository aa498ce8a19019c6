"""Backward numerics on every backend (Triton under the interpreter, C++, chunked PyTorch):
fp16 gradients of a small upstream gradient at the fp16 rounding floor, and NaN/inf hidden
states at ignored positions kept out of every gradient."""

from __future__ import annotations

import pytest
import torch

import fgrpo_kernels
from fgrpo_kernels import reference
from fgrpo_kernels.backends.triton import configs
from fgrpo_kernels.backends.triton.logprob_bwd import STRIP_EXP, strip_scale
from tests.test_logprob_triton import KC, rel_err

BACKENDS = ("triton", "cpp", "torch")


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    if request.param == "triton":
        monkeypatch.setenv("FGRPO_BACKEND", "triton")
    else:
        monkeypatch.setenv("FGRPO_BACKEND", "cpu")
        monkeypatch.setenv("FGRPO_CPU_BACKEND", request.param)
    return request.param


def grads(hidden, weight, bias, targets, g_up, entropy=False):
    leaves = [None if t is None else t.detach().clone().requires_grad_()
              for t in (hidden, weight, bias)]  # fmt: skip
    fused = hidden.dtype != torch.float64
    fn = fgrpo_kernels.fused_linear_logprobs if fused else reference.logprobs
    out = fn(leaves[0], leaves[1], targets, leaves[2], 0.9, return_entropy=entropy)
    logp, ent = out if entropy else (out, None)
    loss = (logp * g_up[0].to(logp.dtype)).sum()
    if entropy:
        loss = loss + (ent * g_up[1].to(ent.dtype)).sum()
    loss.backward()
    return [None if t is None else t.grad for t in leaves]


@pytest.mark.parametrize("g", [1.5e-5, 1e-6])
def test_regression_fp16_small_upstream_gradient_reaches_rounding_floor(backend, g):
    """Bug: the Triton backward stored the dlogits strip in fp16 unscaled; with a mean-style
    upstream gradient g·p fell into fp16's subnormals. N 48, H 64, V 1000 against float64:
    dH error 5.5× the floor at g = 1.5e-5 and 2.6× at 1e-6 before (dW 3.8× and 1.5×); the C++
    and chunked backends were at the floor. The floor is the exact gradient rounded to fp16."""
    gen = torch.Generator().manual_seed(0)
    N, H, V = 48, 64, 1000
    hidden = torch.randn(N, H, generator=gen).half()
    weight = (torch.randn(V, H, generator=gen) * (2.0 / H**0.5)).half()
    targets = torch.randint(0, V, (N,), generator=gen)
    g_up = torch.full((2, N), g)
    # two waves and three N-chunks on the Triton path
    with configs.forced(KC(16, 256, 32, 1, 1), splits=2, wave=512, chunk=16):
        got = grads(hidden, weight, None, targets, g_up)
    want = grads(hidden.double(), weight.double(), None, targets, g_up)
    for name, a, b in zip(("d_hidden", "d_weight"), got[:2], want[:2], strict=True):
        floor = rel_err(b.half(), b)
        err = rel_err(a, b)
        assert a.dtype == torch.float16
        assert err <= 1.02 * floor, f"{name}: {err:.3e} vs the fp16 floor {floor:.3e}"


@pytest.mark.parametrize("mags", [(1e-6, None), (3.0, 50.0), (0.0, None), (1e-30, 2e-30)])
def test_strip_scale_is_an_exact_power_of_two(mags):
    g_mag, ent_mag = mags
    valid = torch.tensor([True, True, False])
    g = torch.tensor([g_mag, -g_mag / 3, 1e6])  # the ignored row's g does not count
    g_ent = None if ent_mag is None else torch.tensor([0.0, ent_mag, -1e9])
    scale, inv = strip_scale(valid, g, g_ent, inv_t=1 / 0.7)
    assert scale.dtype == inv.dtype == torch.float32 and float(scale) * float(inv) == 1.0
    mantissa, _ = torch.frexp(scale)
    assert float(mantissa) == 0.5  # a power of two
    largest = max(g_mag, ent_mag or 0.0) / 0.7
    if largest == 0:
        assert float(scale) == 1.0
    else:
        assert 2.0 ** (STRIP_EXP - 1) <= largest * float(scale) < 2.0**STRIP_EXP


def test_strip_scale_saturates_instead_of_overflowing():
    valid = torch.tensor([True])
    scale, inv = strip_scale(valid, torch.tensor([1e-44]), None, inv_t=1.0)
    assert torch.isfinite(scale) and float(inv) > 0
    scale, inv = strip_scale(valid, torch.tensor([3e38]), None, inv_t=1.0)
    assert torch.isfinite(inv) and float(scale) > 0


POISONS = {"nan_row": float("nan"), "inf_entry": float("inf"), "neg_inf_entry": -float("inf")}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the interpreter's NaN rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_regression_non_finite_hidden_at_ignored_rows_stays_out(backend, dtype):
    """Bug: ignored rows were zeroed by multiplying by g = 0, so a NaN or inf hidden state at an
    ignored position (e.g. a padded position of a fully masked attention row) made dW NaN on
    every backend, and dH and db NaN on the Triton and chunked ones. The gradients now equal
    those of the same batch with those rows set to 0, and the rows' dH is exactly 0."""
    gen = torch.Generator().manual_seed(1)
    N, H, V = 41, 33, 150
    hidden = torch.randn(N, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.3
    bias = torch.randn(V, generator=gen)
    targets = torch.randint(0, V, (N,), generator=gen)
    g_up = torch.randn(2, N, generator=gen)
    bad = [3, 17, 40]
    targets[bad] = -100
    clean = hidden.clone()
    clean[bad] = 0.0
    hidden[3] = POISONS["nan_row"]
    hidden[17, 5] = POISONS["inf_entry"]
    hidden[40, 0] = POISONS["neg_inf_entry"]
    x = [t.to(dtype) for t in (hidden, weight, bias)]
    c = [t.to(dtype) for t in (clean, weight, bias)]
    with configs.forced(KC(16, 32, 16, 1, 1), splits=2, wave=64, chunk=16):
        got = grads(*x, targets, g_up, entropy=True)
        want = grads(*c, targets, g_up, entropy=True)
    for name, a, b in zip(("d_hidden", "d_weight", "d_bias"), got, want, strict=True):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) <= 1e-6, name
    assert not got[0][bad].any()
