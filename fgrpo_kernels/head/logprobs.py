"""The public primitive: fused linear log-probs (docs/math.md §1)."""

from __future__ import annotations

import torch

from ..backends import distributed
from ..core import validation as check
from ..core.options import LogProbOptions
from .autograd import LinearLogProbFunction


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
    vocab_parallel=None,
):
    """logp[n] = log_softmax((h_n W^T + b) / τ)[y_n] without materialising the [N, V] logits.

    hidden [..., H] fp32/bf16/fp16, weight [V, H], targets [...] integer, bias [V] or None.
    Returns fp32 logp [...] (and fp32 entropy [...] when `return_entropy`); rows whose target
    is `ignore_index` give 0 and no gradient. Differentiable in hidden, weight and bias.
    `fast_fp32=True` allows TF32 products for fp32 inputs on CUDA.

    `vocab_parallel=VocabParallel(...)`: weight [V_r, H] and bias [V_r] are this rank's shard of
    the vocabulary, targets are global ids; results are the global ones on every rank. A DTensor
    weight or bias (FSDP2) is gathered for the call; its gradient is the sharded DTensor one.
    """
    if distributed.is_dtensor(weight):
        weight = distributed.gather_dtensor(weight, "weight")
    if distributed.is_dtensor(bias):
        bias = distributed.gather_dtensor(bias, "bias")
    shard = None
    if vocab_parallel is not None:
        check.tensor("weight", weight, ndim=2)
        shard = distributed.resolve(vocab_parallel, weight.shape[0], weight.device)
    check.logprob_inputs(
        hidden, weight, targets, bias, temperature, ignore_index,
        vocab_size=None if shard is None else shard.total,
    )  # fmt: skip
    lead = hidden.shape[:-1]
    opts = LogProbOptions(float(temperature), int(ignore_index), bool(fast_fp32))
    logp, entropy = LinearLogProbFunction.apply(
        hidden.reshape(-1, hidden.shape[-1]).contiguous(),
        weight.contiguous(),
        targets.reshape(-1).to(torch.int64).contiguous(),
        None if bias is None else bias.contiguous(),
        opts,
        bool(return_entropy),
        shard,
    )
    logp = logp.reshape(lead)
    return (logp, entropy.reshape(lead)) if return_entropy else logp
