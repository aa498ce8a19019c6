"""The rollout-correction option set where verl is not installed: against OpenRLHF's PolicyLoss
(v0.11.0, 3c3be6234e0cb353e76bb8019947db9dfe99fca7) and TRL 1.16's GRPOTrainer IS ratio, each
transcribed here from its maths; verl's cases computed by hand; the named errors."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fgrpo_kernels.core.rollout_correction import RolloutCorrection, rollout_correction


@st.composite
def batches(draw, dtype=torch.float32):
    B, T = draw(st.integers(0, 4)), draw(st.integers(0, 6))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    scale = draw(st.sampled_from([0.05, 0.5, 3.0, 30.0]))
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    mu = old - scale * torch.randn(B, T, generator=g, dtype=dtype)
    mask = (torch.rand(B, T, generator=g) < draw(st.sampled_from([0.0, 0.5, 1.0]))).float()
    if B and T and draw(st.booleans()):
        old[0, 0], mu[0, 0] = 0.0, draw(st.sampled_from([30.0, -30.0]))
    return old + 0.1, old, mu, mask


def _openrlhf_factor(old, mu, mask, kind, lo, hi):
    """What PolicyLoss multiplies the per-token loss by: ρ = e^{old − mu}; tis clamp(ρ, lo, hi);
    icepop ρ·1[lo ≤ ρ ≤ hi]; seq-mask-tis 1[lo ≤ exp(masked mean log ρ) ≤ hi]·ρ."""
    lr = old - mu
    rho = torch.exp(lr)
    if kind == "tis":
        return rho.clamp(lo, hi)
    if kind == "icepop":
        return rho * ((rho >= lo) & (rho <= hi))
    seq = torch.exp((lr * mask).sum(-1) / mask.sum(-1))
    return ((seq >= lo) & (seq <= hi)).unsqueeze(-1) * rho


@pytest.mark.parametrize("kind", ["tis", "icepop", "seq-mask-tis"])
@given(batch=batches(), bounds=st.sampled_from([(0.5, 5.0), (0.9, 1.1), (0.01, 100.0)]))
def test_openrlhf_policy_loss_factor(kind, batch, bounds):
    lp, old, mu, mask = batch
    opts = RolloutCorrection.parse(
        enable_vllm_is_correction=True, vllm_is_truncated_threshold=list(bounds),
        vllm_is_correction_type=kind,
    )  # fmt: skip
    w, new_mask, metrics = rollout_correction(lp, old, mu, mask, opts)
    want = _openrlhf_factor(old, mu, mask, kind, *bounds) * mask
    torch.testing.assert_close(w, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(new_mask, mask)  # OpenRLHF's denominator keeps every token
    if mask.sum() > 0:
        vllm_kl = ((mu - old) * mask).sum() / mask.sum()
        torch.testing.assert_close(metrics["vllm_kl"], vllm_kl, rtol=1e-6, atol=1e-6)


def _trl_ratio(old, mu, mask, mode, lo, hi):
    """GRPOTrainer's importance_sampling_ratio: d = (old − mu)·mask, per token or summed per
    sequence; ρ = e^d; *_truncate clamps into [lo, hi], *_mask zeroes ρ outside."""
    d = (old - mu) * mask
    if mode.startswith("sequence"):
        d = d.sum(-1, keepdim=True)
    rho = torch.exp(d)
    if mode.endswith("truncate"):
        return rho.clamp(lo, hi)
    low = -math.inf if lo is None else lo
    high = math.inf if hi is None else hi
    return rho.masked_fill((rho < low) | (rho > high), 0.0)


@pytest.mark.parametrize(
    "mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
)
@given(batch=batches(), bounds=st.sampled_from([(None, 3.0), (0.5, 2.0), (0.2, None)]))
def test_trl_importance_sampling_ratio(mode, batch, bounds):
    lp, old, mu, mask = batch
    lo, hi = bounds
    opts = RolloutCorrection.parse(
        vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=lo,
        vllm_importance_sampling_clip_max=hi,
    )  # fmt: skip
    w, _, metrics = rollout_correction(lp, old, mu, mask, opts)
    want = _trl_ratio(old, mu, mask, mode, lo, hi)
    finite = torch.isfinite(want.expand_as(mask)) | (mask == 0)  # TRL's e^d overflows past 88
    torch.testing.assert_close(
        w[finite], (want.expand_as(mask) * mask)[finite], rtol=1e-6, atol=1e-6
    )
    assert torch.isfinite(w).all()
    if mode.startswith("sequence") and torch.isfinite(want).all() and want.numel():
        torch.testing.assert_close(
            metrics["sampling/importance_sampling_ratio/max"], want.max(), rtol=1e-6, atol=0
        )


def test_verl_weights_by_hand():
    lr = torch.tensor([[math.log(3.0), math.log(0.5), 0.0]], dtype=torch.float64)
    zero, mask = torch.zeros_like(lr), torch.ones_like(lr)

    def weights(**kw):
        return rollout_correction(zero, lr, zero, mask, RolloutCorrection.parse(**kw))[0][0]

    assert weights(rollout_is="token").tolist() == pytest.approx([2.0, 0.5, 1.0])
    assert weights(rollout_is="sequence").tolist() == pytest.approx([1.5] * 3)
    assert weights(rollout_is="token", rollout_is_threshold="0.6_2.5").tolist() == [0, 0, 1]
    normed = weights(rollout_is="token", rollout_is_batch_normalize=True)  # mean 3.5 / 3
    assert normed.tolist() == pytest.approx([2.0 / 3.5 * 3, 0.5 / 3.5 * 3, 1.0 / 3.5 * 3])
    assert weights(preset="geo_rs").tolist() == [1.0, 1.0, 1.0]  # no IS weights


def test_verl_rejection_by_hand():
    # row 0: log ρ = 0 (kept by everything); row 1: mean log ρ = 0.01; row 2: log ρ = ln 3
    lr = torch.tensor([[0.0, 0.0], [0.02, 0.0], [math.log(3.0), 0.0]], dtype=torch.float64)
    zero, mask = torch.zeros_like(lr), torch.ones_like(lr)
    mask[2, 1] = 0.0

    def kept(**kw):
        return rollout_correction(zero, lr, zero, mask, RolloutCorrection.parse(**kw))[1]

    # Geo-RS keeps −mean log ρ in [ln 0.999, ln 1.001]: −0.01 < −0.0010005
    assert kept(preset="Geo-RS").tolist() == [[1, 1], [0, 0], [0, 0]]
    # K3-RS: mean(ρ − 1 − log ρ) ≤ 0.01; row 1: (e^0.02 − 1.02)/2 = 1e-4; row 2: 2 − ln 3
    assert kept(preset="k3_rs").tolist() == [[1, 1], [1, 1], [0, 0]]
    # Seq-RS: −Σ log ρ in [ln 0.5, ln 2]: row 2's −ln 3 < ln 0.5
    assert kept(preset="seq_rs").tolist() == [[1, 1], [1, 1], [0, 0]]
    # k1 tests −log ρ (verl's code): row 1's −0.01 lies in [ln 0.5, ln 1], row 2's −ln 3 not
    asym = kept(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.5_1.0")
    assert asym.tolist() == [[1, 1], [1, 1], [0, 0]]
    both = kept(rollout_rs="token_k2,seq_max_k3", rollout_rs_threshold="1.0,1e-4")
    assert both.tolist() == [[1, 1], [0, 0], [0, 0]]  # seq_max_k3 of row 1: ~2.0e-4 > 1e-4


@given(batch=batches(dtype=torch.float64))
def test_pure_and_finite(batch):
    lp, old, mu, mask = batch
    lp = (lp * 40).requires_grad_()  # log-ratios far past the ±20 bound
    before = [t.detach().clone() for t in (lp, old, mu, mask)]
    for kw in [
        dict(rollout_is="sequence", rollout_is_batch_normalize=True, rollout_rs="seq_sum_k3",
             rollout_rs_threshold=2.0, bypass_mode=True, loss_type="reinforce"),
        dict(vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_max=None),
    ]:  # fmt: skip
        w, m, metrics = rollout_correction(lp, old, mu, mask, RolloutCorrection.parse(**kw))
        assert not w.requires_grad and torch.isfinite(w).all() and (w[mask == 0] == 0).all()
        assert all(torch.isfinite(v) for v in metrics.values())
        assert m.dtype == mask.dtype
    for t, b in zip((lp, old, mu, mask), before):
        assert torch.equal(t.detach(), b)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(rollout_rs="seq_max_k1", rollout_rs_threshold=2.0), "^rollout_rs: .*'token_k1'"),
        (dict(rollout_rs="token_k4", rollout_rs_threshold=2.0), "^rollout_rs: expected one of"),
        (dict(rollout_is="token", rollout_is_threshold="5_0.5"), "^rollout_is_threshold: .*lower"),
        (dict(rollout_is="token", rollout_is_threshold=0.0), "^rollout_is_threshold: .*positive"),
        (dict(rollout_is="tokens"), "^rollout_is: expected one of 'token', 'sequence'"),
        (dict(rollout_rs="token_k2"), "^rollout_rs_threshold: required"),
        (dict(rollout_rs="token_k2", rollout_rs_threshold="0.1_2"), "^rollout_rs_threshold: "),
        (dict(rollout_rs="token_k1,seq_sum_k2", rollout_rs_threshold="1,2,3"), "expected 1 or 2"),
        (dict(preset="geo"), "^preset: expected one of .*'geo_rs'"),
        (dict(loss_type="ppo"), "^loss_type: expected one of 'ppo_clip', 'reinforce'"),
        (dict(rollout_is_thresold=2.0), "^rollout_is_thresold: unknown option"),
        (dict(rollout_is="token", vllm_importance_sampling_mode="token_mask"), "several sources"),
        (dict(enable_vllm_is_correction=True, vllm_is_truncated_threshold=[5.0, 0.5]), "lower"),
        (dict(enable_vllm_is_correction=True, vllm_is_correction_type="tis2"), "'icepop'"),
        (dict(vllm_is_correction_type="icepop"), "^enable_vllm_is_correction: "),
        (dict(vllm_importance_sampling_mode="token"), "'token_truncate'"),
        (dict(vllm_importance_sampling_clip_min=4.0), "^vllm_importance_sampling_clip_min: "),
        (dict(level="token", lower=3.0, upper=2.0), "^lower: .*lower <= upper"),
        (dict(level="token", upper=-1.0), "^upper: "),
        (dict(bound="clip"), "^bound: expected one of 'none', 'truncate', 'mask'"),
    ],
)
def test_bad_options_name_the_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        RolloutCorrection.parse(**kw)


def test_bad_types_and_tensors():
    with pytest.raises(TypeError, match="^rollout_is_batch_normalize:"):
        RolloutCorrection.parse(rollout_is_batch_normalize="yes")
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="^old_logp: required"):
        rollout_correction(x, None, x, x, RolloutCorrection())
    with pytest.raises(ValueError, match="^mask:"):
        rollout_correction(x, x, x, torch.ones(2, 2), None)
    spelled = RolloutCorrection.parse(is_correction_enable=True, is_correction_type="icepop")
    cli = RolloutCorrection.parse(**{"algo.advantage.is_correction_enable": True,
                                     "algo.advantage.is_correction_type": "icepop"})  # fmt: skip
    assert (
        spelled
        == cli
        == RolloutCorrection.parse(enable_vllm_is_correction=True, vllm_is_correction_type="icepop")
    )
