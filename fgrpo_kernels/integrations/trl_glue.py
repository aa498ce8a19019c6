"""Tensor-level helpers of the TRL drop-in (no TRL import): the hidden-state forward, TRL's
importance ratio and clip indicators, group reordering, and the bias-corrected-KL loss."""

from __future__ import annotations

import functools
import types

import torch

from .. import reference
from ..logprobs import fused_linear_logprobs


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


def importance_ratio(logps, old, mask, level):
    """TRL's coef_1: exp(logps − old) per token, or of its masked mean per sequence [B, 1]."""
    log_ratio = logps - (logps.detach() if old is None else old)
    if level == "sequence":
        m = mask.float()
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0))[:, None]
    return torch.exp(log_ratio)


def clipped(coef, adv, epsilon_low, epsilon_high):
    """TRL's low- and high-clipped indicators (float) of the ratio `coef`."""
    a = adv[:, None]
    low = ((coef < 1 - epsilon_low) & (a < 0)).float()
    high = ((coef > 1 + epsilon_high) & (a > 0)).float()
    return low, high


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
    targets = ids.masked_fill(mask == 0, -100)
    logps, entropy = fused_linear_logprobs(
        hidden, weight, targets, bias, t.temperature, return_entropy=True
    )
    coef = importance_ratio(logps, old, mask, t.importance_sampling_level)
    policy = reference.grpo_loss(
        logps, old, None, adv, mask, t.loss_type, 0.0, t.epsilon_low, t.epsilon_high,
        t.importance_sampling_level, t.max_completion_length,
        num_items_in_batch=1.0 if t.loss_type == "dapo" else None,
    )  # fmt: skip
    d = ref - logps
    kl = (torch.exp(d) - d - 1.0) * coef  # NB: coef carries the gradient of the correction
    m = mask.float()
    if t.loss_type == "grpo":
        kl_term = ((kl * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    elif t.loss_type == "bnpo":
        kl_term = (kl * m).sum() / m.sum().clamp(min=1.0)
    elif t.loss_type == "dr_grpo":
        kl_term = (kl * m).sum() / (m.shape[0] * t.max_completion_length)
    else:
        kl_term = (kl * m).sum()
    low, high = clipped(coef.detach(), adv, t.epsilon_low, t.epsilon_high)

    def mean(x):
        return x.mean() if x.shape[1] == 1 else (x * m).sum() / m.sum().clamp(min=1.0)

    metrics = {
        "kl": mean(kl.detach()),
        "entropy": mean(entropy.detach()),
        "clip_ratio/low_mean": mean(low),
        "clip_ratio/high_mean": mean(high),
        "clip_ratio/region_mean": mean(torch.maximum(low, high)),
    }
    return policy + t.beta * kl_term, metrics
