"""The KL estimator table: k3 is the GRPO losses' k3, the "+" forms take k2's gradient, and
OpenRLHF's compute_approx_kl (v0.11.0, 3c3be6234e0cb353e76bb8019947db9dfe99fca7) as transcribed
here from its maths; hand-computed values for verl's clamps."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fgrpo_kernels.core import grpo_math
from fgrpo_kernels.core.kl_estimators import ESTIMATORS, KLPenalty, kl_estimate


@st.composite
def pairs(draw):
    B, T = draw(st.integers(0, 3)), draw(st.integers(0, 5))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    scale = draw(st.sampled_from([0.1, 2.0, 30.0]))
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    ref = logp + scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < 0.7
    return logp, ref, mask


@given(batch=pairs())
def test_k3_is_the_grpo_k3_in_value_and_gradient(batch):
    logp, ref, mask = batch
    a, b = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    want = grpo_math.k3(ref, a, mask)
    got = kl_estimate(b, ref, mask=mask)  # the default is k3
    assert torch.equal(got, want)
    want.sum().backward()
    got.sum().backward()
    assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("name", ESTIMATORS)
@given(batch=pairs())
def test_plus_forms_keep_the_value_and_take_k2s_gradient(name, batch):
    logp, ref, mask = batch
    a, b = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    plain = kl_estimate(a, ref, name, mask)
    plus = kl_estimate(b, ref, name + "+", mask)
    torch.testing.assert_close(plus, plain.detach(), rtol=0, atol=0)
    plus.sum().backward()
    d = torch.where(mask, logp - ref, 0.0)
    torch.testing.assert_close(b.grad, d)  # ∂(½d²)/∂logp = d


def _openrlhf_approx_kl(log_probs, log_probs_base, kl_estimator):
    """OpenRLHF's compute_approx_kl, written from its maths: r = logp − base in fp32;
    k1 r, k2 r²/2, k3 e^{−r} − 1 + r; every one clamped to [−10, 10]."""
    r = log_probs.float() - log_probs_base.float()
    value = {"k1": r, "k2": r * r / 2, "k3": torch.exp(-r) - 1 + r}[kl_estimator]
    return torch.clamp(value, -10, 10)


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
@given(batch=pairs())
def test_openrlhf_estimators(name, batch):
    logp, ref, _ = batch
    logp, ref = logp.float(), ref.float()
    got = kl_estimate(logp, ref, name, source="openrlhf")
    torch.testing.assert_close(got, _openrlhf_approx_kl(logp, ref, name), rtol=1e-6, atol=1e-6)
    half = kl_estimate(logp.bfloat16(), ref.bfloat16(), name, source="openrlhf")
    assert half.dtype == torch.float32


def test_verl_low_var_kl_by_hand():
    logp = torch.tensor([0.0, 0.0, 0.0, -25.0, 0.0])
    ref = torch.tensor([0.0, 1.0, -1.0, 0.0, -25.0])
    # x = clamp(ref − logp, ±20): 0, 1, −1, 20, −20; clamp(e^x − x − 1, ±10)
    want = [0.0, math.e - 2.0, math.exp(-1.0), 10.0, 10.0]
    got = kl_estimate(logp, ref, "k3", source="verl")
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=1e-6)
    ours = kl_estimate(logp, ref, "k3")  # the GRPO k3: no clamps
    assert ours[3] == pytest.approx(math.exp(25.0) - 26.0, rel=1e-6)
    assert kl_estimate(logp, ref, "abs", source="verl").tolist() == [0, 1, 1, 25, 25]
    assert KLPenalty.parse("mse+", "verl") == KLPenalty.parse("k2", "verl")


@pytest.mark.parametrize(
    "name, source, arg",
    [("k4", "fgrpo", "kl_penalty"), ("full", "verl", "kl_penalty"),
     ("k3+", "openrlhf", "kl_estimator"), ("k3", "trlx", "source")],
)  # fmt: skip
def test_bad_names_list_the_choices(name, source, arg):
    with pytest.raises(ValueError, match=rf"^{arg}: expected one of .*'k1'|^{arg}: .*'verl'"):
        KLPenalty.parse(name, source)


def test_bad_tensors():
    with pytest.raises(ValueError, match="^ref:"):
        kl_estimate(torch.zeros(2, 3), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="^value_bound:"):
        KLPenalty(value_bound=0.0)
