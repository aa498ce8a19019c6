"""The Liger drop-in (fgrpo_kernels.integrations.liger) against Liger-Kernel 0.8.5's own
LigerFusedLinearGRPOLoss: every loss type × importance-sampling level × delta × vllm_is_ratio
shape × bias-corrected KL × β (cispo, sapo and vespo are token-level only, and ignore delta in
Liger and in the drop-in alike), on the CPU path and on the Triton path (interpreted). Loss,
metrics and the gradients of hidden, weight and bias agree within 1e-4 relative in fp32.

The one by-design difference, luspo over padding, has its own test: Liger sums luspo's [B, T]
per-token loss over every position, padding included; we mask it, as TRL 1.16 does.
"""

import itertools

import pytest
import torch

from fgrpo_kernels import reference as R
from fgrpo_kernels.core.options import LOSS_TYPE_SPECS, LossType, name_of
from fgrpo_kernels.integrations.liger import LigerFusedLinearGRPOLoss, liger_fused_linear_grpo
from fgrpo_kernels.testing import rel_error

liger = pytest.importorskip("liger_kernel.chunked_loss")

TOL = 1e-4
B, T, H, V = 3, 5, 8, 17


# Liger 0.8.5's loss types (a loss type Liger lacks has no parity to check).
LIGER_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")


def _configs():
    for lt, level, delta, ratio, bias_kl, beta in itertools.product(
        LossType, ("token", "sequence"), (None, 2.0), (None, "BT", "B1", "B"), (False, True),
        (0.0, 0.04),
    ):  # fmt: skip
        spec = LOSS_TYPE_SPECS[lt]
        if name_of(lt) not in LIGER_LOSS_TYPES:
            continue
        if level == "sequence" and spec.token_level_only:
            continue
        yield name_of(lt), level, delta, ratio, bias_kl, beta


CONFIGS = list(_configs())


def _data(full_mask: bool):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5
    bias = torch.randn(V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    if not full_mask:
        mask[1, 3:] = 0
        mask[2, 1] = 0
    adv = torch.tensor([-0.8, 1.1, 0.4])
    with torch.no_grad():
        lp = torch.log_softmax(hidden @ weight.T + bias, -1).gather(-1, ids[..., None])[..., 0]
    old = lp + 0.5 * torch.randn(B, T, generator=g)
    ref = lp + 0.5 * torch.randn(B, T, generator=g)
    rho = 0.5 + torch.rand(B, T, generator=g)
    return hidden, weight, bias, ids, mask, adv, old, ref, rho


def _run(module, data, ratio):
    hidden, weight, bias, ids, mask, adv, old, ref, rho = data
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    rho = {None: None, "BT": rho, "B1": rho[:, :1], "B": rho[:, 0]}[ratio]
    loss, metrics = module(*leaves[:2], ids, mask, adv, leaves[2], ref, old, vllm_is_ratio=rho)
    return loss, torch.autograd.grad(loss, leaves), metrics


def _errors(ours, theirs):
    (loss, grads, metrics), (loss_l, grads_l, metrics_l) = ours, theirs
    # a loss whose terms cancel keeps fp32's absolute error: compared absolutely below 0.1
    errs = {"loss": rel_error(loss, loss_l, 0.1)}
    for name, a, b in zip(("hidden", "weight", "bias"), grads, grads_l):
        errs[f"d/d{name}"] = rel_error(a, b, 1e-6)
    assert len(metrics) == len(metrics_l)
    for i, (a, b) in enumerate(zip(metrics, metrics_l)):
        errs[f"metric {i}"] = float((a - b).abs())
    return errs


@pytest.mark.parametrize(
    "loss_type,level,delta,ratio,bias_kl,beta", CONFIGS, ids=lambda v: str(v).lower()
)
def test_matches_liger_on_both_paths(monkeypatch, loss_type, level, delta, ratio, bias_kl, beta):
    kwargs = dict(
        beta=beta, loss_type=loss_type, importance_sampling_level=level, delta=delta,
        use_bias_correction_kl=bias_kl, max_completion_length=T + 2, chunk_size=B,
    )  # fmt: skip
    data = _data(full_mask=loss_type == "luspo")
    theirs = _run(liger.LigerFusedLinearGRPOLoss(compiled=False, **kwargs), data, ratio)
    for backend in ("cpu", "triton"):
        monkeypatch.setenv("FGRPO_BACKEND", backend)
        errs = _errors(_run(LigerFusedLinearGRPOLoss(**kwargs), data, ratio), theirs)
        assert max(errs.values()) <= TOL, (backend, errs)


def test_luspo_with_padding_follows_trl_not_liger(monkeypatch):
    """By design: with padding (and β ≠ 0, so the per-token loss is [B, T]) Liger's luspo adds
    the padding positions' KL; ours is TRL 1.16's Σ_i Σ_t mask·pt / B (the reference)."""
    monkeypatch.setenv("FGRPO_BACKEND", "cpu")
    kwargs = dict(beta=0.04, loss_type="luspo", importance_sampling_level="sequence")
    data = _data(full_mask=False)
    hidden, weight, bias, ids, mask, adv, old, ref, _ = data
    ours = _run(LigerFusedLinearGRPOLoss(**kwargs), data, None)[0]
    theirs = _run(liger.LigerFusedLinearGRPOLoss(compiled=False, **kwargs), data, None)[0]
    logps = R.logprobs(hidden.double(), weight.double(), ids, bias.double())
    trl = R.grpo_loss(logps, old.double(), ref.double(), adv.double(), mask, "luspo", 0.04,
                      importance_sampling_level="sequence")  # fmt: skip
    assert float(ours) == pytest.approx(float(trl), rel=1e-6)
    assert abs(float(ours) - float(theirs)) > 1e-4 * abs(float(theirs))


def test_positional_signature_and_return_convention():
    """Liger's positional order (…, advantages, bias, ref, old, ref_input, ref_weight, ref_bias,
    vllm_is_ratio, num_items_in_batch), its keyword names and `(loss, (kl, clip_ratio))`."""
    hidden, weight, bias, ids, mask, adv, old, ref, rho = _data(full_mask=False)
    module = LigerFusedLinearGRPOLoss(0.04, True, True, 1, 0.2, 0.28, "dapo")
    loss, metrics = module(hidden, weight, ids, mask, adv, bias, ref, old, None, None, None, rho, 7)
    assert isinstance(metrics, tuple) and len(metrics) == 2
    loss_kw, _ = module(
        _input=hidden, lin_weight=weight, selected_token_ids=ids, attention_mask=mask,
        advantages=adv, bias=bias, ref_per_token_logps=ref, old_per_token_logps=old,
        vllm_is_ratio=rho, num_items_in_batch=7,
    )  # fmt: skip
    loss_fn, _ = liger_fused_linear_grpo(
        hidden, weight, ids, mask, adv, bias, ref, old, None, None, None, 0.04, 0.2, 0.28, "dapo",
        None, "token", 1.0, 1.05, 1.0, True, True, 1, rho, None, False, 2.0, 3.0, 3.0, 2.0, 7,
    )  # fmt: skip
    assert float(loss) == float(loss_kw) == float(loss_fn)
    module.beta = 0.0  # attributes are read at each call, as in Liger
    assert len(module(hidden, weight, ids, mask, adv, bias, ref, old)[1]) == 1


def test_sequence_level_cispo_raises_at_the_call_like_liger():
    module = LigerFusedLinearGRPOLoss(
        beta=0.0, loss_type="cispo", importance_sampling_level="sequence"
    )
    hidden, weight, bias, ids, mask, adv, *_ = _data(full_mask=False)
    with pytest.raises(ValueError, match="Sequence-level importance sampling is not supported"):
        module(hidden, weight, ids, mask, adv)
