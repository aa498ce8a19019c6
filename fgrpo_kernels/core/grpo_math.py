"""The GRPO family's pieces in PyTorch, one home each (see docs/math.md, "The GRPO family").

The reference loss, the metrics, the Triton epilogue's launcher and the TRL / Liger glue all
use these; nothing else writes them again. Shapes: logps, old, ref, mask [B, T]; advantages
[B]; a ratio or a weight is [B, T] (per token) or [B, 1] (per sequence).

One token's loss is `per_token_loss`: the loss type's policy term (`policy_term`) times the
detached policy weights (`row_weight` · `token_weight`: off-policy mask, vLLM IS ratio, entropy
mask, VESPO's gamma weight), plus β·k3 (times the ratio with bias correction). The loss is
Σ_i n_i Σ_t mask·pt with n_i from `row_scale`, minus the entropy bonus.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .divergences import sat_exp
from .options import LOSS_TYPE_SPECS, GRPOOptions, Level, LossType, Normaliser

# the table lives in policy_terms; its names stay importable from here
from .policy_terms import (  # noqa: F401
    POLICY_TERMS,
    PolicyTerm,
    _capped_tokens,
    _cispo,
    _clipped,
    _clipped_tokens,
    _never,
    _plain,
    _sapo,
)

VESPO_LOG_W_MIN = math.log(1e-8)  # TRL clamps log w_seq (and each log ρ) to [ln 1e-8, 20]
VESPO_LOG_W_MAX = 20.0


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ mask·x / max(Σ mask, 1)."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1.0)


def k3(ref: torch.Tensor, logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(π‖π_ref) per token: e^d − d − 1, d = ref − logps (0 where masked;
    the exponential saturates at 80)."""
    d = torch.where(mask.bool(), ref - logps, 0.0)
    return sat_exp(d) - d - 1.0


def kl_term(ref, logps, mask, opts: GRPOOptions) -> torch.Tensor:
    """The β term's per-token estimate: k3, or the estimator `opts.kl_penalty` names."""
    if opts.kl_penalty is None:
        return k3(ref, logps, mask)
    return opts.kl_penalty(logps, ref, mask)


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


def as_2d(ratio: torch.Tensor | None) -> torch.Tensor | None:
    """A vLLM IS ratio [B, T], [B, 1] or [B] as [B, T] or [B, 1]."""
    return ratio.unsqueeze(-1) if ratio is not None and ratio.dim() == 1 else ratio


# ----------------------------------------------------------------------------- policy term


def policy_term(logps, lr, advantages, opts: GRPOOptions) -> torch.Tensor:
    """The loss type's policy term per token (`POLICY_TERMS`), w = exp(lr) saturating."""
    return POLICY_TERMS[opts.objective].term(logps, sat_exp(lr), advantages.unsqueeze(-1), opts)


def clip_indicators(ratio, advantages, opts: GRPOOptions):
    """(low, high) as floats: where the policy term is clipped and carries no gradient (the
    term's `clips`; zeros where it never clips)."""
    a = advantages.unsqueeze(-1)
    zeros = torch.zeros_like(ratio * a)
    low, high = POLICY_TERMS[opts.objective].clips(ratio, a, opts)
    return tuple(zeros if x is None else x.to(zeros.dtype) for x in (low, high))


# ----------------------------------------------------------------------------- policy weights


@torch.no_grad()
def vespo_phi(logps, old, mask, advantages, ratio, opts: GRPOOptions) -> torch.Tensor:
    """VESPO's detached gamma weight per sequence [B, 1] (TRL's get_gamma_weights):
    φ = exp(λ + k·log w − λ·w), log w = Σ_t mask·clamp(log π/π_old, ±20) + Σ_t clamp(log ρ_t)
    clamped to [ln 1e-8, 20]; (k, λ) = (k₊, λ₊) for a ≥ 0 else (k₋, λ₋), λ ≥ 1e-4; non-finite
    φ → 0. The vLLM ratio ρ is summed over all its columns, as TRL does."""
    old = logps if old is None else old
    lr = torch.where(mask.bool(), (logps - old).clamp(-20.0, 20.0), 0.0)
    seq = lr.sum(-1, keepdim=True)
    if ratio is not None:
        log_rho = torch.log(ratio.to(seq.dtype)).clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)
        seq = seq + log_rho.sum(-1, keepdim=True)
    log_w = seq.clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)
    nonneg = advantages.unsqueeze(-1) >= 0
    k = torch.where(nonneg, seq.new_tensor(opts.vespo_k_pos), seq.new_tensor(opts.vespo_k_neg))
    lam = torch.where(
        nonneg, seq.new_tensor(opts.vespo_lambda_pos), seq.new_tensor(opts.vespo_lambda_neg)
    ).clamp(min=1e-4)
    log_phi = lam + k * log_w - lam * torch.exp(log_w)
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@torch.no_grad()
def off_policy_keep(logps, sampling, mask, advantages, threshold: float) -> torch.Tensor:
    """TRL's off-policy sequence mask [B, 1] (1 keep, 0 drop): a row with a < 0 whose masked
    mean of (sampling − current) log-probs exceeds `threshold` is dropped (NaN entries of
    `sampling`, tokens the rollout engine could not score, count as 0)."""
    m = mask.to(logps.dtype)
    kl = torch.nan_to_num(torch.where(mask.bool(), sampling.to(logps.dtype) - logps, 0.0))
    mean_kl = kl.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
    keep = (advantages.unsqueeze(-1) >= 0) | (mean_kl <= threshold)
    return keep.to(logps.dtype)


def entropy_threshold(entropy, mask, quantile: float) -> torch.Tensor:
    """The (1 − q) quantile of the unmasked entropies (fp32, linear interpolation, TRL's
    torch.quantile); +inf when no token is unmasked (then no token passes)."""
    values = entropy.detach()[mask.bool()].float()
    if values.numel() == 0:
        return torch.full((), float("inf"), device=entropy.device)
    return torch.quantile(values, 1.0 - quantile)


def entropy_mask(entropy, mask, threshold) -> torch.Tensor:
    """Tokens whose entropy is ≥ the threshold, unmasked ones only (bool [B, T])."""
    return ((entropy.detach() * mask.to(entropy.dtype)) >= threshold) & mask.bool()


@torch.no_grad()
def row_weight(logps, old, mask, advantages, opts, ratio=None, sampling=None):
    """The detached per-sequence weight [B, 1] of the policy term, or None when it is 1: the
    off-policy mask, times VESPO's φ (ρ folded in) or a per-sequence ρ [B, 1]."""
    ratio = as_2d(ratio)
    weight = None
    if opts.off_policy_mask_threshold is not None:
        sampling = (logps if old is None else old) if sampling is None else sampling
        threshold = opts.off_policy_mask_threshold
        weight = off_policy_keep(logps, sampling, mask, advantages, threshold)
    if POLICY_TERMS[opts.objective].sequence_weight:
        phi = vespo_phi(logps, old, mask, advantages, ratio, opts)
    elif ratio is not None and ratio.shape[-1] == 1:
        phi = ratio.to(logps.dtype)
    else:
        return weight
    return phi if weight is None else weight * phi


@torch.no_grad()
def token_weight(mask, opts, ratio=None, entropy=None, threshold=None, dtype=torch.float32):
    """The detached per-token weight [B, T] of the policy term, or None when it is 1: a
    per-token ρ (not for VESPO, which folds ρ into φ) times the entropy mask."""
    ratio = as_2d(ratio)
    weight = None
    folded = POLICY_TERMS[opts.objective].sequence_weight  # the ratio is inside its row weight
    if ratio is not None and ratio.shape[-1] != 1 and not folded:
        weight = ratio.to(dtype)
    if opts.entropy_mask:
        keep = entropy_mask(entropy, mask, threshold).to(dtype)
        weight = keep if weight is None else weight * keep
    return weight


# ----------------------------------------------------------------------------- normalisers


def row_scale(
    mask: torch.Tensor,
    loss_type: LossType,
    max_completion_length: int | None = None,
    num_items_in_batch=None,
    dtype: torch.dtype = torch.float32,
    *,
    batch=None,
    tokens=None,
) -> torch.Tensor:
    """n [B] such that loss = Σ_i n_i Σ_t mask·per_token, by the loss type's normaliser:
    grpo, sapo 1/(B·max(L_i, 1)); bnpo 1/max(Σ mask, 1); dr_grpo 1/(B·max_completion_length,
    default T); dapo, cispo, vespo 1/max(num_items_in_batch or Σ mask, 1); luspo 1/B.
    `batch` and `tokens` replace B and Σ mask (a data-parallel batch's global counts)."""
    B_local, T = mask.shape
    B = B_local if batch is None else batch
    m = mask.to(dtype)
    ones = torch.ones(B_local, dtype=dtype, device=mask.device)
    normaliser = LOSS_TYPE_SPECS[loss_type].normaliser
    if normaliser == Normaliser.ROW_MEAN:
        return 1.0 / (B * m.sum(-1).clamp(min=1.0))
    if normaliser == Normaliser.CONSTANT:
        length = T if max_completion_length is None else max_completion_length
        return ones / (B * length)
    if normaliser == Normaliser.ROWS:
        return ones / B
    if normaliser == Normaliser.ITEMS and num_items_in_batch is not None:
        total = torch.as_tensor(num_items_in_batch).to(device=mask.device, dtype=dtype)
    else:
        total = m.sum() if tokens is None else torch.as_tensor(tokens, dtype=dtype)
    return ones / total.to(device=mask.device).clamp(min=1.0)


@dataclass(frozen=True)
class Normalisers:
    """The batch-global numbers of one GRPO-family loss, computed once and passed to the
    epilogue (so that a caller may compute them over more than one micro-batch or rank):
    the row scales n [B], the entropy-mask threshold (0-d, or None without the mask) and the
    entropy bonus scale c / max(Σ effective mask, 1) (0-d, or None without a bonus)."""

    row_scale: torch.Tensor
    entropy_threshold: torch.Tensor | None = None
    entropy_scale: torch.Tensor | None = None


def bonus_mask(mask, opts, entropy=None, threshold=None, dtype=torch.float32) -> torch.Tensor:
    """The tokens the entropy bonus averages over: the mask, and the entropy mask if any."""
    m = mask.to(dtype)
    return m * entropy_mask(entropy, mask, threshold).to(dtype) if opts.entropy_mask else m


def normalisers(
    mask, opts: GRPOOptions, num_items_in_batch=None, entropy=None, threshold=None,
    dtype=torch.float32, *, batch=None, tokens=None, bonus_count=None,
) -> Normalisers:  # fmt: skip
    """`Normalisers` of this batch; `threshold` overrides the entropy quantile (e.g. one taken
    over every rank), `batch`, `tokens` and `bonus_count` the batch's B, Σ mask and number of
    tokens the entropy bonus averages over (a data-parallel batch's global counts)."""
    scale = row_scale(
        mask, opts.loss_type, opts.max_completion_length, num_items_in_batch, dtype,
        batch=batch, tokens=tokens,
    )  # fmt: skip
    if opts.entropy_mask and threshold is None:
        threshold = entropy_threshold(entropy, mask, opts.top_entropy_quantile)
    bonus = None
    if opts.entropy_coef != 0.0:
        if bonus_count is None:
            bonus_count = bonus_mask(mask, opts, entropy, threshold, dtype).sum()
        count = torch.as_tensor(bonus_count, dtype=dtype, device=mask.device)
        bonus = opts.entropy_coef / count.clamp(min=1.0)
    return Normalisers(scale, threshold if opts.entropy_mask else None, bonus)


# ----------------------------------------------------------------------------- the loss


def per_token_loss(logps, old, ref, mask, advantages, opts: GRPOOptions, norms: Normalisers,
                   ratio=None, entropy=None, sampling=None) -> torch.Tensor:  # fmt: skip
    """pt [B, T] (or [B, 1] at sequence level without per-token terms): the policy term times
    its detached weights, plus β·k3 (times the unclipped ratio with bias correction)."""
    lr = log_ratio(logps, old, mask, opts.level)
    pt = policy_term(logps, lr, advantages, opts)
    rows = row_weight(logps, old, mask, advantages, opts, ratio, sampling)
    tokens = token_weight(mask, opts, ratio, entropy, norms.entropy_threshold, logps.dtype)
    for weight in (rows, tokens):
        if weight is not None:
            pt = pt * weight
    if opts.beta != 0.0 and ref is not None:
        kl = kl_term(ref, logps, mask, opts)
        if opts.use_bias_correction_kl:
            kl = kl * sat_exp(lr)
        pt = pt + opts.beta * kl
    return pt


def reduce(per_token, mask, scale) -> torch.Tensor:
    """Σ_i scale_i Σ_t mask·per_token (per_token [B, T] or [B, 1])."""
    m = mask.to(per_token.dtype)
    return ((per_token * m).sum(-1) * scale.to(per_token.dtype)).sum()


def entropy_bonus(entropy, weights, scale) -> torch.Tensor:
    """scale·Σ weights·entropy: c times the mean entropy over `weights` (0/1 [B, T]) when
    scale = c / max(Σ weights, 1); the loss subtracts it."""
    return scale.to(entropy.dtype) * (entropy * weights.to(entropy.dtype)).sum()
