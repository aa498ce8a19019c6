"""Detached scalar metrics of the fused modules, from O(B·T) per-token vectors (no vocabulary).

Names follow TRL's GRPOTrainer where it has one (`kl`, `entropy`, `clip_ratio/*`,
`cispo_clip_ratio`, `vespo/phi_seq_mean`, `policy_loss`); `clip_ratio` is Liger's (the fraction of
unmasked tokens whose policy term is clipped, at either level); `importance_sampling_ratio/*` are
the statistics of the rollout-engine ratio TRL logs under `sampling/`.
"""

from __future__ import annotations

import torch

from ..core import grpo_math
from ..core.options import FGRPOOptions, GIFTOptions, GRPOOptions, Level
from ..core.reference import group_zscore


def _mean(x: torch.Tensor) -> torch.Tensor:
    """The mean, 0 over no element (B = 0)."""
    return x.mean() if x.numel() else x.new_zeros(())


def _common(loss, logps, ref, mask, entropy):
    out = {"loss": loss.detach()}
    if ref is not None:
        out["kl"] = grpo_math.masked_mean(grpo_math.k3(ref, logps.detach(), mask), mask)
    if entropy is not None:
        out["entropy"] = grpo_math.masked_mean(entropy.detach(), mask)
    return out


def _ratio_stats(out, ratio, mask):
    """min / mean / max of a rollout IS ratio over the unmasked tokens ([B, T]) or rows."""
    ratio = grpo_math.as_2d(ratio)
    if ratio is None:
        return
    values = ratio.reshape(-1) if ratio.shape[-1] == 1 else ratio[mask.bool()]
    values = values.detach().float()
    if values.numel() == 0:
        values = values.new_zeros(1)
    out["importance_sampling_ratio/min"] = values.min()
    out["importance_sampling_ratio/mean"] = values.mean()
    out["importance_sampling_ratio/max"] = values.max()


def _implicit_rewards(logps, ref, mask, beta, level):
    """β·log(π/π_ref) per unit: [B, T] (token level) or [B] (sequence level)."""
    diff = torch.where(mask.bool(), logps.detach() - ref, 0.0)
    return beta * (diff.sum(-1) if level == Level.SEQUENCE else diff)


def _unit_mean(r, rows, mask):
    if r.dim() == 1:
        return r[rows].mean() if rows.any() else r.new_zeros(())
    return grpo_math.masked_mean(r, mask.float() * rows[:, None])


def _row_extreme(x, mask, extreme):
    """min or max over rows of each row's clipped fraction (at token level rows without tokens
    are skipped; 0 when none is left, like every metric of an empty batch): TRL's
    clip_ratio/low_min and /high_max, one process."""
    m = mask.to(x.dtype)
    length = m.sum(-1)
    per_row = (x * m).sum(-1) / length.clamp(min=1.0)
    # sequence level: one value per row, every row counted (as TRL)
    live = x[:, 0] if x.shape[1] == 1 else per_row[length > 0]
    return extreme(live) if live.numel() else x.new_zeros(())


def fgrpo(loss, logps, ref, mask, advantages, rewards, entropy, ratio, opts: FGRPOOptions):
    out = _common(loss, logps, ref, mask, entropy)
    _ratio_stats(out, ratio, mask)
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


def grpo(loss, logps, entropy, old, ref, mask, advantages, ratio, norms, opts: GRPOOptions):
    out = _common(loss, logps, None, mask, entropy)
    lp = logps.detach()
    w = grpo_math.importance_ratio(lp, old, mask, opts.level)
    if opts.beta != 0.0 and ref is not None:
        kl = grpo_math.kl_term(ref, lp, mask, opts)
        out["kl"] = grpo_math.masked_mean(kl * w if opts.use_bias_correction_kl else kl, mask)
    if norms.entropy_scale is not None:
        weights = grpo_math.bonus_mask(mask, opts, entropy, norms.entropy_threshold)
        bonus = grpo_math.entropy_bonus(entropy.detach(), weights, norms.entropy_scale)
        out["policy_loss"] = (loss + bonus).detach()
    low, high = grpo_math.clip_indicators(w, advantages, opts)
    region = torch.maximum(low, high)

    def mean(x):  # TRL: one value per sequence at sequence level
        return _mean(x) if x.shape[1] == 1 else grpo_math.masked_mean(x, mask)

    term = grpo_math.POLICY_TERMS[opts.objective]
    if term.clip_metrics == "trl":
        out["clip_ratio/low_mean"] = mean(low)
        out["clip_ratio/high_mean"] = mean(high)
        out["clip_ratio/region_mean"] = mean(region)
        out["clip_ratio/low_min"] = _row_extreme(low, mask, torch.min)
        out["clip_ratio/high_max"] = _row_extreme(high, mask, torch.max)
    elif term.clip_metrics == "cispo":
        out["cispo_clip_ratio"] = mean(high)
    if term.sequence_weight:
        out["vespo/phi_seq_mean"] = grpo_math.vespo_phi(
            lp, old, mask, advantages, grpo_math.as_2d(ratio), opts
        ).mean()
    out["clip_ratio"] = grpo_math.masked_mean(region.expand(mask.shape), mask)
    _ratio_stats(out, ratio, mask)
    return out


def gift(loss, logps, ref, mask, entropy, opts: GIFTOptions):
    out = _common(loss, logps, ref, mask, entropy)
    out["implicit_reward"] = _mean(_implicit_rewards(logps, ref, mask, opts.beta, Level.SEQUENCE))
    return out


def fdo(loss, logps, ref, mask, chosen, beta):
    out = _common(loss, logps, ref, mask, None)
    r = _implicit_rewards(logps, ref, mask, beta, Level.SEQUENCE)
    out["implicit_reward/chosen"] = _mean(r[chosen])  # a rank's pool may be empty
    out["implicit_reward/rejected"] = _mean(r[~chosen])
    out["implicit_reward/margin"] = out["implicit_reward/chosen"] - out["implicit_reward/rejected"]
    return out
