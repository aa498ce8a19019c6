"""Rollout correction and KL estimators against verl 0.9.1's own functions, imported."""

import dataclasses

import pytest
import torch
from hypothesis import given, reject
from hypothesis import strategies as st

from .verl_guard import need_verl  # noqa: E402

verl = need_verl()

from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: E402
from verl.trainer.ppo import core_algos, rollout_corr_helper  # noqa: E402

from fgrpo_kernels.core.kl_estimators import KLPenalty  # noqa: E402
from fgrpo_kernels.core.rollout_correction import (  # noqa: E402
    REJECTION_MODES,
    RolloutCorrection,
    rollout_correction,
)
from fgrpo_kernels.core.rollout_sources import PRESETS  # noqa: E402

CONFIGS = [
    dict(rollout_is="token"),
    dict(rollout_is="sequence", rollout_is_threshold=3.0),
    dict(rollout_is="token", rollout_is_threshold="0.5_5.0"),
    dict(rollout_is="sequence", rollout_is_threshold="0.2_4.0"),
    dict(rollout_is="token", rollout_is_batch_normalize=True),
    dict(rollout_is="sequence", rollout_is_batch_normalize=True),
    dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"),
    dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
    dict(rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0"),
    dict(rollout_rs="token_k1,seq_mean_k1", rollout_rs_threshold="0.3_1.2,0.6_1.1"),
    dict(rollout_rs="token_k1,token_k2,seq_max_k3", rollout_rs_threshold="2.0,0.3,0.5"),
    dict(rollout_rs="seq_sum_k2,seq_mean_k2,token_k3,seq_max_k2", rollout_rs_threshold=0.4),
    dict(rollout_is="token", rollout_rs="seq_sum_k3", rollout_rs_threshold=1.5),
]


@st.composite
def batches(draw):
    B, T = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    scale = draw(st.sampled_from([0.05, 0.5, 3.0, 30.0]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    old = -torch.rand(B, T, generator=g) * 3
    mu = old - scale * torch.randn(B, T, generator=g)
    lp = old + 0.3 * torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) < draw(st.sampled_from([0.5, 0.9, 1.0]))).float()
    if B > 1 and draw(st.booleans()):
        mask[draw(st.integers(0, B - 1))] = 0.0  # an empty row
    if draw(st.booleans()):  # log-ratios at ±30
        old[0, 0], mu[0, 0] = 0.0, -30.0 * draw(st.sampled_from([1, -1]))
    mask[0, 0] = 1.0  # verl needs one valid token
    return lp, old, mu, mask


def _verl(lp, old, mu, mask, cfg, bypass=False):
    try:
        weights, new_mask, metrics = (
            rollout_corr_helper.compute_rollout_correction_and_rejection_mask(
                old_log_prob=lp if bypass else old, rollout_log_prob=mu, response_mask=mask, **cfg
            )
        )
    except ZeroDivisionError:  # verl's ESS metric when IcePop zeroes every weight
        reject()
    w = None if weights is None else weights.batch["rollout_is_weights"]
    return w, new_mask, metrics


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(map(str, c.values())))
@given(batch=batches())
def test_weights_mask_and_metrics_equal_verl(cfg, batch):
    lp, old, mu, mask = batch
    w_ref, mask_ref, met_ref = _verl(lp, old, mu, mask, {"rollout_is_threshold": 2.0, **cfg})
    w, new_mask, met = rollout_correction(lp, old, mu, mask, RolloutCorrection.parse(**cfg))
    if w_ref is not None:
        torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(w, mask)
    assert torch.equal(new_mask, mask_ref)
    assert met, "no metrics"
    for key, value in met.items():
        assert key in met_ref, key
        assert float(value) == pytest.approx(met_ref[key], rel=1e-5, abs=1e-6), key


@given(batch=batches())
def test_bypass_mode_uses_the_current_policy(batch):
    lp, old, mu, mask = batch
    cfg = dict(rollout_is="token", rollout_rs="token_k2", rollout_rs_threshold=0.5)
    w_ref, mask_ref, _ = _verl(lp, old, mu, mask, cfg, bypass=True)
    opts = RolloutCorrection.parse(**cfg, bypass_mode=True, loss_type="reinforce")
    w, new_mask, _ = rollout_correction(lp.requires_grad_(), None, mu, mask, opts)
    assert not w.requires_grad
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(new_mask, mask_ref)
    ppo = RolloutCorrection.parse(**cfg, bypass_mode=True)  # ppo_clip: the ratio holds the IS
    assert torch.equal(rollout_correction(lp, None, mu, mask, ppo)[0], mask)


@pytest.mark.parametrize("name", sorted(set(PRESETS) & set(dir(RolloutCorrectionConfig))))
def test_presets_are_verls_factories(name):
    fields = dataclasses.asdict(getattr(RolloutCorrectionConfig, name)())
    fields = {k: v for k, v in fields.items() if not k.startswith("_")}
    assert RolloutCorrection.parse(preset=name) == RolloutCorrection.parse(**fields)


def test_the_rejection_modes_are_verls():
    assert set(REJECTION_MODES) == rollout_corr_helper.SUPPORTED_ROLLOUT_RS_OPTIONS


@pytest.mark.parametrize("name", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
@pytest.mark.parametrize("plus", ["", "+"])
@given(batch=batches())
def test_kl_penalty_value_and_gradient_equal_verl(name, plus, batch):
    lp, ref, _, _ = batch
    a = lp.clone().requires_grad_()
    b = lp.clone().requires_grad_()
    want = core_algos.kl_penalty(a, ref, name + plus)
    got = KLPenalty.parse(name + plus, "verl")(b, ref)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(lp)
    (want * g).sum().backward()
    (got * g).sum().backward()
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-6)
