"""The readable ground truth: every loss of docs/math.md in plain PyTorch, on log-probs.

No Triton here. Everything is computed in float32 or wider (float64 inputs stay float64), so
the same functions double as the oracle of the tests and as the CPU epilogue (autograd of these
functions gives dL/dlogp). `logprobs` materialises the [N, V] logits on purpose.

Each loss comes twice: `<name>_loss(...)` is the public function (strings, validation) and
`<name>(..., opts)` the same maths on parsed options (`fgrpo_kernels.core.options`), which the fused
modules' CPU epilogue calls without validating again.

Shapes: logps, ref_logps, old_logps, mask: [B, T]; advantages, rewards, chosen: [B].
"""

from __future__ import annotations

import dataclasses

import torch

from . import grpo_math
from . import validation as check
from .divergences import NAMES, TABLE, phi
from .kl_estimators import with_parsed_penalty
from .options import (
    LEVELS,
    LOSS_TYPES,
    REDUCTIONS,
    SCALES,
    FDOOptions,
    FGRPOOptions,
    GIFTOptions,
    GRPOOptions,
    Level,
    Reduction,
    Scale,
    mixing_weight,
    parse,
)


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        if t is not None and t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


# ----------------------------------------------------------------------------- log-probs


def logprobs(
    hidden, weight, targets, bias=None, temperature=1.0, ignore_index=-100, return_entropy=False
):
    """log_softmax((h W^T + b) / τ)[y] per position, through the full [N, V] logits.

    hidden [..., H], weight [V, H], targets [...] integer, bias [V] or None. Returns logp [...]
    (and the entropy [...] when `return_entropy`) in float32, or float64 for float64 inputs.
    Rows with target == ignore_index give 0 and no gradient.
    """
    check.logprob_inputs(hidden, weight, targets, bias, temperature, ignore_index)
    dtype = compute_dtype(hidden, weight, bias)
    logits = hidden.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        logits = logits + bias.to(dtype)
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    targets = targets.long()
    valid = targets != ignore_index
    picked = logp_all.gather(-1, torch.where(valid, targets, 0).unsqueeze(-1)).squeeze(-1)
    logp = torch.where(valid, picked, 0.0)
    if not return_entropy:
        return logp
    p = logp_all.exp()
    # a banned token (−inf logit) has p = 0 and adds 0, not 0·(−inf)
    entropy = -(p * torch.where(p > 0, logp_all, 0.0)).sum(-1)
    return logp, torch.where(valid, entropy, 0.0)


def zero_without_tokens(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`loss`, or 0 with no gradient when the mask counts no token (B = 0, or every token
    masked): a sequence-level or group loss would otherwise be NaN (a mean over no rows) or
    a constant of the empty rows."""
    return torch.where(mask.bool().any(), loss, 0.0)


# ----------------------------------------------------------------------------- groups


def _safe_sqrt(v: torch.Tensor) -> torch.Tensor:
    """sqrt with a zero (not NaN) gradient at 0: a zero-variance group has σ = 0, slope 0."""
    pos = v > 0
    return torch.where(pos, torch.sqrt(torch.where(pos, v, 1.0)), 0.0)


def _std(x: torch.Tensor, unbiased: bool) -> torch.Tensor:
    """Standard deviation over the last axis; 0 for a single element (never NaN)."""
    n = x.shape[-1]
    if n == 1:
        return torch.zeros_like(x[..., 0])
    centered = x - x.mean(-1, keepdim=True)
    return _safe_sqrt((centered * centered).sum(-1) / (n - 1 if unbiased else n))


def group_zscore(
    x, num_generations, eps=1e-4, unbiased=True, scale=Scale.GROUP, detach_stats=False
):
    """(x − μ_g) / (σ + eps) per group of `num_generations` contiguous rows; `scale` a `Scale`
    (σ per group, over the whole batch, or none: x − μ_g)."""
    groups = x.reshape(-1, num_generations)
    mu = groups.mean(-1, keepdim=True)
    if scale == Scale.GROUP:
        sigma = _std(groups, unbiased).unsqueeze(-1)
    elif scale == Scale.BATCH:
        sigma = _std(x.reshape(-1), unbiased)
    else:
        sigma = None
    if detach_stats:
        mu = mu.detach()
        sigma = None if sigma is None else sigma.detach()
    centered = groups - mu
    if sigma is not None:
        denom = sigma + eps
        centered = torch.where(denom > 0, centered / torch.where(denom > 0, denom, 1.0), 0.0)
    return centered.reshape(x.shape)


def group_normalize(rewards, num_generations, eps=1e-4, unbiased=True, scale="group"):
    """Advantages from rewards [B]: a_i = (R_i − μ_g)/(σ_g + eps) ("group"), σ over the whole
    batch ("batch"), or R_i − μ_g ("none"). A group of one has σ = 0. Returns float32/64 [B]."""
    check.tensor("rewards", rewards, ndim=1, floating=True)
    check.finite("rewards", rewards)
    check.num_generations("num_generations", num_generations, rewards.shape[0])
    check.positive("eps", eps, allow_zero=True)
    scale = parse(Scale, "scale", scale)
    x = rewards.to(compute_dtype(rewards))
    return group_zscore(x, num_generations, eps, unbiased, scale)


def importance_weights(rewards, advantages, old_logps, mask, num_generations):
    """Detached w_i = G·softmax_j(s_i·R_j − S_j)_i over i's group, s_i = sign(a_i) (+1 if a_i > 0
    else −1), S_j = Σ_t mask·old_logps (the f-GRPO paper's self-normalised weight)."""
    dtype = compute_dtype(old_logps, rewards)
    seq_old = (
        torch.where(mask.bool(), old_logps.to(dtype), 0.0).sum(-1).reshape(-1, num_generations)
    )
    r = rewards.to(dtype).reshape(-1, num_generations)
    w_pos = torch.softmax(r - seq_old, dim=-1).reshape(-1)
    w_neg = torch.softmax(-r - seq_old, dim=-1).reshape(-1)
    return (num_generations * torch.where(advantages > 0, w_pos, w_neg)).detach()


# ----------------------------------------------------------------------------- f-GRPO


def _seq_log_ratio(logps, ref_logps, mask, dtype):
    return torch.where(mask.bool(), logps.to(dtype) - ref_logps.to(dtype), 0.0).sum(-1)


def fgrpo_loss(
    logps,
    ref_logps,
    advantages,
    mask,
    divergence="pearson",
    beta=0.1,
    level="token",
    reduction=None,
    *,
    group_is_weights=False,
    old_logps=None,
    rewards=None,
    num_generations=None,
    vllm_is_ratio=None,
    entropy=None,
    entropy_coef=0.0,
):
    """f-GRPO: Σ over units of |a_i|·φ_{sign a_i}(r), r = β·log(π/π_ref) per token or sequence.

    level "token": r[i,t] = β(logps − ref); reductions "token_mean" (default), "seq_mean", "sum".
    level "sequence": r_i = β Σ_t mask·(logps − ref); reductions "seq_mean" (default), "sum".
    `advantages` may be None when `rewards` and `num_generations` are given (group z-score).
    `group_is_weights=True` multiplies unit i by `importance_weights` (needs old_logps, rewards,
    num_generations). `vllm_is_ratio` ρ multiplies each unit's cost ([B, T], [B, 1] or [B] at
    token level, [B, 1] or [B] at sequence level); `entropy_coef` c subtracts c·(masked mean
    of `entropy` [B, T]).
    """
    B, T = check.loss_batch(logps, ref_logps, mask)
    opts = FGRPOOptions.parse(
        divergence, beta, level, reduction, None, Scale.GROUP, 1e-4, True, group_is_weights,
        entropy_coef=entropy_coef,
    )  # fmt: skip
    check.is_ratio("vllm_is_ratio", vllm_is_ratio, B, T, per_token=opts.level == Level.TOKEN)
    check.optional_per_token("entropy", entropy, B, T)
    if opts.entropy_coef != 0.0 and entropy is None:
        raise ValueError("entropy: expected the per-token entropy [B, T] with entropy_coef != 0")
    check.advantages_or_rewards(
        advantages, rewards, num_generations, B, need_rewards=group_is_weights
    )
    if group_is_weights:
        check.per_token_logps("old_logps", old_logps, mask)
    if num_generations is not None:
        opts = dataclasses.replace(opts, num_generations=num_generations)
    return fgrpo(
        logps, ref_logps, mask, advantages, rewards, old_logps, opts,
        vllm_is_ratio=vllm_is_ratio, entropy=entropy,
    )  # fmt: skip


def fgrpo(
    logps, ref_logps, mask, advantages, rewards, old_logps, opts: FGRPOOptions, *,
    vllm_is_ratio=None, entropy=None,
):  # fmt: skip
    """`fgrpo_loss` on parsed options: `advantages` [B], or None with `rewards` [B] (normalised
    per group as `opts.scale` says); `old_logps` and `rewards` for `opts.group_is_weights`."""
    loss = _fgrpo_units(logps, ref_logps, mask, advantages, rewards, old_logps, opts, vllm_is_ratio)
    if opts.entropy_coef != 0.0:
        m = mask.to(loss.dtype)
        scale = opts.entropy_coef / m.sum().clamp(min=1.0)
        loss = loss - grpo_math.entropy_bonus(entropy.to(loss.dtype), m, scale)
    return loss


def _fgrpo_units(logps, ref_logps, mask, advantages, rewards, old_logps, opts, ratio):
    """f-GRPO's loss before the entropy bonus; ρ (`ratio`) weights each unit."""
    G = opts.num_generations
    dtype = compute_dtype(logps, ref_logps, advantages)
    if advantages is None:
        advantages = group_zscore(rewards.to(compute_dtype(rewards)), G, opts.eps, opts.unbiased,
                                  opts.scale)  # fmt: skip
    a = advantages.to(dtype)
    weight = a.abs()
    if opts.group_is_weights:
        weight = weight * importance_weights(rewards, a, old_logps, mask, G)
    ratio = grpo_math.as_2d(ratio)
    if ratio is not None and opts.level == Level.SEQUENCE:
        weight = weight * ratio[:, 0].to(dtype)
    positive = a > 0
    m = mask.to(dtype)
    beta = opts.beta
    if opts.level == Level.SEQUENCE:
        u = weight * phi(beta * _seq_log_ratio(logps, ref_logps, mask, dtype), positive,
                         opts.divergence)  # fmt: skip
    else:
        diff = torch.where(mask.bool(), logps.to(dtype) - ref_logps.to(dtype), 0.0)
        u = m * weight[:, None] * phi(beta * diff, positive[:, None], opts.divergence)
        if ratio is not None:
            u = u * ratio.to(dtype)
    if opts.reduction == Reduction.TOKEN_MEAN:
        loss = u.sum() / m.sum().clamp(min=1.0)
    elif opts.reduction == Reduction.SEQ_MEAN and opts.level == Level.TOKEN:
        loss = (u.sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    else:
        loss = u.mean() if opts.reduction == Reduction.SEQ_MEAN else u.sum()
    return zero_without_tokens(loss, mask)


# ----------------------------------------------------------------------------- GRPO family


def grpo_loss(
    logps,
    old_logps,
    ref_logps,
    advantages,
    mask,
    loss_type="dapo",
    beta=0.04,
    epsilon_low=0.2,
    epsilon_high=0.2,
    importance_sampling_level="token",
    max_completion_length=None,
    num_items_in_batch=None,
    *,
    vllm_is_ratio=None,
    entropy=None,
    sampling_logps=None,
    **options,
):
    """TRL/Liger GRPO family: Σ_i n_i Σ_t mask·pt − entropy_coef·(mean entropy), per `loss_type`.

    pt = policy term of the loss type (clipped surrogate −min(w·a, clip(w)·a) for grpo, bnpo,
    dr_grpo, dapo, luspo; cispo, sapo, vespo as in docs/math.md) × the detached weights
    (`vllm_is_ratio` ρ [B, T], [B, 1] or [B]; the off-policy mask from `sampling_logps`, default
    old; the top-entropy mask) + β·k3(ref, logps) (× w with bias correction). w =
    exp(log_ratio), log_ratio = logps − old_logps per token, or its masked sequence mean at
    importance_sampling_level "sequence" (GSPO). old_logps None → logps.detach(); ref_logps None
    → no KL term (as in Liger). `entropy` [B, T] (needed by entropy_coef and
    top_entropy_quantile) may carry a gradient.

    `options` (keywords, TRL's names): delta, clip_ratio_c, use_bias_correction_kl,
    entropy_coef, top_entropy_quantile, off_policy_mask_threshold, and the loss types' own
    sapo_temperature_pos/neg, vespo_k_pos/neg, vespo_lambda_pos/neg (None: TRL's defaults).
    """
    B, T = check.loss_batch(logps, None, mask)
    check.optional_per_token("old_logps", old_logps, B, T, logps_of=mask)
    check.optional_per_token("ref_logps", ref_logps, B, T, logps_of=mask)
    check.optional_per_token("sampling_logps", sampling_logps, B, T)
    check.optional_per_token("entropy", entropy, B, T)
    check.per_row("advantages", advantages, B)
    check.is_ratio("vllm_is_ratio", vllm_is_ratio, B, T)
    check.num_items_in_batch(num_items_in_batch)
    opts = GRPOOptions.parse(
        loss_type, beta, epsilon_low, epsilon_high, importance_sampling_level,
        max_completion_length, **with_parsed_penalty(options),
    )  # fmt: skip
    if opts.needs_entropy and entropy is None:
        raise ValueError(
            "entropy: expected the per-token entropy [B, T] with entropy_coef != 0 or "
            "top_entropy_quantile < 1; got None"
        )
    return grpo(
        logps, old_logps, ref_logps, mask, advantages, num_items_in_batch, opts,
        vllm_is_ratio=vllm_is_ratio, entropy=entropy, sampling_logps=sampling_logps,
    )  # fmt: skip


def grpo(
    logps,
    old_logps,
    ref_logps,
    mask,
    advantages,
    num_items_in_batch,
    opts: GRPOOptions,
    *,
    vllm_is_ratio=None,
    entropy=None,
    sampling_logps=None,
    norms: grpo_math.Normalisers | None = None,
):
    """`grpo_loss` on parsed options; `norms` (row scales, entropy threshold and bonus scale)
    default to this batch's own (`grpo_math.normalisers`)."""
    dtype = compute_dtype(logps, old_logps, ref_logps, advantages)

    def cast(t):
        return None if t is None else t.to(dtype)

    lp, ent = logps.to(dtype), cast(entropy)
    if norms is None:
        norms = grpo_math.normalisers(mask, opts, num_items_in_batch, ent, dtype=dtype)
    per_token = grpo_math.per_token_loss(
        lp, cast(old_logps), cast(ref_logps), mask, advantages.to(dtype), opts, norms,
        vllm_is_ratio, ent, cast(sampling_logps),
    )  # fmt: skip
    loss = grpo_math.reduce(per_token, mask, norms.row_scale)
    if norms.entropy_scale is not None:
        weights = grpo_math.bonus_mask(mask, opts, ent, norms.entropy_threshold, dtype)
        loss = loss - grpo_math.entropy_bonus(ent, weights, norms.entropy_scale)
    return loss


# ----------------------------------------------------------------------------- GIFT


def gift_loss(
    logps,
    ref_logps,
    rewards,
    mask,
    num_generations,
    beta=1.0,
    eps=1e-4,
    unbiased=True,
    detach_stats=False,
):
    """GIFT: mean_i (R̂_i − β·k̂_i)², k_i = Σ_t mask·(logps − ref), ^ = group z-score.

    detach_stats=False differentiates through the group mean and std of k (the paper);
    True holds them constant (the authors' released code).
    """
    B, _ = check.loss_batch(logps, ref_logps, mask)
    check.per_row("rewards", rewards, B)
    check.num_generations("num_generations", num_generations, B)
    opts = GIFTOptions.parse(num_generations, beta, eps, unbiased, detach_stats)
    return gift(logps, ref_logps, mask, rewards, opts)


def gift(logps, ref_logps, mask, rewards, opts: GIFTOptions):
    """`gift_loss` on parsed options."""
    G = opts.num_generations
    dtype = compute_dtype(logps, ref_logps, rewards)
    k = _seq_log_ratio(logps, ref_logps, mask, dtype)
    r_hat = group_zscore(rewards.to(dtype), G, opts.eps, opts.unbiased)
    k_hat = group_zscore(k, G, opts.eps, opts.unbiased, detach_stats=opts.detach_stats)
    return zero_without_tokens(((r_hat - opts.beta * k_hat) ** 2).mean(), mask)


# ----------------------------------------------------------------------------- FDO / f-HAL


def fdo_loss(logps, ref_logps, mask, chosen, divergence="pearson", beta=0.1):
    """FDO: mean_chosen φ₊(r) + mean_rejected φ₋(r), r_i = β Σ_t mask·(logps − ref_logps)."""
    B, _ = check.loss_batch(logps, ref_logps, mask)
    check.chosen("chosen", chosen, B)
    return fdo(logps, ref_logps, mask, chosen, FDOOptions.parse(divergence, beta))


def fdo(logps, ref_logps, mask, chosen, opts: FDOOptions):
    """`fdo_loss` on parsed options."""
    spec = TABLE[opts.divergence]
    r = opts.beta * _seq_log_ratio(logps, ref_logps, mask, compute_dtype(logps, ref_logps))
    return zero_without_tokens(spec.phi_pos(r[chosen]).mean() + spec.phi_neg(r[~chosen]).mean(),
                               mask)  # fmt: skip


def fhal_loss(
    logps,
    ref_logps,
    advantages,
    mask,
    pref_logps,
    pref_ref_logps,
    pref_mask,
    chosen,
    divergence="pearson",
    beta=0.1,
    lam=0.5,
    level="token",
    reduction=None,
):
    """f-HAL = lam·FDO(preference batch) + (1 − lam)·f-GRPO(on-policy batch), one divergence/β."""
    lam = mixing_weight(lam)
    check.loss_batch(pref_logps, pref_ref_logps, pref_mask, prefix="pref_")  # named as given here
    fdo_part = fdo_loss(pref_logps, pref_ref_logps, pref_mask, chosen, divergence, beta)
    fgrpo_part = fgrpo_loss(logps, ref_logps, advantages, mask, divergence, beta, level, reduction)
    return lam * fdo_part + (1.0 - lam) * fgrpo_part


__all__ = [
    "LEVELS",
    "LOSS_TYPES",
    "NAMES",
    "REDUCTIONS",
    "SCALES",
    "fdo_loss",
    "fgrpo_loss",
    "fhal_loss",
    "gift_loss",
    "group_normalize",
    "grpo_loss",
    "importance_weights",
    "logprobs",
]
