"""The readable ground truth: every loss of SPEC §2 and §4 in plain PyTorch, on log-probs.

No Triton here. Everything is computed in float32 or wider (float64 inputs stay float64), so
the same functions double as the oracle of the tests and as the CPU epilogue (autograd of these
functions gives dL/dlogp). `logprobs` materialises the [N, V] logits on purpose.

Shapes: logps, ref_logps, old_logps, mask: [B, T]; advantages, rewards, chosen: [B].
"""

from __future__ import annotations

import torch

from . import validation as check
from .divergences import NAMES, TABLE, get_divergence, phi, sat_exp

LEVELS = ("token", "sequence")
REDUCTIONS = {"token": ("token_mean", "seq_mean", "sum"), "sequence": ("seq_mean", "sum")}
SCALES = ("group", "batch", "none")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


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
    valid = targets != ignore_index
    picked = logp_all.gather(-1, torch.where(valid, targets, 0).unsqueeze(-1)).squeeze(-1)
    logp = torch.where(valid, picked, 0.0)
    if not return_entropy:
        return logp
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, torch.where(valid, entropy, 0.0)


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


def group_zscore(x, num_generations, eps=1e-4, unbiased=True, scale="group", detach_stats=False):
    """(x − μ_g) / (σ + eps) per group of `num_generations` contiguous rows (SPEC §2)."""
    groups = x.reshape(-1, num_generations)
    mu = groups.mean(-1, keepdim=True)
    if scale == "group":
        sigma = _std(groups, unbiased).unsqueeze(-1)
    elif scale == "batch":
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
    check.num_generations("num_generations", num_generations, rewards.shape[0])
    check.positive("eps", eps, allow_zero=True)
    check.choice("scale", scale, SCALES)
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
):
    """f-GRPO: Σ over units of |a_i|·φ_{sign a_i}(r), r = β·log(π/π_ref) per token or sequence.

    level "token": r[i,t] = β(logps − ref); reductions "token_mean" (default), "seq_mean", "sum".
    level "sequence": r_i = β Σ_t mask·(logps − ref); reductions "seq_mean" (default), "sum".
    `advantages` may be None when `rewards` and `num_generations` are given (group z-score).
    `group_is_weights=True` multiplies unit i by `importance_weights` (needs old_logps, rewards,
    num_generations).
    """
    B, T = check.loss_batch(logps, ref_logps, mask)
    div = get_divergence(divergence)
    check.real("beta", beta)
    check.choice("level", level, LEVELS)
    reduction = REDUCTIONS[level][0] if reduction is None else reduction
    check.choice("reduction", reduction, REDUCTIONS[level])
    advantages = check.advantages_or_rewards(
        advantages, rewards, num_generations, B, need_rewards=group_is_weights
    )
    dtype = compute_dtype(logps, ref_logps, advantages)
    if advantages is None:
        advantages = group_normalize(rewards, num_generations)
    a = advantages.to(dtype)
    weight = a.abs()
    if group_is_weights:
        check.tensor("old_logps", old_logps, shape=(B, T), floating=True)
        weight = weight * importance_weights(rewards, a, old_logps, mask, num_generations)
    positive = a > 0
    m = mask.to(dtype)
    if level == "sequence":
        u = weight * phi(beta * _seq_log_ratio(logps, ref_logps, mask, dtype), positive, div)
        return u.mean() if reduction == "seq_mean" else u.sum()
    diff = torch.where(mask.bool(), logps.to(dtype) - ref_logps.to(dtype), 0.0)
    u = m * weight[:, None] * phi(beta * diff, positive[:, None], div)
    if reduction == "token_mean":
        return u.sum() / m.sum().clamp(min=1.0)
    if reduction == "seq_mean":
        return (u.sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    return u.sum()


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
):
    """TRL/Liger GRPO: −min(c1·a, clip(c1)·a) + β·k3(ref, logps), reduced per `loss_type`.

    c1 = exp(log_ratio), log_ratio = logps − old_logps per token, or its masked sequence mean
    (GSPO) at importance_sampling_level "sequence". old_logps None → logps.detach(); ref_logps
    None → logps.detach() (no KL, as in Liger).
    """
    B, T = check.loss_batch(logps, None, mask)
    check.optional_per_token("old_logps", old_logps, B, T)
    check.optional_per_token("ref_logps", ref_logps, B, T)
    check.tensor("advantages", advantages, shape=(B,), floating=True)
    check.choice("loss_type", loss_type, LOSS_TYPES)
    check.choice("importance_sampling_level", importance_sampling_level, LEVELS)
    check.real("beta", beta)
    check.positive("epsilon_low", epsilon_low, allow_zero=True)
    check.positive("epsilon_high", epsilon_high, allow_zero=True)
    if max_completion_length is not None:
        check.positive("max_completion_length", max_completion_length)
    dtype = compute_dtype(logps, old_logps, ref_logps, advantages)
    lp = logps.to(dtype)
    old = lp.detach() if old_logps is None else old_logps.to(dtype)
    ref = lp.detach() if ref_logps is None else ref_logps.to(dtype)
    valid = mask.bool()
    m = mask.to(dtype)
    log_ratio = torch.where(valid, lp - old, 0.0)
    if importance_sampling_level == "sequence":
        log_ratio = (log_ratio.sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    c1 = sat_exp(log_ratio)
    c2 = c1.clamp(1.0 - epsilon_low, 1.0 + epsilon_high)
    a = advantages.to(dtype).unsqueeze(-1)
    per_token = -torch.minimum(c1 * a, c2 * a)
    if beta != 0.0:
        d = torch.where(valid, ref - lp, 0.0)
        per_token = per_token + beta * (sat_exp(d) - d - 1.0)
    total = (per_token * m).sum()
    if loss_type == "grpo":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return total / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return total / (B * (T if max_completion_length is None else max_completion_length))
    denom = m.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
    return total / denom.to(dtype).clamp(min=1.0)


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
    check.tensor("rewards", rewards, shape=(B,), floating=True)
    check.num_generations("num_generations", num_generations, B)
    check.real("beta", beta)
    check.positive("eps", eps, allow_zero=True)
    dtype = compute_dtype(logps, ref_logps, rewards)
    k = _seq_log_ratio(logps, ref_logps, mask, dtype)
    r_hat = group_zscore(rewards.to(dtype), num_generations, eps, unbiased)
    k_hat = group_zscore(k, num_generations, eps, unbiased, detach_stats=detach_stats)
    return ((r_hat - beta * k_hat) ** 2).mean()


# ----------------------------------------------------------------------------- FDO / f-HAL


def fdo_loss(logps, ref_logps, mask, chosen, divergence="pearson", beta=0.1):
    """FDO: mean_chosen φ₊(r) + mean_rejected φ₋(r), r_i = β Σ_t mask·(logps − ref_logps)."""
    B, _ = check.loss_batch(logps, ref_logps, mask)
    check.chosen("chosen", chosen, B)
    spec = TABLE[get_divergence(divergence)]
    check.real("beta", beta)
    r = beta * _seq_log_ratio(logps, ref_logps, mask, compute_dtype(logps, ref_logps))
    return spec.phi_pos(r[chosen]).mean() + spec.phi_neg(r[~chosen]).mean()


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
    check.real("lam", lam)
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam: expected a number in [0, 1]; got {lam!r}")
    fdo = fdo_loss(pref_logps, pref_ref_logps, pref_mask, chosen, divergence, beta)
    fgrpo = fgrpo_loss(logps, ref_logps, advantages, mask, divergence, beta, level, reduction)
    return lam * fdo + (1.0 - lam) * fgrpo


__all__ = [
    "NAMES",
    "fdo_loss",
    "fgrpo_loss",
    "fhal_loss",
    "gift_loss",
    "importance_weights",
    "group_normalize",
    "grpo_loss",
    "logprobs",
]
