"""Detached scalar metrics of the fused modules, from O(B·T) per-token vectors (no vocabulary).

Names follow TRL's GRPOTrainer where it has one (`kl`, `entropy`, `clip_ratio/*`).
"""

from __future__ import annotations

import torch

from .divergences import sat_exp
from .epilogue import FGRPOOptions, GIFTOptions, GRPOOptions, Level, name_of
from .reference import group_normalize


def _masked_mean(x, m):
    return (x * m).sum() / m.sum().clamp(min=1.0)


def _common(loss, logps, ref, mask, entropy):
    m = mask.float()
    out = {"loss": loss.detach()}
    if ref is not None:
        d = torch.where(mask.bool(), ref - logps.detach(), 0.0)
        out["kl"] = _masked_mean(sat_exp(d) - d - 1.0, m)
    if entropy is not None:
        out["entropy"] = _masked_mean(entropy, m)
    return out


def _implicit_rewards(logps, ref, mask, beta, level):
    """β·log(π/π_ref) per unit: [B, T] (token level) or [B] (sequence level)."""
    diff = torch.where(mask.bool(), logps.detach() - ref, 0.0)
    return beta * (diff.sum(-1) if level == Level.SEQUENCE else diff)


def _unit_mean(r, rows, mask):
    if r.dim() == 1:
        return r[rows].mean() if rows.any() else r.new_zeros(())
    m = mask.float() * rows[:, None]
    return _masked_mean(r, m)


def fgrpo(loss, logps, ref, mask, advantages, rewards, entropy, opts: FGRPOOptions):
    out = _common(loss, logps, ref, mask, entropy)
    if advantages is None:
        advantages = group_normalize(
            rewards, opts.num_generations, opts.eps, opts.unbiased, name_of(opts.scale)
        )
    r = _implicit_rewards(logps, ref, mask, opts.beta, opts.level)
    every = torch.ones_like(advantages, dtype=torch.bool)
    out["implicit_reward"] = _unit_mean(r, every, mask)
    out["implicit_reward/positive"] = _unit_mean(r, advantages > 0, mask)
    out["implicit_reward/negative"] = _unit_mean(r, advantages <= 0, mask)
    return out


def grpo(loss, logps, old, ref, mask, advantages, entropy, opts: GRPOOptions):
    out = _common(loss, logps, ref if opts.beta != 0.0 else None, mask, entropy)
    m = mask.float()
    log_ratio = torch.where(
        mask.bool(), logps.detach() - (logps.detach() if old is None else old), 0.0
    )
    a = advantages[:, None]
    if opts.level == Level.SEQUENCE:
        log_ratio = (log_ratio.sum(-1) / m.sum(-1).clamp(min=1.0))[:, None]
    coef = sat_exp(log_ratio)
    low = ((coef < 1.0 - opts.epsilon_low) & (a < 0)).float()
    high = ((coef > 1.0 + opts.epsilon_high) & (a > 0)).float()

    def mean(x):
        return x.mean() if x.shape[1] == 1 else _masked_mean(x, m)

    out["clip_ratio/low_mean"] = mean(low)
    out["clip_ratio/high_mean"] = mean(high)
    out["clip_ratio/region_mean"] = mean(torch.maximum(low, high))
    return out


def gift(loss, logps, ref, mask, entropy, opts: GIFTOptions):
    out = _common(loss, logps, ref, mask, entropy)
    out["implicit_reward"] = _implicit_rewards(logps, ref, mask, opts.beta, Level.SEQUENCE).mean()
    return out


def fdo(loss, logps, ref, mask, chosen, beta):
    out = _common(loss, logps, ref, mask, None)
    r = _implicit_rewards(logps, ref, mask, beta, Level.SEQUENCE)
    out["implicit_reward/chosen"] = r[chosen].mean()
    out["implicit_reward/rejected"] = r[~chosen].mean()
    out["implicit_reward/margin"] = out["implicit_reward/chosen"] - out["implicit_reward/rejected"]
    return out
