"""Detached scalar metrics of the fused modules, from O(B·T) per-token vectors (no vocabulary).

Names follow TRL's GRPOTrainer where it has one (`kl`, `entropy`, `clip_ratio/*`).
"""

from __future__ import annotations

import torch

from . import grpo_math
from .options import FGRPOOptions, GIFTOptions, GRPOOptions, Level
from .reference import group_zscore


def _mean(x: torch.Tensor) -> torch.Tensor:
    """The mean, 0 over no element (B = 0)."""
    return x.mean() if x.numel() else x.new_zeros(())


def _common(loss, logps, ref, mask, entropy):
    out = {"loss": loss.detach()}
    if ref is not None:
        out["kl"] = grpo_math.masked_mean(grpo_math.k3(ref, logps.detach(), mask), mask)
    if entropy is not None:
        out["entropy"] = grpo_math.masked_mean(entropy, mask)
    return out


def _implicit_rewards(logps, ref, mask, beta, level):
    """β·log(π/π_ref) per unit: [B, T] (token level) or [B] (sequence level)."""
    diff = torch.where(mask.bool(), logps.detach() - ref, 0.0)
    return beta * (diff.sum(-1) if level == Level.SEQUENCE else diff)


def _unit_mean(r, rows, mask):
    if r.dim() == 1:
        return r[rows].mean() if rows.any() else r.new_zeros(())
    return grpo_math.masked_mean(r, mask.float() * rows[:, None])


def fgrpo(loss, logps, ref, mask, advantages, rewards, entropy, opts: FGRPOOptions):
    out = _common(loss, logps, ref, mask, entropy)
    if advantages is None:
        advantages = group_zscore(
            rewards.float(), opts.num_generations, opts.eps, opts.unbiased, opts.scale
        )
    r = _implicit_rewards(logps, ref, mask, opts.beta, opts.level)
    every = torch.ones_like(advantages, dtype=torch.bool)
    out["implicit_reward"] = _unit_mean(r, every, mask)
    out["implicit_reward/positive"] = _unit_mean(r, advantages > 0, mask)
    out["implicit_reward/negative"] = _unit_mean(r, advantages <= 0, mask)
    return out


def grpo(loss, logps, old, ref, mask, advantages, entropy, opts: GRPOOptions):
    out = _common(loss, logps, ref if opts.beta != 0.0 else None, mask, entropy)
    ratio = grpo_math.importance_ratio(logps.detach(), old, mask, opts.level)
    low, high = grpo_math.clip_indicators(ratio, advantages, opts.epsilon_low, opts.epsilon_high)

    def mean(x):
        return _mean(x) if x.shape[1] == 1 else grpo_math.masked_mean(x, mask)

    out["clip_ratio/low_mean"] = mean(low)
    out["clip_ratio/high_mean"] = mean(high)
    out["clip_ratio/region_mean"] = mean(torch.maximum(low, high))
    return out


def gift(loss, logps, ref, mask, entropy, opts: GIFTOptions):
    out = _common(loss, logps, ref, mask, entropy)
    out["implicit_reward"] = _mean(_implicit_rewards(logps, ref, mask, opts.beta, Level.SEQUENCE))
    return out


def fdo(loss, logps, ref, mask, chosen, beta):
    out = _common(loss, logps, ref, mask, None)
    r = _implicit_rewards(logps, ref, mask, beta, Level.SEQUENCE)
    out["implicit_reward/chosen"] = r[chosen].mean()
    out["implicit_reward/rejected"] = r[~chosen].mean()
    out["implicit_reward/margin"] = out["implicit_reward/chosen"] - out["implicit_reward/rejected"]
    return out
