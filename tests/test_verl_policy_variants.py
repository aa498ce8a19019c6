"""verl 0.9.1's policy losses (imported) against fgrpo_kernels.core.policy_variants_verl:
losses and gradients wrt logp, fp32, on drawn batches with empty rows, all-masked groups,
log-ratios of ±30 and zero advantages."""

import pytest

from .verl_guard import need_verl  # noqa: E402

verl = need_verl()

import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config.actor import ActorConfig, PolicyLossConfig  # noqa: E402

from fgrpo_kernels.core import policy_m2po as m2po  # noqa: E402
from fgrpo_kernels.core import policy_variants_verl as pv  # noqa: E402
from fgrpo_kernels.core import policy_variants_verl_pg as pvp  # noqa: E402

from .policy_cases import ADVS, base_batch, matrix  # noqa: E402


@st.composite
def batches(draw):
    logp, old, adv, mask = base_batch(draw)
    B, T = logp.shape
    a = adv[:, None].expand(B, T).clone()
    if draw(st.booleans()):  # verl's per-token advantages
        a = a + matrix(draw, B, T, ADVS)
    weights = torch.rand(B, T, generator=torch.Generator().manual_seed(B * T)) + 0.5
    return logp, old, a, mask, weights if draw(st.booleans()) else None


def config(**kw):
    policy = {k: kw.pop(k) for k in list(kw) if k in PolicyLossConfig.__dataclass_fields__}
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                       policy_loss=PolicyLossConfig(**policy), **kw)  # fmt: skip


def verl_run(mode, logp, old, a, mask, w, agg, **kw):
    fn = core_algos.get_policy_loss_fn(mode)
    lp = logp.clone().requires_grad_(True)
    loss, metrics = fn(old, lp, a, mask, loss_agg_mode=agg, config=config(**kw),
                       rollout_is_weights=w)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, lp, allow_unused=True)
    return loss.detach(), torch.zeros_like(lp) if grad is None else grad, metrics


def ours_run(fn, logp, old, a, mask, w, **kw):
    lp = logp.clone().requires_grad_(True)
    loss, metrics = fn(lp, old, a, mask, rollout_is_weights=w, **kw)
    (grad,) = torch.autograd.grad(loss, lp, allow_unused=True)
    return loss.detach(), torch.zeros_like(lp) if grad is None else grad, metrics


def close(ours, theirs, mask, what):
    (lo, go, mo), (lt, gt, mt) = ours, theirs
    if mask.sum() == 0:  # verl divides 0 by 0 here; ours is 0
        assert lo == 0 and (go == 0).all(), what
        return
    torch.testing.assert_close(lo, lt, rtol=1e-6, atol=1e-6, msg=what)
    torch.testing.assert_close(go, gt, rtol=1e-6, atol=1e-6, msg=what)
    for key, value in mt.items():
        torch.testing.assert_close(mo[key].float(), torch.tensor(float(value)), rtol=1e-5,
                                   atol=1e-6, msg=f"{what} {key}")  # fmt: skip


CASES = [
    ("vanilla", pv.vanilla_loss, {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}),
    ("gspo", pv.gspo_loss, {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}),
    ("gpg", pvp.gpg_loss, {}),
    ("dro", pvp.dro_loss, {"dro_beta": 0.3}),
    ("dppo_tv", pvp.dppo_tv_loss, {"clip_ratio_low": 0.15, "clip_ratio_high": 0.2}),
    ("dppo_kl", pvp.dppo_kl_loss, {"clip_ratio_low": 0.05, "clip_ratio_high": 0.1}),
    ("kl_cov", pvp.kl_cov_loss, {"kl_cov_ratio": 0.2, "ppo_kl_coef": 0.1}),
]


@pytest.mark.parametrize("mode,fn,kw", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("agg", pv.AGG_MODES)
@settings(max_examples=15, deadline=None)
@given(batch=batches())
def test_registry_loss_equals_verl(mode, fn, kw, agg, batch):
    logp, old, a, mask, w = batch
    theirs = verl_run(mode, logp, old, a, mask, w, agg, **kw)
    ours = ours_run(fn, logp, old, a, mask, w, loss_agg_mode=agg, **kw)
    close(ours, theirs, mask, f"{mode} {agg}")


@settings(max_examples=25, deadline=None)
@given(batch=batches(), seed=st.integers(0, 2**16))
def test_clip_cov_with_the_drawn_mask_equals_verl(batch, seed):
    logp, old, a, mask, w = batch
    kw = {"clip_cov_ratio": 0.3, "clip_cov_lb": -1.0, "clip_cov_ub": 5.0}
    torch.manual_seed(seed)
    theirs = verl_run("clip_cov", logp, old, a, mask, w, "token-mean", **kw)
    keep = pv.draw_clip_cov_keep(logp, old, a, mask, generator=torch.Generator().manual_seed(seed),
                                 **kw)  # fmt: skip
    ours = ours_run(pv.clip_cov_loss, logp, old, a, mask, w, clip_cov_keep=keep)
    close(ours, theirs, mask, "clip_cov")


@settings(max_examples=40, deadline=None)
@given(batch=batches())
def test_geo_mean_equals_verl(batch):
    logp, old, a, mask, w = batch
    kw = {"clip_ratio_low": 0.4, "clip_ratio_high": 0.3}
    theirs = verl_run("geo_mean", logp, old, a, mask, w, "token-mean", **kw)
    ours = ours_run(pv.geo_mean_loss, logp, old, a, mask, w, **kw)
    close(ours, theirs, torch.ones(1), "geo_mean")  # a mean over rows: finite without tokens


@pytest.mark.parametrize("agg", pv.AGG_MODES)
@settings(max_examples=15, deadline=None)
@given(batch=batches(), dp=st.integers(1, 3), scale=st.integers(1, 9))
def test_agg_loss_global_batch_arguments_equal_verl(agg, batch, dp, scale):
    logp, _, _, mask, _ = batch
    info = {"dp_size": dp, "batch_num_tokens": int(mask.sum()) + scale,
            "global_batch_size": mask.shape[0] + scale, "loss_scale_factor": scale}  # fmt: skip
    theirs = core_algos.agg_loss(logp, mask, agg, **info)
    torch.testing.assert_close(pv.agg_loss(logp, mask, agg, **info), theirs, rtol=1e-6, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(rewards=st.lists(st.sampled_from([0.0, 1.0, 0.5, -1.0]), min_size=1, max_size=8),
       groups=st.integers(1, 4))  # fmt: skip
def test_gpg_advantages_equal_verl(rewards, groups):
    import numpy as np

    B, T = len(rewards), 3
    token_rewards = torch.zeros(B, T)
    token_rewards[:, -1] = torch.tensor(rewards)
    mask = torch.ones(B, T)
    index = np.array([f"p{i % groups}" for i in range(B)], dtype=object)
    theirs, _ = core_algos.compute_gpg_outcome_advantage(token_rewards.clone(), mask, index)
    torch.testing.assert_close(pvp.gpg_advantages(token_rewards, mask, index), theirs)


def test_m2po_uses_the_vanilla_ppo_of_verl_with_its_clip_range():
    """M2PO's "vanilla" clip loss is verl's vanilla with the batch's (ε_low, ε_high)."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 6, generator=g) * 2
    old = logp + torch.randn(4, 6, generator=g) * 0.5
    a = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand(4, 6).clone()
    mask = torch.ones(4, 6)
    low, high, _ = m2po.m2po_clip_range(logp, old, a, mask, 0.04)
    theirs = verl_run("vanilla", logp, old, a, mask, None, "token-mean",
                      clip_ratio_low=low, clip_ratio_high=high)  # fmt: skip
    ours = ours_run(m2po.m2po_loss, logp, old, a, mask, None, clip_loss="vanilla")
    close(ours, theirs, mask, "m2po vanilla")


def test_every_registry_name_is_verls():
    for name in pvp.POLICY_LOSSES:
        assert core_algos.get_policy_loss_fn(name).__name__ == f"compute_policy_loss_{name}"
