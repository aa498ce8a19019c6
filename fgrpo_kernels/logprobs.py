"""The public primitive: fused linear log-probs (docs/math.md §1)."""

from __future__ import annotations

import torch

from . import validation as check
from .autograd import LinearLogProbFunction
from .options import LogProbOptions


def fused_linear_logprobs(
    hidden,
    weight,
    targets,
    bias=None,
    temperature=1.0,
    ignore_index=-100,
    return_entropy=False,
    *,
    fast_fp32=False,
):
    """logp[n] = log_softmax((h_n W^T + b) / τ)[y_n] without materialising the [N, V] logits.

    hidden [..., H] fp32/bf16/fp16, weight [V, H], targets [...] integer, bias [V] or None.
    Returns fp32 logp [...] (and fp32 entropy [...] when `return_entropy`); rows whose target
    is `ignore_index` give 0 and no gradient. Differentiable in hidden, weight and bias.
    `fast_fp32=True` allows TF32 products for fp32 inputs on CUDA.
    """
    check.logprob_inputs(hidden, weight, targets, bias, temperature, ignore_index)
    lead = hidden.shape[:-1]
    opts = LogProbOptions(float(temperature), int(ignore_index), bool(fast_fp32))
    logp, entropy = LinearLogProbFunction.apply(
        hidden.reshape(-1, hidden.shape[-1]).contiguous(),
        weight.contiguous(),
        targets.reshape(-1).to(torch.int64).contiguous(),
        None if bias is None else bias.contiguous(),
        opts,
        bool(return_entropy),
    )
    logp = logp.reshape(lead)
    return (logp, entropy.reshape(lead)) if return_entropy else logp
