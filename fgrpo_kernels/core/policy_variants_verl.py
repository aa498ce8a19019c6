"""verl 0.9.1's policy-loss registry (`actor.policy_loss.loss_mode`) and M2PO, on log-probs.

Each `<mode>_loss(logp, old_logp, advantages, mask, *, options) -> (loss, metrics)` equals
verl's `core_algos.compute_policy_loss_<mode>` on the same inputs: logp, old_logp, mask,
rollout_is_weights [B, T]; advantages [B, T] (verl's) or [B] (broadcast over tokens). Option
names and defaults are verl's (ActorConfig / PolicyLossConfig); metrics carry verl's names as
detached 0-d tensors. Every loss is multiplied by the rollout IS weights w before `agg_loss`.
Where verl divides 0 by 0 (no unmasked token in the micro-batch) the loss here is 0.
"""

from __future__ import annotations

import torch

from .policy_variants import (
    cast,
    compute_dtype,
    detached,
    row_mean,
    sign_clipped_log_ratio,
    token_advantages,
)

AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
)
VERL_EPS = 1e-8  # verl_F.masked_mean's denominator guard
LOG_RATIO_CLAMP = 20.0  # verl clamps l to ±20 before exp


def _choice(arg, value, choices):
    if value not in choices:
        raise ValueError(f"{arg}: expected one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def _safe_div(num, den):
    """num / den, 0 (with no gradient) where den = 0."""
    den = torch.as_tensor(den, dtype=num.dtype, device=num.device)
    return torch.where(den != 0, num / torch.where(den != 0, den, 1.0), 0.0)


def masked_mean(x, mask):
    """verl_F.masked_mean: Σ mask·x / (Σ mask + 1e-8)."""
    m = mask.to(x.dtype)
    return (torch.where(mask.bool(), x, 0.0) * m).sum() / (m.sum() + VERL_EPS)


def agg_loss(
    per_token,
    mask,
    loss_agg_mode="token-mean",
    *,
    dp_size=1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
):
    """verl's `agg_loss`, per_token and mask [B, T]:
    token-mean Σ m·x / N·dp (N = batch_num_tokens, default Σ m); token-sum Σ m·x·dp;
    seq-mean-token-sum Σ_i (Σ_t m·x) / G·dp over rows with a token (G = global_batch_size,
    default their count), -norm the same / loss_scale_factor (default T); seq-mean-token-mean
    Σ_i (Σ_t m·x / (Σ_t m + 1e-8)) / G·dp. dp_size > 1 needs the global count."""
    _choice("loss_agg_mode", loss_agg_mode, AGG_MODES)
    m = mask.to(per_token.dtype)
    masked = torch.where(mask.bool(), per_token, 0.0) * m
    if loss_agg_mode == "token-sum":
        return masked.sum() * dp_size
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            _need_global("batch_num_tokens", dp_size)
            batch_num_tokens = m.sum()
        return _safe_div(masked.sum(), batch_num_tokens) * dp_size
    lengths = m.sum(-1)
    seq = masked.sum(-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq = seq / (lengths + VERL_EPS)
    live = (lengths > 0).to(seq.dtype)
    if global_batch_size is None:
        _need_global("global_batch_size", dp_size)
        global_batch_size = live.sum()
    loss = _safe_div((seq * live).sum(), global_batch_size) * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


def _need_global(arg, dp_size):
    if dp_size > 1:
        raise ValueError(f"{arg}: required when dp_size > 1 (the global batch's count)")


def _prepare(logp, old_logp, advantages, mask, rollout_is_weights=None):
    dtype = compute_dtype(logp, old_logp, advantages)
    lp, old, a, w = cast(dtype, logp, old_logp, advantages, rollout_is_weights)
    return lp, old, token_advantages(a), mask.to(dtype), w


def _finish(pg_losses, mask, w, loss_agg_mode, global_batch_info, metrics):
    if w is not None:
        pg_losses = pg_losses * w
    loss = agg_loss(pg_losses, mask, loss_agg_mode, **(global_batch_info or {}))
    return loss, detached(metrics)


def _bounds(clip_ratio, clip_ratio_low, clip_ratio_high):
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    return low, high


def _ppo(ratio, a, low, high):
    """(−a·r, −a·clip(r, 1 − low, 1 + high), their max): PPO's pessimistic surrogate."""
    l1 = -a * ratio
    l2 = -a * ratio.clamp(1.0 - low, 1.0 + high)
    return l1, l2, torch.maximum(l1, l2)


def _clamped_ratio(lr):
    return torch.exp(lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _kl_metric(lr, m):
    return {"actor/ppo_kl": masked_mean(-lr, m)}


# ----------------------------------------------------------------------------- clipped losses


def vanilla_loss(
    logp,
    old_logp,
    advantages,
    mask,
    *,
    clip_ratio=0.2,
    clip_ratio_low=None,
    clip_ratio_high=None,
    clip_ratio_c=3.0,
    loss_agg_mode="token-mean",
    rollout_is_weights=None,
    global_batch_info=None,
    log_ratio_clamp=LOG_RATIO_CLAMP,
):
    """PPO with dual clip: l = clamp(logp − old, ±20), r = e^l, L = max(−a·r, −a·clip(r)),
    and min(L, −a·c) where a < 0. clip_ratio_c None: no dual clip; log_ratio_clamp None: l
    unclamped (plain PPO, as M2PO's fork)."""
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c: expected a number > 1.0; got {clip_ratio_c!r}")
    lp, old, a, m, w = _prepare(logp, old_logp, advantages, mask, rollout_is_weights)
    low, high = _bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    lr = lp - old
    if log_ratio_clamp is not None:
        lr = lr.clamp(-log_ratio_clamp, log_ratio_clamp)
    l1, l2, clipped = _ppo(torch.exp(lr), a, low, high)
    l3 = -a * (float("inf") if clip_ratio_c is None else clip_ratio_c)
    pg = (
        clipped if clip_ratio_c is None else torch.where(a < 0, torch.minimum(l3, clipped), clipped)
    )
    metrics = {
        "actor/pg_clipfrac": masked_mean((l2 > l1).to(m.dtype), m),
        **_kl_metric(lr, m),
        "actor/pg_clipfrac_lower": masked_mean(((clipped > l3) & (a < 0)).to(m.dtype), m),
    }
    return _finish(pg, m, w, loss_agg_mode, global_batch_info, metrics)


def gspo_loss(
    logp,
    old_logp,
    advantages,
    mask,
    *,
    clip_ratio=0.2,
    clip_ratio_low=None,
    clip_ratio_high=None,
    loss_agg_mode="seq-mean-token-mean",
    rollout_is_weights=None,
    global_batch_info=None,
):
    """verl's `gspo`: GSPO-token, log s_it = logp − sg(logp) + sg(Σ m l / max(Σ m, 1)) clamped
    at 10, L = max(−a·s, −a·clip(s))."""
    lp, old, a, m, w = _prepare(logp, old_logp, advantages, mask, rollout_is_weights)
    low, high = _bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    lr = lp - old
    seq = (lr * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    s = torch.exp((lp - lp.detach() + seq.detach().unsqueeze(-1)).clamp(max=10.0))
    l1, l2, pg = _ppo(s, a, low, high)
    metrics = {
        "actor/pg_clipfrac": masked_mean((l2 > l1).to(m.dtype), m),
        **_kl_metric(lr, m),
        "actor/pg_clipfrac_lower": lp.new_zeros(()),
    }
    return _finish(pg, m, w, loss_agg_mode, global_batch_info, metrics)


@torch.no_grad()
def clip_cov_candidates(
    logp,
    old_logp,
    advantages,
    mask,
    *,
    clip_ratio=0.2,
    clip_ratio_low=None,
    clip_ratio_high=None,
    clip_cov_lb=1.0,
    clip_cov_ub=5.0,
):
    """clip_cov's candidate tokens (bool [B, T]): unmasked, not clipped by PPO, and
    lb < cov < ub, cov = (a − mean a)(logp − mean logp) over the micro-batch's tokens."""
    lp, old, a, m, _ = _prepare(logp, old_logp, advantages, mask)
    low, high = _bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    l1, l2, _ = _ppo(torch.exp(lp - old), a, low, high)
    a = a.expand_as(lp)
    cov = (a - masked_mean(a, m)) * (lp - masked_mean(lp, m))
    live = (m > 0) & ~(l2 > l1)
    return live & (cov < clip_cov_ub) & (cov > clip_cov_lb)


@torch.no_grad()
def draw_clip_cov_keep(
    logp, old_logp, advantages, mask, *, clip_cov_ratio=0.0002, generator=None, **clip
):
    """clip_cov's `corr` [B, T] (1 keep, 0 zero loss) drawn as verl draws it: k =
    max(⌊ρ·Σ mask⌋, 1) of the candidates (row-major order) by torch.randperm(n, generator).
    A generator seeded s draws what verl draws after torch.manual_seed(s)."""
    if not clip_cov_ratio > 0:
        raise ValueError(f"clip_cov_ratio: expected a number > 0; got {clip_cov_ratio!r}")
    candidates = clip_cov_candidates(logp, old_logp, advantages, mask, **clip)
    keep = torch.ones(candidates.shape, dtype=compute_dtype(logp), device=logp.device)
    idx = torch.nonzero(candidates)
    k = max(int(clip_cov_ratio * mask.sum().item()), 1)
    if len(idx):
        idx = idx[torch.randperm(len(idx), generator=generator)[: min(k, len(idx))]]
        keep[idx[:, 0], idx[:, 1]] = 0.0
    return keep


def clip_cov_loss(
    logp,
    old_logp,
    advantages,
    mask,
    *,
    clip_cov_keep,
    clip_ratio=0.2,
    clip_ratio_low=None,
    clip_ratio_high=None,
    loss_agg_mode="token-mean",
    rollout_is_weights=None,
    global_batch_info=None,
):
    """Clip-Cov: PPO on the unclamped r = e^(logp − old), times `clip_cov_keep` [B, T] (0 on the
    tokens chosen at random, `draw_clip_cov_keep`)."""
    lp, old, a, m, w = _prepare(logp, old_logp, advantages, mask, rollout_is_weights)
    low, high = _bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    lr = lp - old
    corr = clip_cov_keep.to(lp.dtype)
    pg = _ppo(torch.exp(lr), a, low, high)[2] * corr
    metrics = {"actor/pg_clipfrac": masked_mean((corr == 0).to(m.dtype), m), **_kl_metric(lr, m)}
    return _finish(pg, m, w, loss_agg_mode, global_batch_info, metrics)


def geo_mean_loss(
    logp,
    old_logp,
    advantages,
    mask,
    *,
    clip_ratio=0.2,
    clip_ratio_low=None,
    clip_ratio_high=None,
    rollout_is_weights=None,
):
    """verl's `geo_mean` (GMPO): l~ = sign(a)·min(sign(a)·l, sign(a)·clamp(l, −ε_low, ε_high)),
    L_i = −ā_i·exp(Σ m l~ / (Σ m + 1e-8)) (ā_i the masked row mean of a), times the geometric
    row mean of w; the mean over rows (it ignores loss_agg_mode)."""
    lp, old, a, m, w = _prepare(logp, old_logp, advantages, mask, rollout_is_weights)
    low, high = _bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    lr = lp - old
    a = a.expand_as(lp)
    ratio = torch.exp(row_mean(sign_clipped_log_ratio(lr, torch.sign(a), low, high), m, VERL_EPS))
    pg = -row_mean(a, m, VERL_EPS) * ratio
    if w is not None:
        pg = pg * torch.exp(row_mean(torch.log(w + 1e-10), m, VERL_EPS))
    clipped = (lr != lr.clamp(-low, high)).to(m.dtype)
    metrics = {
        "actor/pg_clipfrac": masked_mean(clipped * (a > 0), m),
        **_kl_metric(lr, m),
        "actor/pg_clipfrac_lower": masked_mean(clipped * (a < 0), m),
    }
    return pg.sum() / max(pg.numel(), 1), detached(metrics)
