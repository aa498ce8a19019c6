"""The rollout correction on the fused GRPO and f-GRPO modules (`rollout_correction=`): the same
option set as FusedLinearPolicyLoss's. GRPO with it equals verl's vanilla PPO loss with verl's
rollout IS weights and rejection mask (float64, exact); on every backend each module equals
itself without the correction, given the kept mask and the weights as its IS ratio; bad
combinations are named errors."""

import pytest
import torch

from fgrpo_kernels import FusedLinearFGRPOLoss, FusedLinearGRPOLoss
from fgrpo_kernels.core.rollout_correction import rollout_correction
from fgrpo_kernels.losses.policy import VARIANTS

TOKEN_IS = {
    "rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "token_k1",
    "rollout_rs_threshold": "0.6_1.6",
}  # fmt: skip
SEQUENCE_IS = {"rollout_is": "sequence", "rollout_is_threshold": 3.0}
REJECT_ONLY = {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.05}


def batch(dtype=torch.float32, seed=3, B=4, T=5, H=8, V=13):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=gen, dtype=dtype, requires_grad=True)
    w = torch.randn(V, H, generator=gen, dtype=dtype, requires_grad=True)
    ids = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.ones(B, T)
    mask[2, 2:] = 0
    mask[3, :] = 0  # an empty row
    adv = torch.tensor([1.0, -0.5, 2.0, 0.0], dtype=dtype)
    with torch.no_grad():
        lp = torch.log_softmax(h.double() @ w.double().T, -1).gather(-1, ids[..., None])[..., 0]
    old = (lp + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)).to(dtype)
    rollout = (old + 0.5 * torch.randn(B, T, generator=gen, dtype=torch.float64)).to(dtype)
    ref = (lp - 0.2).to(dtype)
    return h, w, ids, mask, adv, old, rollout, ref


def grads(loss, h, w):
    return torch.autograd.grad(loss, (h, w))


def test_grpo_with_the_correction_is_verl_vanilla_with_it(monkeypatch):
    """dapo without KL and with the dual clip c = 3 is verl's vanilla PPO loss (token-mean):
    with the correction both take verl's weights and rejection the same way."""
    monkeypatch.setenv("FGRPO_BACKEND", "cpu")
    monkeypatch.setenv("FGRPO_CPU_BACKEND", "torch")  # takes float64
    h, w, ids, mask, adv, old, rollout, _ = batch(torch.float64)
    module = FusedLinearGRPOLoss("dapo", beta=0.0, clip_ratio_c=3.0, rollout_correction=TOKEN_IS)
    loss, metrics = module(
        h, w, ids, mask, adv, old_per_token_logps=old, rollout_per_token_logps=rollout
    )
    lp = torch.log_softmax(h @ w.T, -1).gather(-1, ids[..., None])[..., 0] * mask
    weights, kept, want_metrics = rollout_correction(lp, old, rollout, mask, TOKEN_IS)
    want, _ = VARIANTS["vanilla"].fn(lp, old, adv, kept, rollout_is_weights=weights)
    # to fp32 round-off: the GRPO module takes the advantages in fp32
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-9)
    for g, e in zip(grads(loss, h, w), grads(want, h, w)):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-9)
    assert float(kept.sum()) < float(mask.sum())  # the rejection removed tokens
    for name, value in want_metrics.items():
        torch.testing.assert_close(metrics[name], value, rtol=1e-12, atol=0.0)


def expected_without_correction(module_cls, kwargs, options, inputs, per_token=True, **fwd):
    h, w, ids, mask, adv, old, rollout, ref = inputs
    weights, kept, _ = rollout_correction(old.double(), old.double(), rollout.double(), mask,
                                          options)  # fmt: skip
    ratio = None
    if weights is not None and options.get("rollout_is"):
        ratio = weights if per_token else (weights * kept).amax(-1)
        ratio = ratio.to(h.dtype)
    plain = module_cls(**kwargs)
    return plain(h, w, ids, kept, vllm_is_ratio=ratio, old_per_token_logps=old,
                 ref_per_token_logps=ref, **fwd)  # fmt: skip


@pytest.mark.parametrize("options", [TOKEN_IS, REJECT_ONLY], ids=["token-is", "reject-only"])
def test_grpo_correction_on_every_backend(backend, options):
    inputs = h, w, ids, mask, adv, old, rollout, ref = batch()
    kwargs = {"loss_type": "grpo", "beta": 0.04}
    module = FusedLinearGRPOLoss(**kwargs, rollout_correction=options)
    loss, metrics = module(h, w, ids, mask, adv, old_per_token_logps=old,
                           ref_per_token_logps=ref, rollout_per_token_logps=rollout)  # fmt: skip
    want, want_metrics = expected_without_correction(
        FusedLinearGRPOLoss, kwargs, options, inputs, advantages=adv
    )
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads(loss, h, w), grads(want, h, w)):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
    assert set(want_metrics) < set(metrics)  # plus the correction's
    assert any(k.startswith("rollout_corr/") for k in metrics), sorted(metrics)


@pytest.mark.parametrize(
    ("level", "options"),
    [("token", TOKEN_IS), ("sequence", SEQUENCE_IS), ("sequence", REJECT_ONLY)],
    ids=["token-is", "sequence-is", "sequence-reject"],
)
def test_fgrpo_correction_on_every_backend(backend, level, options):
    inputs = h, w, ids, mask, adv, old, rollout, ref = batch()
    kwargs = {"divergence": "kl", "beta": 0.1, "level": level}
    module = FusedLinearFGRPOLoss(**kwargs, rollout_correction=options)
    loss, metrics = module(h, w, ids, mask, advantages=adv, old_per_token_logps=old,
                           ref_per_token_logps=ref, rollout_per_token_logps=rollout)  # fmt: skip
    want, _ = expected_without_correction(
        FusedLinearFGRPOLoss, kwargs, options, inputs, per_token=level == "token", advantages=adv
    )
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads(loss, h, w), grads(want, h, w)):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


def test_the_correction_changes_the_loss(monkeypatch):
    """A test that cannot pass with the option ignored."""
    monkeypatch.setenv("FGRPO_BACKEND", "cpu")
    h, w, ids, mask, adv, old, rollout, ref = batch()
    args = (h, w, ids, mask, adv)
    kw = {"old_per_token_logps": old, "ref_per_token_logps": ref}
    plain, _ = FusedLinearGRPOLoss()(*args, **kw)
    fixed, _ = FusedLinearGRPOLoss(rollout_correction=TOKEN_IS)(
        *args, **kw, rollout_per_token_logps=rollout
    )
    assert abs(float(plain.detach()) - float(fixed.detach())) > 1e-4


@pytest.mark.parametrize(
    ("make", "call", "error", "message"),
    [
        (lambda: FusedLinearGRPOLoss(), {"rollout": True}, ValueError,
         "^rollout_per_token_logps: given without rollout_correction"),
        (lambda: FusedLinearGRPOLoss(rollout_correction=TOKEN_IS), {"old": False}, ValueError,
         "^old_per_token_logps: rollout_correction needs the old log-probs"),
        (lambda: FusedLinearGRPOLoss(rollout_correction=TOKEN_IS), {"ratio": True}, ValueError,
         "^vllm_is_ratio: pass vllm_is_ratio or rollout_correction, not both"),
        (lambda: FusedLinearGRPOLoss(rollout_correction={"bypass_mode": True}), {}, ValueError,
         "^rollout_correction: bypass mode"),
        (lambda: FusedLinearGRPOLoss(rollout_correction="token"), {}, TypeError,
         "^rollout_correction: expected a RolloutCorrection, a dict or None"),
        (lambda: FusedLinearGRPOLoss(rollout_correction={"rollout_is": "tokens"}), {}, ValueError,
         "rollout_is"),
        (lambda: FusedLinearFGRPOLoss(level="sequence", rollout_correction=TOKEN_IS), {},
         ValueError, "^rollout_correction: sequence-level f-GRPO weighs whole sequences"),
    ],
)  # fmt: skip
def test_bad_combinations_are_named_errors(monkeypatch, make, call, error, message):
    monkeypatch.setenv("FGRPO_BACKEND", "cpu")
    h, w, ids, mask, adv, old, rollout, ref = batch()
    with pytest.raises(error, match=message):
        module = make()
        kw = {"ref_per_token_logps": ref}
        kw["old_per_token_logps"] = old if call.get("old", True) else None
        if call.get("rollout", True) or "rollout" not in call:
            kw["rollout_per_token_logps"] = rollout
        if call.get("ratio"):
            kw["vllm_is_ratio"] = torch.ones(4, 5)
        if isinstance(module, FusedLinearFGRPOLoss):
            module(h, w, ids, mask, advantages=adv, **kw)
        else:
            module(h, w, ids, mask, adv, **kw)
