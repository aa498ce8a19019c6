"""The GRPO family's β term with any KL estimator (`kl_penalty`; SPEC-variants §5): k3 stays
the default and the in-kernel one; every other estimator gives β·mean(estimate) on top of the
β = 0 loss, with its gradient, on torch, C++ and Triton, and the "kl" metric is its mean."""

import pytest
import torch

from fgrpo_kernels import FusedLinearGRPOLoss
from fgrpo_kernels.core.kl_estimators import KLPenalty

BETA = 0.3
NAMES = ["k1", "abs", "k2", "low_var_kl", "k3+", "k1+"]


def batch(seed=5, B=3, T=6, H=8, V=17):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=gen, requires_grad=True)
    w = torch.randn(V, H, generator=gen, requires_grad=True)
    ids = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.ones(B, T)
    mask[1, 4:] = 0
    adv = torch.tensor([1.0, -0.5, 0.0])
    ref = -3.0 + 2.0 * torch.randn(B, T, generator=gen)  # far from the policy: the bounds bite
    old = -3.0 + 0.3 * torch.randn(B, T, generator=gen)
    return h, w, ids, mask, adv, ref, old


@pytest.mark.parametrize("name", NAMES)
def test_the_kl_term_of_each_estimator(backend, name):
    h, w, ids, mask, adv, ref, old = batch()
    kw = {"ref_per_token_logps": ref, "old_per_token_logps": old}
    loss, metrics = FusedLinearGRPOLoss("dapo", beta=BETA, kl_penalty=name)(
        h, w, ids, mask, adv, **kw
    )
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    lp = torch.log_softmax(hd @ wd.T, -1).gather(-1, ids[..., None])[..., 0]
    kl = KLPenalty.parse(name)(lp, ref.double(), mask)
    with torch.enable_grad():
        policy, _ = FusedLinearGRPOLoss("dapo", beta=0.0)(
            hd.float(), wd.float(), ids, mask, adv, **kw
        )
    want_kl = (kl * mask).sum() / mask.sum()
    torch.testing.assert_close(
        loss.double(), policy.double() + BETA * want_kl, rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(metrics["kl"].double(), want_kl, rtol=1e-5, atol=1e-6)
    # the gradient of the KL part alone, against float64 autograd
    g_loss = torch.autograd.grad(loss, (h, w))
    g_policy = torch.autograd.grad(policy, (hd, wd))
    g_kl = torch.autograd.grad(BETA * want_kl, (hd, wd))
    for g, p, k in zip(g_loss, g_policy, g_kl):
        torch.testing.assert_close(g.double(), p + k, rtol=1e-4, atol=1e-5)


def test_k3_is_the_default_and_an_estimator_changes_the_loss(monkeypatch):
    monkeypatch.setenv("FGRPO_BACKEND", "cpu")
    h, w, ids, mask, adv, ref, old = batch()
    kw = {"ref_per_token_logps": ref, "old_per_token_logps": old}
    default, _ = FusedLinearGRPOLoss(beta=BETA)(h, w, ids, mask, adv, **kw)
    k3, _ = FusedLinearGRPOLoss(beta=BETA, kl_penalty="k3")(h, w, ids, mask, adv, **kw)
    k1, _ = FusedLinearGRPOLoss(beta=BETA, kl_penalty="k1")(h, w, ids, mask, adv, **kw)
    assert float(default.detach()) == float(k3.detach())
    assert abs(float(k1.detach()) - float(k3.detach())) > 1e-3
    assert FusedLinearGRPOLoss(beta=BETA, kl_penalty="k3").opts.kl_penalty is None


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"kl_penalty": "k4"}, ValueError, "^kl_penalty: expected one of 'k1', 'abs', 'k2'"),
        ({"kl_penalty": "k1", "use_bias_correction_kl": True}, ValueError,
         "^kl_penalty: use_bias_correction_kl corrects the k3 estimate only"),
    ],
)  # fmt: skip
def test_bad_estimators_are_named_errors(options, error, message):
    with pytest.raises(error, match=message):
        FusedLinearGRPOLoss(beta=BETA, **options)
