"""verl 0.9.1's policy losses without a ratio clip (`gpg`, `dro`, `dppo_tv`, `dppo_kl`,
`kl_cov`), the gpg advantage helper, and `POLICY_LOSSES`: verl's `loss_mode` names → the
reference functions. Conventions as in `policy_variants_verl`.
"""

from __future__ import annotations

import torch

from .policy_variants_verl import (
    CLIP,
    LOG_RATIO_CLAMP,
    REQUIRED,
    _bounds,
    _clamped_ratio,
    _finish,
    _kl_metric,
    _pg_metrics,
    _prepare,
    aggregated,
    clip_cov_loss,
    geo_mean_loss,
    gspo_loss,
    masked_mean,
    vanilla_loss,
    with_options,
)

# ----------------------------------------------------------------------------- REINFORCE-like


@with_options(aggregated())
def gpg_loss(logp, old_logp, advantages, mask, opts):
    """GPG: L = −a·logp (use `gpg_advantages`); old_logp is unused (may be None)."""
    lp, _, a, m, w = _prepare(logp, None, advantages, mask, opts.rollout_is_weights)
    return _finish(-lp * a, m, w, opts, {})


def uid_groups(index, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's `uid` (one hashable group id per row) as (group [B] int64, numbered in order of
    first appearance, and count [G], rows per group, of `like`'s dtype and device)."""
    ids = {}
    group = torch.tensor(
        [ids.setdefault(i, len(ids)) for i in list(index)], dtype=torch.long, device=like.device
    )
    ones = torch.ones(group.shape[0], dtype=like.dtype, device=like.device)
    count = torch.zeros(len(ids), dtype=like.dtype, device=like.device).index_add_(0, group, ones)
    return group, count


@torch.no_grad()
def gpg_advantages(rewards, mask, index, f_norm=1.0):
    """verl's `compute_gpg_outcome_advantage`: R_i = Σ_t rewards (rewards [B, T], or [B]),
    a_i = α(R_i − mean of R over i's group) / f_norm, α = B / max(#{R ≠ 0}, 1); a group of one
    has mean 0. `index` [B]: any hashable group ids. Returns a·mask [B, T]."""
    scores = rewards.sum(-1) if rewards.dim() == 2 else rewards.clone()
    group, count = uid_groups(index, scores)
    total = torch.zeros_like(count).index_add_(0, group, scores)
    mean = torch.where(count > 1, total / count, 0.0)[group]
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
    return (alpha * (scores - mean) / f_norm).unsqueeze(-1) * mask.to(scores.dtype)


@with_options({"dro_beta": REQUIRED}, aggregated())
def dro_loss(logp, old_logp, advantages, mask, opts):
    """DRO: L = −(a·logp − ½·β·(logp − old)²); dro_beta > 0 is required."""
    beta = opts.dro_beta
    if beta is None or not beta > 0:
        raise ValueError(f"dro_beta: expected a number > 0 (required by dro); got {beta!r}")
    lp, old, a, m, w = _prepare(logp, old_logp, advantages, mask, opts.rollout_is_weights)
    lr = lp - old
    pg = -(lp * a - 0.5 * beta * lr.square())
    return _finish(pg, m, w, opts, _kl_metric(lr, m))


DPPO_OPTIONS = CLIP, {"clip_ratio_c": 3.0}, aggregated()


def _dppo_loss(kind, logp, old_logp, advantages, mask, opts):
    lp, old, a, m, w = _prepare(logp, old_logp, advantages, mask, opts.rollout_is_weights)
    low, high = _bounds(opts)
    lr = lp - old
    ratio = _clamped_ratio(lr)
    truncated = ratio.clamp(max=opts.clip_ratio_c).detach()
    p, p_old = torch.exp(lp), torch.exp(old)
    if kind == "tv":
        pos, neg = (p - p_old) <= high, (p - p_old) >= -low
    else:
        kl = p_old * (old - lp) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
        pos, neg = (kl <= high) | (p <= p_old), (kl <= low) | (p >= p_old)
    valid = torch.where(a > 0, pos, neg).detach().to(lp.dtype)
    pg = -a * truncated * lp * valid
    kl_lr = lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    metrics = _pg_metrics(m, 1.0 - valid, kl_lr, (ratio > opts.clip_ratio_c) * valid)
    return _finish(pg, m, w, opts, metrics)


@with_options(*DPPO_OPTIONS)
def dppo_tv_loss(logp, old_logp, advantages, mask, opts):
    """DPPO-Binary-TV: L = −a·sg(min(r, c))·M·logp, M keeps a > 0 where p − p_old ≤ δ_high and
    a ≤ 0 where p − p_old ≥ −δ_low (δ = clip_ratio_*, r from l clamped ±20)."""
    return _dppo_loss("tv", logp, old_logp, advantages, mask, opts)


@with_options(*DPPO_OPTIONS)
def dppo_kl_loss(logp, old_logp, advantages, mask, opts):
    """DPPO-Binary-KL: as dppo_tv with M from the binary KL D = p_old(old − logp) +
    (1 − p_old)·log((1 − p_old + 1e-8)/(1 − p + 1e-8)): a > 0 kept where D ≤ δ_high or
    p ≤ p_old, a ≤ 0 where D ≤ δ_low or p ≥ p_old."""
    return _dppo_loss("kl", logp, old_logp, advantages, mask, opts)


@with_options({"kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1}, aggregated())
def kl_cov_loss(logp, old_logp, advantages, mask, opts):
    """KL-Cov: L = −a·r (r = e^(logp − old), no clip), and −a·r + c·|logp − old| on the
    max(⌊ρ·n⌋, 1) unmasked tokens of largest cov = (a − mean a)(logp − mean logp) (means over
    the n unmasked tokens; torch.topk's choice, as verl)."""
    if not opts.kl_cov_ratio > 0:
        raise ValueError(f"kl_cov_ratio: expected a number > 0; got {opts.kl_cov_ratio!r}")
    lp, old, a, m, w = _prepare(logp, old_logp, advantages, mask, opts.rollout_is_weights)
    lr = lp - old
    pg = -a * torch.exp(lr)
    valid = m > 0
    top = torch.zeros_like(valid)
    n = int(valid.sum())
    if n:
        av, lv = a.expand_as(lp)[valid].detach(), lp[valid].detach()
        cov = (av - av.mean()) * (lv - lv.mean())
        chosen = torch.zeros(n, dtype=torch.bool, device=lp.device)
        chosen[torch.topk(cov, max(1, int(n * opts.kl_cov_ratio)), largest=True).indices] = True
        top = top.masked_scatter(valid, chosen)
    pg = torch.where(top, pg + opts.ppo_kl_coef * lr.abs(), pg)
    metrics = {"actor/ppo_kl": masked_mean(lr.abs(), m)}
    return _finish(pg, m, w, opts, metrics)


POLICY_LOSSES = {
    "vanilla": vanilla_loss,
    "gspo": gspo_loss,
    "clip_cov": clip_cov_loss,
    "geo_mean": geo_mean_loss,
    "gpg": gpg_loss,
    "dro": dro_loss,
    "dppo_tv": dppo_tv_loss,
    "dppo_kl": dppo_kl_loss,
    "kl_cov": kl_cov_loss,
}
