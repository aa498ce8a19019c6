"""The policy-loss variants on the fused head (`FusedLinearPolicyLoss`) against their float64
references (`core.policy_variants*`, themselves checked against TRL, verl and the M2PO fork in
test_policy_variants*.py) on every backend: loss and gradients in hidden and weight, on drawn
batches with empty rows, zero advantages and log-ratios up to ±30."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fgrpo_kernels.core.kl_estimators import KLPenalty
from fgrpo_kernels.core.policy_variants_verl import agg_loss
from fgrpo_kernels.core.rollout_correction import rollout_correction
from fgrpo_kernels.losses.policy import VARIANTS, FusedLinearPolicyLoss

BACKENDS = ["chunked", "cpp", "triton"]
OPTIONS = {"dro": {"dro_beta": 0.1}, "gmpo": {"beta": 0.05}, "gspo_token": {"beta": 0.05}}
DELTAS = st.one_of(st.sampled_from([0.0, 30.0, -30.0]), st.floats(-3.0, 3.0))


@pytest.fixture
def cpu_torch(monkeypatch):
    """The chunked-torch CPU backend, which takes float64."""
    monkeypatch.setenv("FGRPO_BACKEND", "cpu")
    monkeypatch.setenv("FGRPO_CPU_BACKEND", "torch")


def exact_logps(h, w, ids, mask):
    """float64 log-probs of the fp32 inputs, 0 where masked."""
    lp = torch.log_softmax(h.double() @ w.double().T, -1).gather(-1, ids[..., None])[..., 0]
    return lp * mask


@st.composite
def batches(draw):
    B, T = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    H, V = 8, draw(st.sampled_from([7, 33]))
    seed = draw(st.integers(0, 2**16))
    lengths = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
    deltas = draw(st.lists(DELTAS, min_size=B * T, max_size=B * T))
    advs = draw(st.lists(st.one_of(st.just(0.0), st.floats(-2.0, 2.0)), min_size=B, max_size=B))
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=gen)
    w = torch.randn(V, H, generator=gen)
    ids = torch.randint(0, V, (B, T), generator=gen)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).float()
    lp = exact_logps(h, w, ids, mask)
    # fp32 values, so the module (fp32) and the reference (float64) take the same side inputs
    old = ((lp + torch.tensor(deltas).reshape(B, T).double()) * mask).float().double()
    ref = ((lp - 0.5 * torch.tensor(deltas).reshape(B, T).double().clamp(-2, 2)) * mask).float()
    ref = ref.double()
    keep = torch.rand(B, T, generator=gen) > 0.3
    return h, w, ids, mask, torch.tensor(advs), old, ref, keep


def per_call(name, keep):
    return {"clip_cov_keep": keep} if name == "clip_cov" else {}


def check_against_reference(name, batch, module, **forward):
    h, w, ids, mask, adv, old, ref, keep = batch
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, metrics = module(
        hh,
        ww,
        ids,
        mask,
        adv.float(),
        old_per_token_logps=old.float(),
        ref_per_token_logps=ref.float(),
        **per_call(name, keep),
        **forward,
    )
    gh, gw = torch.autograd.grad(loss, (hh, ww), allow_unused=True)
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    # The reference sees the head's own log-prob values (so a top-k choice or a kink of |l| at
    # l = 0 falls the same way) with float64's gradient chain below them; the values' own
    # accuracy is test_logprobs'.
    with torch.no_grad():
        fused = module.batch(h, w, ids, mask, None).logps(module.head)[0].double()
    lp = exact_logps(h64, w64, ids, mask)
    lp = lp - lp.detach() + fused
    if name == "kl_cov":  # its top-k of a covariance ranks near-ties by the compute dtype's sums
        lp, old, adv = (lp - lp.detach()).float() + fused.float(), old.float(), adv.float()
    kw = dict(OPTIONS.get(name, {}))
    if VARIANTS[name].takes("ref_logp"):
        kw["ref_logp"] = ref.to(lp.dtype)
    want, _ = VARIANTS[name].fn(lp, old, adv, mask, **kw, **per_call(name, keep))
    want = want + module.kl_coef * agg_loss(
        module.kl_penalty(lp, ref.to(lp.dtype), mask), mask, module.kl_agg_mode
    )
    wh, ww_ = torch.autograd.grad(want, (h64, w64), allow_unused=True)
    scale = max(1.0, float(want.detach().abs()))
    assert (
        torch.isfinite(loss) and abs(float(loss.detach()) - float(want.detach())) <= 2e-5 * scale
    ), name
    for got, exp in ((gh, wh), (gw, ww_)):
        if exp is None:
            continue
        got = torch.zeros_like(exp) if got is None else got.double()
        tol = 2e-5 * max(1.0, float(exp.abs().max()))
        assert float((got - exp).abs().max()) <= tol, name
    return metrics


@pytest.mark.parametrize("name", sorted(VARIANTS))
@settings(max_examples=4)
@given(batch=batches())
def test_variant_equals_its_reference(backend, name, batch):
    module = FusedLinearPolicyLoss(name, **OPTIONS.get(name, {}))
    check_against_reference(name, batch, module)
    local = not isinstance(VARIANTS[name].locality, str)
    assert (
        module.last_pass == "single"
        if local
        else module.last_pass.startswith("two-pass: loss_mode=")
    )


@pytest.mark.parametrize("kl", ["k1", "abs", "k2", "k3", "low_var_kl", "k3+"])
@settings(max_examples=3)
@given(batch=batches())
def test_kl_term_of_every_estimator(kl, batch):
    module = FusedLinearPolicyLoss("vanilla", kl_coef=0.3, kl_penalty=kl)
    metrics = check_against_reference("vanilla", batch, module)
    assert "actor/kl_loss" in metrics and module.kl_penalty == KLPenalty.parse(kl)


def test_rollout_correction_weights_and_rejects_like_the_reference(cpu_torch):
    gen = torch.Generator().manual_seed(3)
    B, T, H, V = 3, 4, 8, 11
    h = torch.randn(B, T, H, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, generator=gen, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.ones(B, T)
    mask[2, 1:] = 0
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    old = -3.0 + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    rollout = old + 0.5 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    options = {
        "rollout_is": "token",
        "rollout_is_threshold": 2.0,
        "rollout_rs": "token_k1",
        "rollout_rs_threshold": "0.6_1.6",
    }
    module = FusedLinearPolicyLoss("vanilla", rollout_correction=options)
    loss, metrics = module(
        h, w, ids, mask, adv, old_per_token_logps=old, rollout_per_token_logps=rollout
    )
    lp = exact_logps(h, w, ids, mask)
    weights, kept, want_metrics = rollout_correction(lp, old, rollout, mask, options)
    want, _ = VARIANTS["vanilla"].fn(lp, old, adv, kept, rollout_is_weights=weights)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    for g, e in zip(torch.autograd.grad(loss, (h, w)), torch.autograd.grad(want, (h, w))):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)
    assert set(want_metrics) <= set(metrics)
    assert float(kept.sum()) < float(mask.sum())  # the rejection removed some tokens


def test_return_entropy_and_the_entropy_mask_of_gspo_token():
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(2, 3, 8, generator=gen, requires_grad=True)
    w = torch.randn(13, 8, generator=gen, requires_grad=True)
    ids = torch.randint(0, 13, (2, 3), generator=gen)
    module = FusedLinearPolicyLoss("gspo_token", top_entropy_quantile=0.5)
    loss, metrics, ent = module(
        h, w, ids, torch.ones(2, 3), torch.tensor([1.0, -1.0]), return_entropy=True
    )
    assert ent.shape == (2, 3) and ent.requires_grad and torch.isfinite(loss)
    (loss + ent.sum()).backward()
    assert torch.isfinite(h.grad).all()


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: FusedLinearPolicyLoss("nope"), ValueError, "^loss_mode: expected one of 'gmpo'"),
        (
            lambda: FusedLinearPolicyLoss("vanilla", epsilon=0.2),
            TypeError,
            "^epsilon: not an option of loss_mode='vanilla'; expected one of clip_ratio",
        ),
        (
            lambda: FusedLinearPolicyLoss("m2po", clip_loss="gpg"),
            ValueError,
            "^clip_loss: expected one of",
        ),
        (
            lambda: FusedLinearPolicyLoss("gmpo", rollout_correction={"rollout_is": "token"}),
            ValueError,
            "^rollout_correction: loss_mode='gmpo' takes no IS weights",
        ),
        (
            lambda: FusedLinearPolicyLoss(
                "vanilla", rollout_correction={"rollout_is": "token", "rollout_is_threshold": "5_2"}
            ),
            ValueError,
            "lower",
        ),
        (lambda: FusedLinearPolicyLoss("vanilla", kl_penalty="k9"), ValueError, "^kl_penalty"),
        # regression: dro without dro_beta used to pass the constructor and fail at forward
        (
            lambda: FusedLinearPolicyLoss("dro"),
            TypeError,
            "^dro_beta: loss_mode='dro' requires it",
        ),
        (
            lambda: FusedLinearPolicyLoss("vanilla", loss_agg_mode="mean"),
            ValueError,
            "^loss_agg_mode",
        ),
    ],
)
def test_bad_options_are_named(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_bad_inputs_are_named():
    h, w = torch.randn(2, 3, 8), torch.randn(13, 8)
    ids, mask, adv = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), torch.ones(2)
    with pytest.raises(TypeError, match="^clip_cov_keep: not an input of loss_mode='vanilla'"):
        FusedLinearPolicyLoss("vanilla")(h, w, ids, mask, adv, clip_cov_keep=mask.bool())
    with pytest.raises(ValueError, match="^ref_per_token_logps: expected"):
        FusedLinearPolicyLoss("vanilla", kl_coef=0.1)(h, w, ids, mask, adv)
    with pytest.raises(ValueError, match="^advantages: expected"):
        FusedLinearPolicyLoss("vanilla")(h, w, ids, mask, torch.ones(3))
    with pytest.raises(TypeError, match="^rollout_per_token_logps"):
        FusedLinearPolicyLoss("vanilla", rollout_correction={"rollout_is": "token"})(
            h, w, ids, mask, adv
        )
