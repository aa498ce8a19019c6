"""M2PO (second-moment trust region), as the authors' verl fork computes it.

Source: github.com/Infini-AI-Lab/M2PO at af54a3e8feffb7a66a8258003aebefa37759cec0,
verl/trainer/ppo/core_algos.py (`kpo_clip_harmful_tokens`, `_solve_tau_from_sorted_delta2`,
`compute_m2po_policy_loss`) and verl/workers/actor/dp_actor.py (miniclip_low / miniclip_high
read from the config, None when unset, as in the authors' scripts). Shapes as in
`policy_variants_verl`: logp, old_logp, mask [B, T]; advantages [B] or [B, T] (the row's
advantage is column 0).
"""

from __future__ import annotations

import torch

from .policy_variants import compute_dtype, token_advantages
from .policy_variants_verl import _choice, gspo_loss, vanilla_loss

NO_CLIP = 100000.0  # the fork's "no clip" ratio bound
TINY = 1e-12
# The clipped losses M2PO can set the clip range of ("ppo" is the fork's own, no dual clip).
CLIP_LOSSES = ("ppo", "vanilla", "gspo")


@torch.no_grad()
def m2po_clip_range(
    logp, old_logp, advantages, mask, M2_budget=0.04, miniclip_low=None, miniclip_high=None
):
    """The batch-wide, detached clip range (ε_low, ε_high) and stats (0-d float64 tensors).

    Δ = old − logp over the harmful tokens H = {m, a > 0, r > 1} ∪ {m, a < 0, r < 1} (a the
    row's advantage, ±1e-12 margins); M2 = mean_H Δ². M2 ≤ budget: no clip (ratio in
    [0, 1e5]). Otherwise sort Δ² ascending (v), take the first k with (v_k − 1e-12)(n − k − 1) +
    Σ_{j≤k} v_j ≥ budget·n: τ = √(v_{k−1} − 1e-12) (0 at k = 0), the ratio bounds [e^−τ, e^τ],
    ε_low = 1 − e^−τ, ε_high = e^τ − 1, each raised to miniclip_* when given."""
    if M2_budget is None or not M2_budget > 0:
        raise ValueError(f"M2_budget: expected a number > 0; got {M2_budget!r}")
    dtype = compute_dtype(logp, old_logp)
    lp, old = logp.to(dtype), old_logp.to(dtype)
    a = token_advantages(advantages.to(dtype))[:, :1]
    delta = old - lp
    ratio = torch.exp(-delta)
    live = mask.bool()
    harmful = live & (((a > TINY) & (ratio > 1.0 + TINY)) | ((a < -TINY) & (ratio < 1.0 - TINY)))
    v = torch.sort(delta.square()[harmful]).values
    n = v.numel()
    f64 = torch.float64
    m2 = (v.sum() / max(n, 1)).to(f64)
    low_bound, high_bound, m2_after = 0.0, NO_CLIP, m2
    if n and m2 > M2_budget + TINY:
        csum = torch.cumsum(v, 0).to(f64)
        vd = v.to(f64)
        rest = n - 1 - torch.arange(n, dtype=f64, device=v.device)
        k = int(torch.nonzero((vd - TINY) * rest + csum >= M2_budget * n - TINY)[0, 0])
        if k == 0:
            tau, m2_after = 0.0, csum[-1] / n
        else:
            tau = float((vd[k - 1] - TINY).clamp(min=0.0)) ** 0.5
            m2_after = (vd[k - 1] * (n - k) + csum[k - 1]) / n
        # the fork maps τ to bounds in float32 (torch.tensor of a Python float)
        low_bound = float(torch.exp(torch.tensor(-tau)))
        high_bound = float(torch.exp(torch.tensor(tau)))
    eps_low, eps_high = 1.0 - low_bound, high_bound - 1.0
    if miniclip_low is not None:
        eps_low = max(eps_low, miniclip_low)
    if miniclip_high is not None:
        eps_high = max(eps_high, miniclip_high)
    stats = {
        "m2po/clip_low": eps_low,
        "m2po/clip_high": eps_high,
        "m2po/M2": m2,
        "m2po/M2_after": m2_after,
        "m2po/M2_budget": M2_budget,
    }
    return eps_low, eps_high, {k: torch.as_tensor(x, dtype=f64) for k, x in stats.items()}


def m2po_loss(
    logp,
    old_logp,
    advantages,
    mask,
    *,
    M2_budget=0.04,
    miniclip_low=None,
    miniclip_high=None,
    clip_loss="ppo",
    loss_agg_mode="token-mean",
    **clip_options,
):
    """M2PO: `m2po_clip_range` once over the batch, then `clip_loss` with that clip range:
    "ppo" (the fork: max(−a·r, −a·clip(r)), r = e^(logp − old) unclamped, no dual clip),
    "vanilla" (verl's, with dual clip) or "gspo" (verl's). A loss without a clip range (gpg,
    dro, kl_cov, ...) is a ValueError."""
    _choice("clip_loss", clip_loss, CLIP_LOSSES)
    low, high, stats = m2po_clip_range(
        logp, old_logp, advantages, mask, M2_budget, miniclip_low, miniclip_high
    )
    if clip_loss == "gspo":
        fn = gspo_loss
    else:
        fn = vanilla_loss
        if clip_loss == "ppo":
            clip_options = {**clip_options, "clip_ratio_c": None, "log_ratio_clamp": None}
    loss, metrics = fn(
        logp,
        old_logp,
        advantages,
        mask,
        clip_ratio_low=low,
        clip_ratio_high=high,
        loss_agg_mode=loss_agg_mode,
        **clip_options,
    )
    if clip_loss == "ppo":
        metrics.pop("actor/pg_clipfrac_lower")
    return loss, {**metrics, **stats}
