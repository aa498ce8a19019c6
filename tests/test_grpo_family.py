"""The GRPO family's loss types and options (docs/math.md, "The GRPO family"): the reference
against an independent float64 reading (tests/naive.py), hand-worked cases of each new term,
the entropy's gradient against torch.autograd.gradcheck, and bad options."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fgrpo_kernels as fk
from fgrpo_kernels import reference as R
from fgrpo_kernels.core.options import LOSS_TYPE_SPECS, GRPOOptions, LossType
from fgrpo_kernels.divergences import NAMES
from fgrpo_kernels.testing import batches

from . import naive
from .epilogue_cases import grpo_options, side_inputs

MANY = settings(max_examples=40)
DOUBLE = dict(dtypes=(torch.float64,))


def _l(t):
    return None if t is None else t.tolist()


def _close(a, b, tol=1e-10):
    assert abs(float(a) - b) <= tol * max(1.0, abs(b)), (float(a), b)


def _naive_grpo(b, old, opts, rho, entropy, sampling, n_items, max_len):
    lt = opts["loss_type"]
    rho2 = None if rho is None else (rho[:, None] if rho.dim() == 1 else rho)
    return naive.grpo(
        _l(b.logps), _l(old), _l(b.ref_logps), _l(b.advantages), _l(b.mask.double()), lt,
        opts["beta"], opts["epsilon_low"], opts["epsilon_high"],
        opts["importance_sampling_level"], max_len, n_items, delta=opts["delta"],
        clip_c=opts["clip_ratio_c"], bias_kl=opts["use_bias_correction_kl"], rho=_l(rho2),
        entropy=_l(entropy), entropy_coef=opts["entropy_coef"],
        top_q=opts["top_entropy_quantile"], off_policy=opts["off_policy_mask_threshold"],
        sampling=_l(sampling),
        sapo=(opts.get("sapo_temperature_pos", 1.0), opts.get("sapo_temperature_neg", 1.05)),
        vespo=tuple(opts.get(k, d) for k, d in LOSS_TYPE_SPECS[LossType.VESPO].params),
    )  # fmt: skip


@MANY
@given(
    b=batches(**DOUBLE),
    opts=grpo_options(),
    ratio=st.sampled_from([None, "token", "row", "flat"]),
    no_old=st.booleans(),
    n_items=st.sampled_from([None, 7]),
    max_len=st.sampled_from([None, 12]),
    seed=st.integers(0, 2**31 - 1),
)
def test_grpo_family_matches_naive(b, opts, ratio, no_old, n_items, max_len, seed):
    old = None if no_old else b.old_logps
    rho, entropy, sampling = side_inputs(b, ratio, seed)
    got = R.grpo_loss(
        b.logps, old, b.ref_logps, b.advantages, b.mask, max_completion_length=max_len,
        num_items_in_batch=n_items, vllm_is_ratio=rho, entropy=entropy, sampling_logps=sampling,
        **opts,
    )  # fmt: skip
    _close(got, _naive_grpo(b, old, opts, rho, entropy, sampling, n_items, max_len))


@MANY
@given(
    b=batches(**DOUBLE),
    div=st.sampled_from(NAMES),
    level=st.sampled_from(["token", "sequence"]),
    ratio=st.sampled_from([None, "token", "row", "flat"]),
    coef=st.sampled_from([0.0, 0.1]),
    seed=st.integers(0, 2**31 - 1),
)
def test_fgrpo_ratio_and_entropy_bonus_match_naive(b, div, level, ratio, coef, seed):
    if level == "sequence" and ratio == "token":
        ratio = "row"
    rho, entropy, _ = side_inputs(b, ratio, seed)
    got = R.fgrpo_loss(
        b.logps, b.ref_logps, b.advantages, b.mask, div, 0.1, level, vllm_is_ratio=rho,
        entropy=entropy, entropy_coef=coef,
    )  # fmt: skip
    rho2 = None if rho is None else (rho[:, None] if rho.dim() == 1 else rho)
    red = "token_mean" if level == "token" else "seq_mean"
    want = naive.fgrpo(
        _l(b.logps), _l(b.ref_logps), _l(b.advantages), _l(b.mask.double()), div, 0.1, level,
        red, rho=_l(rho2), entropy=_l(entropy), entropy_coef=coef,
    )  # fmt: skip
    _close(got, want)


# ----------------------------------------------------------------------------- by hand


def _one_token(loss_type, lp, old, a, **options):
    """Loss and d loss / d logp of one token (B = T = 1) through the reference."""
    x = torch.tensor([[lp]], dtype=torch.float64, requires_grad=True)
    loss = R.grpo_loss(
        x, torch.tensor([[old]], dtype=torch.float64), None, torch.tensor([a], dtype=torch.float64),
        torch.ones(1, 1), loss_type, 0.0, **options,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, x)
    return float(loss.detach()), float(grad)


def test_dual_clip_caps_a_negative_advantage_cost_and_its_slope():
    # w = e^1 ≈ 2.72 with a = −1: the clipped surrogate costs 2.72, dual clip c = 2 caps it at 2
    loss, grad = _one_token("grpo", 1.0, 0.0, -1.0, clip_ratio_c=2.0)
    assert loss == pytest.approx(2.0) and grad == 0.0
    loss, grad = _one_token("grpo", 0.5, 0.0, -1.0, clip_ratio_c=2.0)  # w = 1.65 < c
    assert loss == pytest.approx(1.6487212707) and grad == pytest.approx(1.6487212707)


def test_delta_caps_the_unclipped_ratio():
    # a < 0, w = e^1: the unclipped branch min(w, δ)·a with δ = 1.5 wins; slope 0 beyond δ
    loss, grad = _one_token("dapo", 1.0, 0.0, -1.0, delta=1.5)
    assert loss == pytest.approx(1.5) and grad == 0.0


def test_cispo_coefficient_is_capped_and_detached():
    # w = e^1 > ε_high = 2: pt = −2·a·logp, d/dlogp = −2·a (the cap carries no gradient)
    loss, grad = _one_token("cispo", 1.0, 0.0, 0.5, epsilon_high=2.0)
    assert loss == pytest.approx(-2.0 * 0.5 * 1.0) and grad == pytest.approx(-1.0)


def test_sapo_gate_and_slope():
    # a > 0, τ₊ = 1, w = 1: pt = −a·4·σ(0) = −2a; slope −4a·σ(1 − σ)·w = −a
    loss, grad = _one_token("sapo", 0.0, 0.0, 0.5)
    assert loss == pytest.approx(-1.0) and grad == pytest.approx(-0.5)


def test_vespo_weight_is_one_at_ratio_one_and_detached():
    # w_seq = 1: φ = e^(λ − λ) = 1, pt = −a·logp, d/dlogp = −a whatever k, λ
    loss, grad = _one_token("vespo", -0.7, -0.7, 0.5, vespo_k_pos=5.0, vespo_lambda_pos=0.3)
    assert loss == pytest.approx(0.35) and grad == pytest.approx(-0.5)


def test_bias_corrected_kl_on_policy_keeps_the_ratio_slope():
    # old = logp (detached), ratio 1: d(β·k3·w)/dlogp = β·((1 − e^d) + k3)
    x = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5]], dtype=torch.float64)
    adv = torch.zeros(1, dtype=torch.float64)
    loss = R.grpo_loss(x, None, ref, adv, torch.ones(1, 1), "bnpo", 1.0,
                       use_bias_correction_kl=True)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, x)
    d = -0.5
    k3 = torch.tensor(d).exp() - d - 1
    assert float(loss) == pytest.approx(float(k3))
    assert float(grad) == pytest.approx(float(1 - torch.tensor(d).exp() + k3))


def test_off_policy_mask_drops_negative_far_off_rows_only():
    B, T = 3, 2
    lp = torch.full((B, T), -1.0, dtype=torch.float64)
    sampling = lp + torch.tensor([[0.5], [0.5], [0.1]], dtype=torch.float64)  # mean KL per row
    adv = torch.tensor([1.0, -1.0, -1.0], dtype=torch.float64)
    kwargs = dict(loss_type="bnpo", beta=0.0, sampling_logps=sampling)
    kept = R.grpo_loss(lp, lp, None, adv, torch.ones(B, T), **kwargs)
    masked = R.grpo_loss(
        lp, lp, None, adv, torch.ones(B, T), off_policy_mask_threshold=0.3, **kwargs
    )
    assert float(kept) == pytest.approx(1.0 / 3.0)  # −(1 − 1 − 1)·2 / 6
    assert float(masked) == pytest.approx(0.0)  # row 1 (a < 0, KL 0.5 > 0.3) dropped


def test_top_entropy_quantile_keeps_the_high_entropy_tokens():
    lp = torch.zeros(1, 4, dtype=torch.float64)
    adv = torch.ones(1, dtype=torch.float64)
    entropy = torch.tensor([[0.1, 0.4, 0.3, 0.2]], dtype=torch.float64)
    loss = R.grpo_loss(lp, None, None, adv, torch.ones(1, 4), "dapo", 0.0, entropy=entropy,
                       top_entropy_quantile=0.5)  # fmt: skip
    # quantile 0.5 of the four is 0.25: tokens 1 and 2 keep −1 each, out of 4 tokens
    assert float(loss) == pytest.approx(-0.5)


# ----------------------------------------------------------------------------- entropy gradient


def test_entropy_gradient_of_fused_logprobs_passes_gradcheck(monkeypatch):
    monkeypatch.setenv("FGRPO_BACKEND", "cpu")
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 6, -100, 3, 2])

    def entropy(h, w, b):
        return fk.fused_linear_logprobs(h, w, y, b, 0.8, return_entropy=True)[1]

    assert torch.autograd.gradcheck(entropy, (h, w, b))


@pytest.mark.parametrize(
    "make",
    [
        lambda: fk.FusedLinearGRPOLoss("grpo", 0.04, entropy_coef=0.3),
        lambda: fk.FusedLinearGRPOLoss("dapo", 0.0, entropy_coef=-0.2, top_entropy_quantile=0.3),
        lambda: fk.FusedLinearFGRPOLoss("js", 0.5, entropy_coef=0.3),
    ],
    ids=["grpo_bonus", "dapo_bonus_entropy_mask", "fgrpo_bonus"],
)
def test_entropy_bonus_gradient_passes_gradcheck(monkeypatch, make):
    monkeypatch.setenv("FGRPO_BACKEND", "cpu")
    gen = torch.Generator().manual_seed(1)
    B, T, H, V = 2, 3, 3, 7
    hidden = torch.randn(B, T, H, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(V, generator=gen, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([0.5, -1.0], dtype=torch.float64)
    old = -2 * torch.rand(B, T, generator=gen, dtype=torch.float64)
    ref = -2 * torch.rand(B, T, generator=gen, dtype=torch.float64)
    module = make()

    def loss(hidden, weight, bias):
        if isinstance(module, fk.FusedLinearFGRPOLoss):
            return module(hidden, weight, ids, mask, advantages=adv, ref_per_token_logps=ref,
                          bias=bias)[0]  # fmt: skip
        return module(hidden, weight, ids, mask, adv, bias, ref_per_token_logps=ref,
                      old_per_token_logps=old)[0]  # fmt: skip

    assert loss(hidden, weight, bias).dtype == torch.float64
    assert torch.autograd.gradcheck(loss, (hidden, weight, bias))


def test_returned_entropy_is_differentiable(monkeypatch):
    monkeypatch.setenv("FGRPO_BACKEND", "cpu")
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 3, 4, generator=gen, requires_grad=True)
    weight = torch.randn(9, 4, generator=gen, requires_grad=True)
    ids = torch.randint(0, 9, (2, 3), generator=gen)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    module = fk.FusedLinearGRPOLoss("grpo", 0.0)
    loss, metrics, entropy = module(hidden, weight, ids, mask, torch.randn(2), return_entropy=True)
    assert entropy.shape == (2, 3) and entropy.requires_grad and float(entropy[0, 2]) == 0.0
    (g,) = torch.autograd.grad(entropy.sum(), weight)
    want = R.logprobs(hidden, weight, ids, return_entropy=True)[1]
    (g_want,) = torch.autograd.grad((want * mask).sum(), weight)
    assert torch.allclose(g, g_want, atol=1e-5)


# ----------------------------------------------------------------------------- bad options


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        (
            dict(loss_type="cispo", importance_sampling_level="sequence"),
            "importance_sampling_level",
        ),
        (dict(loss_type="sapo", delta=2.0), "delta"),
        (dict(loss_type="vespo", clip_ratio_c=3.0), "clip_ratio_c"),
        (dict(loss_type="dapo", clip_ratio_c=1.0), "clip_ratio_c"),
        (dict(loss_type="dapo", delta=0.0), "delta"),
        (dict(loss_type="dapo", sapo_temperature_pos=1.0), "sapo_temperature_pos"),
        (dict(loss_type="sapo", vespo_k_pos=1.0), "vespo_k_pos"),
        (dict(loss_type="sapo", sapo_temperature_neg=0.0), "sapo_temperature_neg"),
        (dict(loss_type="vespo", vespo_lambda_neg=-1.0), "vespo_lambda_neg"),
        (dict(loss_type="dapo", top_entropy_quantile=1.5), "top_entropy_quantile"),
        (
            dict(loss_type="dapo", off_policy_mask_threshold=float("nan")),
            "off_policy_mask_threshold",
        ),
        (dict(loss_type="luspo2"), "loss_type"),
    ],
)
def test_options_that_do_not_apply_or_are_out_of_range_raise(kwargs, arg):
    base = dict(beta=0.04, epsilon_low=0.2, epsilon_high=0.2, importance_sampling_level="token",
                max_completion_length=None)  # fmt: skip
    base.update(kwargs)
    with pytest.raises(ValueError, match=f"^{arg}"):
        GRPOOptions.parse(**base)
    with pytest.raises(ValueError, match=f"^{arg}"):
        fk.FusedLinearGRPOLoss(**base)


def test_bad_vllm_is_ratio_and_missing_entropy_raise():
    b = torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3)
    with pytest.raises(ValueError, match="^vllm_is_ratio"):
        R.grpo_loss(b[0], None, None, b[1], b[2], vllm_is_ratio=torch.ones(2, 2))
    with pytest.raises(ValueError, match="^entropy"):
        R.grpo_loss(b[0], None, None, b[1], b[2], entropy_coef=0.1)
    with pytest.raises(ValueError, match="^vllm_is_ratio"):
        R.fgrpo_loss(b[0], b[0], b[1], b[2], level="sequence", vllm_is_ratio=torch.ones(2, 3))
