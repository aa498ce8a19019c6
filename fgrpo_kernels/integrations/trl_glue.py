"""Tensor-level helpers of the TRL drop-in (no TRL import): the hidden-state forward, group
reordering, and the bias-corrected-KL loss (on `grpo_math`)."""

from __future__ import annotations

import functools
import types

import torch

from .. import grpo_math
from ..logprobs import fused_linear_logprobs
from ..options import LossType


def causal_lm(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def install_hidden_forward(model) -> None:
    """Let `model(..., fgrpo_last_hidden=True)` return the backbone output (no lm_head), so the
    loss goes through every wrapper (DDP, PEFT) like TRL's `fused_lm_head=True` call."""
    target = causal_lm(model)
    if getattr(target, "_fgrpo_hidden_forward", False):
        return
    inner = target.forward

    @functools.wraps(type(target).forward)
    def forward(self, *args, fgrpo_last_hidden=False, **kwargs):
        if not fgrpo_last_hidden:
            return inner(*args, **kwargs)
        for key in ("labels", "shift_labels", "num_items_in_batch", "fused_lm_head"):
            kwargs.pop(key, None)
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        kwargs["use_cache"] = False
        return self.base_model(*args, **kwargs)

    target.forward = types.MethodType(forward, target)
    target._fgrpo_hidden_forward = True


def groups_contiguous(inputs: dict, num_generations: int) -> dict:
    """Rows reordered so that each group's G completions are contiguous (TRL shuffles)."""
    group = inputs["fgrpo_group"]
    order = torch.argsort(group, stable=True)
    counts = torch.unique(group, return_counts=True)[1]
    if bool((counts != num_generations).any()):
        raise ValueError(
            "loss_type: 'gift' needs whole groups of num_generations completions per micro-batch"
        )
    B = group.shape[0]
    return {
        k: v[order] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == B else v
        for k, v in inputs.items()
    }


def bias_corrected_grpo_loss(trainer, hidden, weight, bias, ids, mask, adv, ref, old):
    """TRL's GRPO-family loss with use_bias_correction_kl (the KL term times the importance
    ratio), which FusedLinearGRPOLoss lacks: the fused log-probs (no logits), then the O(B·T)
    loss in PyTorch. dapo returns the sum (the caller divides by TRL's normaliser)."""
    t = trainer
    level, loss_type = t._fgrpo_level, t._fgrpo_loss.opts.loss_type
    targets = ids.masked_fill(mask == 0, -100)
    logps, entropy = fused_linear_logprobs(
        hidden, weight, targets, bias, t.temperature, return_entropy=True
    )
    coef = grpo_math.importance_ratio(logps, old, mask, level)
    per_token = grpo_math.clipped_surrogate(coef, adv, t.epsilon_low, t.epsilon_high)
    # NB: coef carries the gradient of the correction
    per_token = per_token + t.beta * grpo_math.k3(ref, logps, mask) * coef
    dapo = loss_type == LossType.DAPO
    scale = grpo_math.row_scale(
        mask, loss_type, t.max_completion_length, 1.0 if dapo else None, logps.dtype
    )
    low, high = grpo_math.clip_indicators(coef.detach(), adv, t.epsilon_low, t.epsilon_high)

    def mean(x):
        return x.mean() if x.shape[1] == 1 else grpo_math.masked_mean(x, mask)

    kl = grpo_math.k3(ref, logps.detach(), mask) * coef.detach()
    metrics = {
        "kl": mean(kl),
        "entropy": mean(entropy.detach()),
        "clip_ratio/low_mean": mean(low),
        "clip_ratio/high_mean": mean(high),
        "clip_ratio/region_mean": mean(torch.maximum(low, high)),
    }
    return grpo_math.reduce(per_token, mask, scale), metrics
