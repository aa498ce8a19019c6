"""reference.grpo_loss equals Liger-Kernel's LigerFusedLinearGRPOLoss (CPU, compiled=False)."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fgrpo_kernels import reference as R
from fgrpo_kernels.testing import linear_batches, rel_error

liger = pytest.importorskip("liger_kernel.chunked_loss.grpo_loss")


def _ours(lb, loss_type, level, beta, temperature):
    b = lb.batch
    leaves = [t.clone().requires_grad_(True) for t in (lb.hidden, lb.weight, lb.bias)]
    logps = R.logprobs(leaves[0], leaves[1], lb.completion_ids, leaves[2], temperature)
    loss = R.grpo_loss(
        logps,
        b.old_logps,
        b.ref_logps,
        b.advantages,
        b.mask,
        loss_type,
        beta,
        importance_sampling_level=level,
        max_completion_length=logps.shape[1] + 3,
    )
    return loss, torch.autograd.grad(loss, leaves)


def _liger(lb, loss_type, level, beta, temperature):
    b = lb.batch
    leaves = [t.clone().requires_grad_(True) for t in (lb.hidden, lb.weight, lb.bias)]
    module = liger.LigerFusedLinearGRPOLoss(
        beta=beta,
        compiled=False,
        use_ref_model=beta != 0.0,
        loss_type=loss_type,
        max_completion_length=lb.hidden.shape[1] + 3,
        importance_sampling_level=level,
        temperature=temperature,
    )
    loss, _ = module(
        leaves[0],
        leaves[1],
        lb.completion_ids,
        b.mask.float(),
        b.advantages,
        bias=leaves[2],
        ref_per_token_logps=b.ref_logps,
        old_per_token_logps=b.old_logps,
    )
    return loss, torch.autograd.grad(loss, leaves)


# cispo, sapo and vespo are token-level only (both libraries refuse "sequence").
LEVELS = [(t, lv) for t in R.LOSS_TYPES for lv in R.LEVELS
          if lv == "token" or t not in ("cispo", "sapo", "vespo")]  # fmt: skip


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type,level", LEVELS)
@settings(max_examples=4)
@given(
    lb=linear_batches(with_bias=True, dtypes=(torch.float32,), extreme=False),
    temperature=st.sampled_from([1.0, 0.7]),
)
def test_grpo_loss_equals_liger(loss_type, level, beta, lb, temperature):
    if loss_type == "luspo":  # Liger sums luspo over padding too (tests/test_liger_parity.py)
        lb = dataclasses.replace(
            lb, batch=dataclasses.replace(lb.batch, mask=torch.ones_like(lb.batch.mask))
        )
    ours, ours_g = _ours(lb, loss_type, level, beta, temperature)
    theirs, theirs_g = _liger(lb, loss_type, level, beta, temperature)
    # a loss that cancels to ~0 keeps fp32 absolute error: compared absolutely below 0.1
    errs = {"loss": rel_error(ours, theirs, 0.1)}
    errs.update(
        {
            n: rel_error(a, b, 1e-6)
            for n, a, b in zip(("hidden", "weight", "bias"), ours_g, theirs_g)
        }
    )
    assert max(errs.values()) <= 1e-5, errs
