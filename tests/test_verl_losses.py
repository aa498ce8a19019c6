"""Our losses in verl's policy-loss registry (`fgrpo_kernels.integrations.verl_losses`), called
through `core_algos.get_policy_loss_fn` as verl's actor calls them: each f-GRPO mode equals the
float64 reference and our fused module (loss and gradients) under each `loss_agg_mode` it takes;
GIFT / FDO / f-HAL, bad aggregation modes and unknown modes are named errors."""

import pytest
import torch

from tests.verl_guard import need_verl

need_verl()

from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config.actor import ActorConfig, PolicyLossConfig  # noqa: E402

from fgrpo_kernels import FusedLinearFGRPOLoss, fused_linear_logprobs  # noqa: E402
from fgrpo_kernels.core.divergences import NAMES  # noqa: E402
from fgrpo_kernels.core.reference import fgrpo_loss  # noqa: E402
from fgrpo_kernels.integrations import verl_enable  # noqa: E402, F401  (registers the losses)

B, T, H, V = 4, 7, 8, 31
LENGTHS = [7, 3, 5, 1]
TOKEN_AGG = {"token-mean": "token_mean", "seq-mean-token-mean": "seq_mean", "token-sum": "sum"}


def config(beta=0.1, **kw):
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                       policy_loss=PolicyLossConfig(ppo_kl_coef=beta), **kw)  # fmt: skip


def batch(seed=0, dtype=torch.float64, lengths=LENGTHS, zero_adv=False):
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).to(dtype)
    old = -2.0 + 0.5 * torch.randn(B, T, generator=gen, dtype=dtype)
    logp = old + 0.8 * torch.randn(B, T, generator=gen, dtype=dtype)
    a = torch.tensor([1.3, -0.7, 0.0 if zero_adv else 0.4, -1.1], dtype=dtype)
    return logp, old, a, mask


def verl_call(mode, logp, old, a, mask, agg, cfg=None, weights=None):
    lp = logp.clone().requires_grad_()
    fn = core_algos.get_policy_loss_fn(mode)
    loss, metrics = fn(old, lp, a[:, None] * mask, mask, loss_agg_mode=agg,
                       config=cfg or config(), rollout_is_weights=weights)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, lp)
    return loss, grad, metrics


def ref_call(divergence, level, reduction, logp, old, a, mask, beta=0.1, ratio=None):
    lp = logp.clone().requires_grad_()
    loss = fgrpo_loss(lp, old, a, mask, divergence, beta, level, reduction, vllm_is_ratio=ratio)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss, grad


@pytest.mark.parametrize("divergence", NAMES)
@pytest.mark.parametrize("agg", list(TOKEN_AGG))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_token_modes_equal_the_reference(divergence, agg, dtype):
    logp, old, a, mask = batch(dtype=dtype)
    loss, grad, metrics = verl_call(f"fgrpo_{divergence}", logp, old, a, mask, agg)
    r_loss, r_grad = ref_call(divergence, "token", TOKEN_AGG[agg], *(t.double() for t in
                              (logp, old, a, mask)))  # fmt: skip
    # float64: up to verl's own 1e-8 in seq-mean-token-mean's divisor (L_i + 1e-8)
    tol = 1e-7 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(loss.double(), r_loss, rtol=tol, atol=tol)
    torch.testing.assert_close(grad.double(), r_grad, rtol=tol, atol=tol)
    assert set(metrics) == {"actor/ppo_kl", "actor/fgrpo_reward"}


@pytest.mark.parametrize("divergence", NAMES)
@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_sequence_modes_equal_the_reference(divergence, agg):
    logp, old, a, mask = batch(zero_adv=True)
    loss, grad, _ = verl_call(f"fgrpo_{divergence}_seq", logp, old, a, mask, agg)
    r_loss, r_grad = ref_call(divergence, "sequence", "seq_mean", logp, old, a, mask)
    torch.testing.assert_close(loss, r_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, r_grad, rtol=1e-12, atol=1e-12)


def test_token_mode_norm_and_beta_and_is_weights():
    """seq-mean-token-sum-norm is verl's seq-mean of row sums over T; β comes from
    policy_loss.ppo_kl_coef; rollout_is_weights multiply each token's cost."""
    logp, old, a, mask = batch(seed=3)
    w = 0.5 + torch.rand(B, T, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    loss, grad, _ = verl_call("fgrpo_pearson", logp, old, a, mask, "seq-mean-token-sum-norm",
                              cfg=config(beta=0.3), weights=w)  # fmt: skip
    r_loss, r_grad = ref_call("pearson", "token", "sum", logp, old, a, mask, beta=0.3, ratio=w)
    torch.testing.assert_close(loss, r_loss / (B * T), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, r_grad / (B * T), rtol=1e-12, atol=1e-12)


def test_an_empty_sequence_costs_nothing_at_sequence_level():
    logp, old, a, mask = batch(lengths=[7, 0, 5, 2])
    loss, grad, _ = verl_call("fgrpo_kl_seq", logp, old, a, mask, "seq-mean-token-mean")
    keep = mask.sum(-1) > 0
    r_loss, _ = ref_call("kl", "sequence", "seq_mean", logp[keep], old[keep], a[keep], mask[keep])
    torch.testing.assert_close(loss, r_loss, rtol=1e-12, atol=1e-12)
    assert torch.all(grad[1] == 0)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_equal_to_our_fused_module(level):
    """The verl loss on our fused head's log-probs equals FusedLinearFGRPOLoss on the same
    hidden states, with the old log-probs as the reference: loss and dL/dhidden, fp32."""
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(B, T, H, generator=gen)
    weight = torch.randn(V, H, generator=gen)
    ids = torch.randint(0, V, (B, T), generator=gen)
    _, old, a, mask = batch(dtype=torch.float32)
    suffix, reduction, agg = ("", "token_mean", "token-mean") if level == "token" else (
        "_seq", "seq_mean", "seq-mean-token-mean")  # fmt: skip
    results = []
    for path in ("verl", "module"):
        h = hidden.clone().requires_grad_()
        if path == "verl":
            logp = fused_linear_logprobs(h, weight, ids)
            fn = core_algos.get_policy_loss_fn(f"fgrpo_js{suffix}")
            loss, _ = fn(old, logp, a[:, None] * mask, mask, loss_agg_mode=agg, config=config())
        else:
            module = FusedLinearFGRPOLoss("js", 0.1, level, reduction)
            loss, _ = module(h, weight, ids, mask, advantages=a, ref_per_token_logps=old)
        (dh,) = torch.autograd.grad(loss, h)
        results.append((loss, dh))
    (loss, dh), (m_loss, m_dh) = results
    torch.testing.assert_close(loss, m_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(dh, m_dh, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["fgrpo_gift", "fgrpo_fdo", "fgrpo_fhal"])
def test_losses_verl_cannot_carry_are_named_errors(mode):
    logp, old, a, mask = batch()
    with pytest.raises(ValueError, match=f"loss_mode: '{mode}' cannot run as a verl policy loss"):
        verl_call(mode, logp, old, a, mask, "token-mean")


def test_sequence_level_refuses_token_aggregation():
    logp, old, a, mask = batch()
    with pytest.raises(ValueError, match="loss_agg_mode: sequence-level f-GRPO"):
        verl_call("fgrpo_tv_seq", logp, old, a, mask, "token-mean")


def test_an_unknown_mode_is_verls_named_error_not_a_fallback():
    with pytest.raises((ValueError, NotImplementedError), match="fgrpo_nope"):
        core_algos.get_policy_loss_fn("fgrpo_nope")


def test_registration_is_idempotent():
    from fgrpo_kernels.integrations.verl_losses import register_losses

    before = dict(core_algos.POLICY_LOSS_REGISTRY)
    register_losses()
    assert before == core_algos.POLICY_LOSS_REGISTRY
    assert {f"fgrpo_{n}" for n in NAMES} | {f"fgrpo_{n}_seq" for n in NAMES} <= set(before)
    assert "fgrpo" in core_algos.ADV_ESTIMATOR_REGISTRY


# ----------------------------------------------------------------------------- advantage estimator

UIDS = ["b", "a", "b", "c", "a", "b", "a", "c", "b"]  # groups of 4, 3 and 2, interleaved


def rewards_of(uids=UIDS, dtype=torch.float64, seed=3):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(len(uids), generator=gen, dtype=dtype)
    mask = (torch.arange(5)[None] < torch.randint(1, 6, (len(uids), 1), generator=gen)).to(dtype)
    token = torch.zeros(len(uids), 5, dtype=dtype)
    token[torch.arange(len(uids)), mask.sum(-1).long() - 1] = (
        scores  # verl: reward on the last token
    )
    return token, mask, scores


def expected_advantages(scores, uids, scale="group"):
    from fgrpo_kernels.core.reference import group_normalize

    out = torch.empty_like(scores)
    for uid in set(uids):
        rows = torch.tensor([i for i, u in enumerate(uids) if u == uid])
        out[rows] = group_normalize(scores[rows], len(rows), scale=scale)
    return out


def verl_advantage(token, mask, uids, cfg):
    """As verl's `ray_trainer.compute_advantage` calls a registered estimator (verl 0.9.1: the
    kwargs it builds for every estimator but gae/grpo; `index` only when the batch has `uid`).
    Importing ray_trainer itself needs verl's server extras (uvicorn, ...), not in the venv."""
    import numpy as np

    kwargs = {"token_level_rewards": token, "response_mask": mask, "config": cfg}
    if uids is not None:
        kwargs["index"] = np.array(uids, dtype=object)
    return core_algos.get_adv_estimator_fn(cfg.adv_estimator)(**kwargs)


@pytest.mark.parametrize("by_std", [True, False])
def test_the_fgrpo_advantage_estimator_is_group_normalize_over_uid(by_std):
    from verl.trainer.config import AlgoConfig

    token, mask, scores = rewards_of()
    cfg = AlgoConfig(adv_estimator="fgrpo", norm_adv_by_std_in_grpo=by_std)
    adv, ret = verl_advantage(token, mask, UIDS, cfg)
    want = expected_advantages(scores, UIDS, "group" if by_std else "none")
    torch.testing.assert_close(adv, want[:, None] * mask, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, adv)


def test_the_fgrpo_advantage_gives_a_group_of_one_zero():
    fn = core_algos.get_adv_estimator_fn("fgrpo")
    token, mask, _ = rewards_of(["x", "y", "y"])
    adv, _ = fn(token, mask, index=["x", "y", "y"])
    assert torch.all(adv[0] == 0) and torch.isfinite(adv).all()


def test_the_fgrpo_advantage_without_uid_is_a_named_error():
    import numpy as np
    from verl.trainer.config import AlgoConfig

    token, mask, _ = rewards_of()
    with pytest.raises(ValueError, match="uid"):
        verl_advantage(token, mask, None, AlgoConfig(adv_estimator="fgrpo"))
    fn = core_algos.get_adv_estimator_fn("fgrpo")
    with pytest.raises(ValueError, match="uid"):
        fn(token, mask, index=np.array(UIDS[:-1], dtype=object))
    with pytest.raises(ValueError, match="token_level_rewards"):
        fn(token * float("nan"), mask, index=UIDS)


def test_fgrpo_advantages_then_the_fgrpo_loss_equal_our_module_end_to_end():
    """rewards + uid → verl's estimator → verl's loss call == our FusedLinearFGRPOLoss given the
    same rewards' group_normalize advantages (rows ordered by group for our contiguous groups)."""
    fn = core_algos.get_adv_estimator_fn("fgrpo")
    uids = ["a", "b", "a", "b"]
    token, _, scores = rewards_of(uids)
    logp, old, _, mask = batch()
    adv, _ = fn(token, mask, index=uids)
    lp = logp.clone().requires_grad_()
    loss, _ = core_algos.get_policy_loss_fn("fgrpo_js")(
        old, lp, adv, mask, loss_agg_mode="token-mean", config=config()
    )
    a = expected_advantages(scores, uids)
    ref = fgrpo_loss(logp, old, a, mask, "js", 0.1, "token", "token_mean")
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
