"""verl 0.9.1's policy-loss registry (`actor.policy_loss.loss_mode`) and M2PO, on log-probs.

Each `<mode>_loss(logp, old_logp, advantages, mask, *, options) -> (loss, metrics)` equals
verl's `core_algos.compute_policy_loss_<mode>` on the same inputs: logp, old_logp, mask,
rollout_is_weights [B, T]; advantages [B, T] (verl's) or [B] (broadcast over tokens). Option
names and defaults are verl's (ActorConfig / PolicyLossConfig); metrics carry verl's names as
detached 0-d tensors. Every loss is multiplied by the rollout IS weights w before `agg_loss`.
Where verl divides 0 by 0 (no unmasked token in the micro-batch) the loss here is 0.
A loss's options are declared once, in its `with_options` line (the shared groups `CLIP` and
`aggregated()` plus its own), which gives the function its keyword signature.
"""

from __future__ import annotations

import functools
import inspect
from types import SimpleNamespace

import torch

from .policy_variants import (
    cast,
    compute_dtype,
    detached,
    row_mean,
    sign_clip_passes,
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


REQUIRED = inspect.Parameter.empty  # an option without a default
TENSORS = ("logp", "old_logp", "advantages", "mask")
CLIP = {"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": None}


def aggregated(loss_agg_mode="token-mean"):
    """The options of a loss that ends in `agg_loss`: its mode (verl's default for this loss),
    the rollout IS weights and the global batch's counts."""
    return {"loss_agg_mode": loss_agg_mode, "rollout_is_weights": None, "global_batch_info": None}


def with_options(*groups):
    """`body(logp, old_logp, advantages, mask, opts)` as `fn(logp, old_logp, advantages, mask, *,
    options)`, the options those of `groups` ({name: default or REQUIRED}) in their order.
    inspect.signature(fn) shows them (`losses.policy.Variant` reads a variant's options there),
    a call binds them as Python binds keywords (a TypeError for an unknown or missing one), and
    `opts` holds every option by name, defaults filled in."""
    kinds = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter(name, kinds[0]) for name in TENSORS]
    params += [inspect.Parameter(k, kinds[1], default=v) for g in groups for k, v in g.items()]
    signature = inspect.Signature(params)

    def wrap(body):
        @functools.wraps(body)
        def fn(*args, **kwargs):
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError as e:  # as Python says it: "<name>() missing ..."
                raise TypeError(f"{body.__name__}() {e}") from None
            bound.apply_defaults()
            values = dict(bound.arguments)
            tensors = [values.pop(name) for name in TENSORS]
            return body(*tensors, SimpleNamespace(**values))

        fn.__signature__ = signature
        return fn

    return wrap


def _prepare(logp, old_logp, advantages, mask, rollout_is_weights=None):
    dtype = compute_dtype(logp, old_logp, advantages)
    lp, old, a, w = cast(dtype, logp, old_logp, advantages, rollout_is_weights)
    return lp, old, token_advantages(a), mask.to(dtype), w


def _finish(pg_losses, mask, w, opts, metrics):
    """(agg_loss of pg_losses·w under opts.loss_agg_mode and global_batch_info, metrics)."""
    if w is not None:
        pg_losses = pg_losses * w
    loss = agg_loss(pg_losses, mask, opts.loss_agg_mode, **(opts.global_batch_info or {}))
    return loss, detached(metrics)


def _bounds(opts):
    low = opts.clip_ratio if opts.clip_ratio_low is None else opts.clip_ratio_low
    high = opts.clip_ratio if opts.clip_ratio_high is None else opts.clip_ratio_high
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


def _pg_metrics(m, clipped, lr, clipped_lower=None):
    """verl's actor/pg_clipfrac, actor/ppo_kl (the masked mean of −lr) and, given,
    actor/pg_clipfrac_lower: masked means of the clipped-token indicators [B, T]."""
    metrics = {"actor/pg_clipfrac": masked_mean(clipped, m), **_kl_metric(lr, m)}
    if clipped_lower is not None:
        metrics["actor/pg_clipfrac_lower"] = masked_mean(clipped_lower, m)
    return metrics


# ----------------------------------------------------------------------------- clipped losses


@with_options(CLIP, {"clip_ratio_c": 3.0}, aggregated(), {"log_ratio_clamp": LOG_RATIO_CLAMP})
def vanilla_loss(logp, old_logp, advantages, mask, opts):
    """PPO with dual clip: l = clamp(logp − old, ±20), r = e^l, L = max(−a·r, −a·clip(r)),
    and min(L, −a·c) where a < 0. clip_ratio_c None: no dual clip; log_ratio_clamp None: l
    unclamped (plain PPO, as M2PO's fork)."""
    c = opts.clip_ratio_c
    if c is not None and not c > 1.0:
        raise ValueError(f"clip_ratio_c: expected a number > 1.0; got {c!r}")
    lp, old, a, m, w = _prepare(logp, old_logp, advantages, mask, opts.rollout_is_weights)
    low, high = _bounds(opts)
    lr = lp - old
    if opts.log_ratio_clamp is not None:
        lr = lr.clamp(-opts.log_ratio_clamp, opts.log_ratio_clamp)
    l1, l2, clipped = _ppo(torch.exp(lr), a, low, high)
    l3 = -a * (float("inf") if c is None else c)
    pg = clipped if c is None else torch.where(a < 0, torch.minimum(l3, clipped), clipped)
    lower = ((clipped > l3) & (a < 0)).to(m.dtype)
    return _finish(pg, m, w, opts, _pg_metrics(m, (l2 > l1).to(m.dtype), lr, lower))


@with_options(CLIP, aggregated("seq-mean-token-mean"))
def gspo_loss(logp, old_logp, advantages, mask, opts):
    """verl's `gspo`: GSPO-token, log s_it = logp − sg(logp) + sg(Σ m l / max(Σ m, 1)) clamped
    at 10, L = max(−a·s, −a·clip(s))."""
    lp, old, a, m, w = _prepare(logp, old_logp, advantages, mask, opts.rollout_is_weights)
    low, high = _bounds(opts)
    lr = lp - old
    seq = (lr * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    s = torch.exp((lp - lp.detach() + seq.detach().unsqueeze(-1)).clamp(max=10.0))
    l1, l2, pg = _ppo(s, a, low, high)
    metrics = _pg_metrics(m, (l2 > l1).to(m.dtype), lr)
    metrics["actor/pg_clipfrac_lower"] = lp.new_zeros(())
    return _finish(pg, m, w, opts, metrics)


@torch.no_grad()
@with_options(CLIP, {"clip_cov_lb": 1.0, "clip_cov_ub": 5.0})
def clip_cov_candidates(logp, old_logp, advantages, mask, opts):
    """clip_cov's candidate tokens (bool [B, T]): unmasked, not clipped by PPO, and
    lb < cov < ub, cov = (a − mean a)(logp − mean logp) over the micro-batch's tokens."""
    lp, old, a, m, _ = _prepare(logp, old_logp, advantages, mask)
    l1, l2, _ = _ppo(torch.exp(lp - old), a, *_bounds(opts))
    a = a.expand_as(lp)
    cov = (a - masked_mean(a, m)) * (lp - masked_mean(lp, m))
    live = (m > 0) & ~(l2 > l1)
    return live & (cov < opts.clip_cov_ub) & (cov > opts.clip_cov_lb)


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


@with_options({"clip_cov_keep": REQUIRED}, CLIP, aggregated())
def clip_cov_loss(logp, old_logp, advantages, mask, opts):
    """Clip-Cov: PPO on the unclamped r = e^(logp − old), times `clip_cov_keep` [B, T] (0 on the
    tokens chosen at random, `draw_clip_cov_keep`)."""
    lp, old, a, m, w = _prepare(logp, old_logp, advantages, mask, opts.rollout_is_weights)
    lr = lp - old
    corr = opts.clip_cov_keep.to(lp.dtype)
    pg = _ppo(torch.exp(lr), a, *_bounds(opts))[2] * corr
    return _finish(pg, m, w, opts, _pg_metrics(m, (corr == 0).to(m.dtype), lr))


@with_options(CLIP, {"rollout_is_weights": None})
def geo_mean_loss(logp, old_logp, advantages, mask, opts):
    """verl's `geo_mean` (GMPO): l~ = sign(a)·min(sign(a)·l, sign(a)·clamp(l, −ε_low, ε_high)),
    L_i = −ā_i·exp(Σ m l~ / (Σ m + 1e-8)) (ā_i the masked row mean of a), times the geometric
    row mean of w; the mean over rows (it ignores loss_agg_mode)."""
    lp, old, a, m, w = _prepare(logp, old_logp, advantages, mask, opts.rollout_is_weights)
    low, high = _bounds(opts)
    lr = lp - old
    a = a.expand_as(lp)
    ratio = torch.exp(row_mean(sign_clipped_log_ratio(lr, torch.sign(a), low, high), m, VERL_EPS))
    pg = -row_mean(a, m, VERL_EPS) * ratio
    if w is not None:
        pg = pg * torch.exp(row_mean(torch.log(w + 1e-10), m, VERL_EPS))
    clipped = (lr != lr.clamp(-low, high)).to(m.dtype)
    metrics = _pg_metrics(m, clipped * (a > 0), lr, clipped * (a < 0))
    return pg.sum() / max(pg.numel(), 1), detached(metrics)


def geo_mean_token_part(lr, a, m, w, opts):
    """verl geo_mean's u_t = m_t where the sign(a_t)-clipped log-ratio passes lr's gradient,
    else 0 (`policy_variants.gmpo_token_part`; ā_i, the ratio and w's geometric mean are c_i)."""
    return m * sign_clip_passes(lr, torch.sign(a), *_bounds(opts))
