"""Extreme but finite inputs give a finite loss and finite gradients on every module."""

import importlib.util

import pytest
import torch

import fgrpo_kernels as fk
from fgrpo_kernels.divergences import NAMES

HAS_TRITON_PATH = importlib.util.find_spec("fgrpo_kernels.backends.triton.epilogue") is not None
BACKENDS = [
    "cpu",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            not HAS_TRITON_PATH, reason="Triton kernels not built in this checkout"
        ),
    ),
]
B, T, H, V = 4, 5, 6, 13


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("FGRPO_BACKEND", request.param)
    return request.param


def _inputs(scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(B, T, H, generator=g) * scale).requires_grad_(True)
    w = torch.randn(V, H, generator=g).requires_grad_(True)
    b = torch.randn(V, generator=g).requires_grad_(True)
    ids = torch.randint(0, V, (B, T), generator=g)
    return h, w, b, ids


def _finite(loss, *leaves):
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    assert torch.isfinite(loss), loss
    for g in grads:
        assert g is None or torch.isfinite(g).all()
    return grads


ADV = torch.tensor([1.0, -1.0, 0.5, -0.5])
CHOSEN = torch.tensor([True, False, True, False])


REWARDS = torch.tensor([1.0, 0.0, 0.3, 0.3])


def _all_modules(h, w, b, ids, mask, ref, rewards=REWARDS, old=None):
    yield fk.FusedLinearFGRPOLoss(num_generations=2)(
        h, w, ids, mask, rewards=rewards, ref_per_token_logps=ref, bias=b
    )[0]
    yield fk.FusedLinearGRPOLoss()(
        h, w, ids, mask, ADV, b, ref_per_token_logps=ref, old_per_token_logps=old
    )[0]
    for detach in (False, True):
        yield fk.FusedLinearGIFTLoss(2, detach_stats=detach)(h, w, ids, mask, rewards, ref, bias=b)[
            0
        ]
    yield fk.FusedLinearFDOLoss()(h, w, ids, mask, CHOSEN, ref, bias=b)[0]


def test_logits_times_1e3(backend):
    h, w, b, ids = _inputs(scale=1e3)
    ref = torch.full((B, T), -3.0)
    for loss in _all_modules(h, w, b, ids, torch.ones(B, T), ref):
        _finite(loss, h, w, b)
    lp, ent = fk.fused_linear_logprobs(h, w, ids, b, return_entropy=True)
    _finite(lp.sum() + ent.sum(), h, w, b)


@pytest.mark.parametrize("div", NAMES)
@pytest.mark.parametrize("r", [500.0, -500.0])
def test_sequence_implicit_rewards_of_500(backend, div, r):
    h, w, b, ids = _inputs()
    beta = 0.1
    with torch.no_grad():
        lp = fk.fused_linear_logprobs(h, w, ids, b)
    ref = lp - r / (beta * T)  # β Σ_t (logp − ref) = r for every row
    for level in ("sequence", "token"):
        module = fk.FusedLinearFGRPOLoss(div, beta, level)
        loss, m = module(
            h, w, ids, torch.ones(B, T), advantages=ADV, ref_per_token_logps=ref, bias=b
        )
        _finite(loss, h, w, b)
        assert all(torch.isfinite(v) for v in m.values())
    loss, _ = fk.FusedLinearFDOLoss(div, beta)(h, w, ids, torch.ones(B, T), CHOSEN, ref, bias=b)
    _finite(loss, h, w, b)


def test_fully_masked_rows(backend):
    h, w, b, ids = _inputs()
    mask = torch.ones(B, T)
    mask[1] = 0
    mask[3] = 0
    ref = torch.full((B, T), -2.0)
    for loss in _all_modules(h, w, b, ids, mask, ref):
        gh, _, _ = _finite(loss, h, w, b)
        assert (gh[1] == 0).all() and (gh[3] == 0).all()
    empty = torch.zeros(B, T)
    loss, _ = fk.FusedLinearGRPOLoss()(h, w, ids, empty, ADV, ref_per_token_logps=ref)
    gh, gw = _finite(loss, h, w)
    assert loss == 0 and (gh == 0).all() and (gw == 0).all()


def test_zero_variance_groups(backend):
    h, w, b, ids = _inputs()
    flat = torch.tensor([0.7, 0.7, 1.0, 1.0])
    for loss in _all_modules(h, w, b, ids, torch.ones(B, T), torch.full((B, T), -2.0), flat):
        _finite(loss, h, w, b)
    same = h.detach().clone()
    same[1], same[3] = same[0], same[2]  # identical completions inside each group
    same.requires_grad_(True)
    ids2 = ids.clone()
    ids2[1], ids2[3] = ids2[0], ids2[2]
    for detach in (False, True):
        loss, _ = fk.FusedLinearGIFTLoss(2, detach_stats=detach)(
            same,
            w,
            ids2,
            torch.ones(B, T),
            torch.tensor([1.0, 0.0, 1.0, 0.0]),
            torch.full((B, T), -2.0),
        )
        _finite(loss, same, w)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("log_ratio", [200.0, -200.0])
def test_grpo_ratios_of_e200(backend, level, log_ratio):
    h, w, b, ids = _inputs()
    with torch.no_grad():
        lp = fk.fused_linear_logprobs(h, w, ids, b)
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        module = fk.FusedLinearGRPOLoss(loss_type, 0.04, importance_sampling_level=level)
        loss, m = module(
            h,
            w,
            ids,
            torch.ones(B, T),
            ADV,
            b,
            ref_per_token_logps=lp + log_ratio,
            old_per_token_logps=lp - log_ratio,
        )
        _finite(loss, h, w, b)
        assert all(torch.isfinite(v) for v in m.values())
