"""The GRPO family's pieces in PyTorch, one home each (see docs/math.md, "The GRPO family").

The reference loss, the metrics, the Triton epilogue's launcher and the TRL glue all use these;
nothing else writes them again. Shapes: logps, old, ref, mask [B, T]; advantages [B].
"""

from __future__ import annotations

import torch

from .divergences import sat_exp
from .options import Level, LossType


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ mask·x / max(Σ mask, 1)."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1.0)


def k3(ref: torch.Tensor, logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(π‖π_ref) per token: e^d − d − 1, d = ref − logps (0 where masked;
    the exponential saturates at 80)."""
    d = torch.where(mask.bool(), ref - logps, 0.0)
    return sat_exp(d) - d - 1.0


def log_ratio(logps, old, mask, level: Level) -> torch.Tensor:
    """log(π/π_old) per token [B, T] (0 where masked), or its masked mean per sequence [B, 1]
    (GSPO). old None → logps.detach() (ratio 1, the gradient of the ratio kept)."""
    old = logps.detach() if old is None else old
    lr = torch.where(mask.bool(), logps - old, 0.0)
    if level == Level.SEQUENCE:
        length = mask.to(lr.dtype).sum(-1).clamp(min=1.0)
        lr = (lr.sum(-1) / length).unsqueeze(-1)
    return lr


def importance_ratio(logps, old, mask, level: Level) -> torch.Tensor:
    """w = exp(log_ratio) [B, T] or [B, 1], saturating at e^80."""
    return sat_exp(log_ratio(logps, old, mask, level))


def clipped_surrogate(ratio, advantages, epsilon_low: float, epsilon_high: float):
    """−min(w·a, clamp(w, 1 − ε_low, 1 + ε_high)·a) per token (PPO's clipped objective)."""
    a = advantages.unsqueeze(-1)
    clipped = ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high)
    return -torch.minimum(ratio * a, clipped * a)


def clip_indicators(ratio, advantages, epsilon_low: float, epsilon_high: float):
    """(low, high) as floats: the ratio is clipped from below (a < 0, w < 1 − ε_low) or from
    above (a > 0, w > 1 + ε_high), where the clipped branch carries no gradient."""
    a = advantages.unsqueeze(-1)
    low = ((ratio < 1.0 - epsilon_low) & (a < 0)).float()
    high = ((ratio > 1.0 + epsilon_high) & (a > 0)).float()
    return low, high


def row_scale(
    mask: torch.Tensor,
    loss_type: LossType,
    max_completion_length: int | None = None,
    num_items_in_batch=None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """n [B] such that loss = Σ_i n_i Σ_t mask·per_token, for each loss type:
    grpo 1/(B·max(L_i, 1)); bnpo 1/max(Σ mask, 1); dr_grpo 1/(B·max_completion_length, default
    T); dapo 1/max(num_items_in_batch or Σ mask, 1)."""
    B, T = mask.shape
    m = mask.to(dtype)
    ones = torch.ones(B, dtype=dtype, device=mask.device)
    if loss_type == LossType.GRPO:
        return 1.0 / (B * m.sum(-1).clamp(min=1.0))
    if loss_type == LossType.DR_GRPO:
        length = T if max_completion_length is None else max_completion_length
        return ones / (B * length)
    if loss_type == LossType.DAPO and num_items_in_batch is not None:
        total = torch.as_tensor(num_items_in_batch).to(device=mask.device, dtype=dtype)
    else:
        total = m.sum()
    return ones / total.clamp(min=1.0)


def reduce(per_token, mask, scale) -> torch.Tensor:
    """Σ_i scale_i Σ_t mask·per_token (per_token [B, T] or [B, 1])."""
    m = mask.to(per_token.dtype)
    return ((per_token * m).sum(-1) * scale.to(per_token.dtype)).sum()
