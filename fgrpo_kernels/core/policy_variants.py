"""Policy-loss variants on per-token log-probs, in plain PyTorch (no Triton, no [N, V]).

Each `<name>_loss(logp, old_logp, advantages, mask, *, options) -> (loss, metrics)` is a pure,
differentiable function of its tensors, computed in float32 or wider (float64 stays float64).
Shapes: logp, old_logp, mask, ref_logp, entropy [B, T]; advantages [B] (or [B, T] where the
source allows per-token advantages); loss a 0-d tensor; metrics detached 0-d tensors under the
source's names. This file holds the TRL-side variants (GMPO as TRL's GMPOTrainer computes it,
GSPO-token on TRL's loss types) and the helpers the verl-side file shares.
"""

from __future__ import annotations

import dataclasses

import torch

from . import grpo_math, reference
from .kl_estimators import with_parsed_penalty
from .options import GRPOOptions, Level, Objective, name_of

Metrics = dict[str, torch.Tensor]


def compute_dtype(*tensors) -> torch.dtype:
    """float32, or the widest floating dtype among `tensors`."""
    dtype = torch.float32
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def cast(dtype, *tensors):
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def token_advantages(advantages: torch.Tensor) -> torch.Tensor:
    """Advantages [B] as [B, 1] (broadcast over tokens); [B, T] unchanged."""
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


def row_mean(x: torch.Tensor, weights: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    """Σ_t weights·x / max(Σ_t weights, 1) per row [B] (TRL); with `eps`: / (Σ_t weights + eps)
    (verl)."""
    total = weights.sum(-1)
    denom = total.clamp(min=1.0) if eps is None else total + eps
    return (x * weights).sum(-1) / denom


def sign_clipped_log_ratio(lr, sign, low: float, high: float) -> torch.Tensor:
    """s·min(s·l, s·clamp(l, −low, high)): min(l, high) where s > 0, max(l, −low) where s < 0,
    0 where s = 0 (PPO's pessimistic clip written in log space)."""
    return sign * torch.minimum(sign * lr, sign * lr.clamp(-low, high))


def sign_clip_passes(lr, sign, low: float, high: float) -> torch.Tensor:
    """d/dl of `sign_clipped_log_ratio` as autograd forms it (at a bound min's tie halves and
    clamp's edge passes: 1): 1.0 where l ≤ high (s > 0) or l ≥ −low (s < 0), else 0.0."""
    return torch.where(sign > 0, lr <= high, (sign < 0) & (lr >= -low)).to(lr.dtype)


# ----------------------------------------------------------------------------- token parts
# A sequence-local variant whose dL/dlogp_t is c_i·u_t (c_i a number of the row i, u_t one of
# the token t alone) may give `<name>_token_part(lr, a, m, w, opts) -> u` [n] from the tokens'
# log-ratios lr, advantages a, mask m, IS weights w (None: none) and the resolved options
# `opts`: the single pass's open rows take it for a row's earlier pieces and check it against
# the true gradient at the row's end (losses/single_pass.py).


def _gmpo_high(epsilon, epsilon_high):
    """GMPO's upper log-ratio bound: ε_high, or ε when None (TRL's GRPOConfig)."""
    return epsilon if epsilon_high is None else epsilon_high


def _trl_sign(a):
    """TRL GMPO's clip side: +1 where a > 0, else −1."""
    return torch.where(a > 0, 1.0, -1.0)


def gmpo_token_part(lr, a, m, w, opts):
    """GMPO's u_t = m_t where the sign-clipped log-ratio passes lr's gradient, else 0;
    c_i = −a_i·S_i / (B·max(Σ m', 1)·steps)."""
    high = _gmpo_high(opts.epsilon, opts.epsilon_high)
    return m * sign_clip_passes(lr, _trl_sign(a), opts.epsilon, high)


def sequence_ratio_token_part(lr, a, m, w, opts):
    """GSPO-token's (TRL) and verl gspo's u_t = m_t·a_t·w_t: token t's term −a_t·w_t·s_it, with
    s_it = sg(s_i)·e^(l_t − sg(l_t)), takes the row's value and clip (c_i) and token t's
    gradient."""
    return m * a if w is None else m * a * w


def detached(metrics: dict) -> Metrics:
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}


def _row_nan_extreme(x, mask, extreme):
    """TRL's nanmin / nanmax over rows of each row's masked mean (rows without tokens are NaN
    and skipped; NaN when every row is)."""
    m = mask.to(x.dtype)
    per_row = (x * m).sum(-1) / m.sum(-1)
    live = per_row[~torch.isnan(per_row)]
    return extreme(live) if live.numel() else x.new_full((), float("nan"))


def trl_global_mean(x, mask):
    """TRL's `global_masked_mean` on one process: the masked mean of x [B, T], or, when x has
    one column (as TRL tells a sequence-level value, T = 1 included), the mean over rows."""
    if x.shape[-1] == 1:
        return x.sum() / max(x.shape[0], 1)
    return grpo_math.masked_mean(x, mask)


def _trl_clip_metrics(low, high, mask) -> Metrics:
    """TRL's clip_ratio/* from the (low, high) clipped-token indicators [B, T] or [B, 1]."""
    region = torch.maximum(low, high)
    one = low.shape[-1] == 1  # one value per sequence

    def extreme(x, fn):
        return fn(x[:, 0]) if one and x.numel() else _row_nan_extreme(x, mask, fn)

    return {
        "clip_ratio/low_mean": trl_global_mean(low, mask),
        "clip_ratio/high_mean": trl_global_mean(high, mask),
        "clip_ratio/region_mean": trl_global_mean(region, mask),
        "clip_ratio/low_min": extreme(low, torch.min),
        "clip_ratio/high_max": extreme(high, torch.max),
    }


def _entropy_keep(entropy, mask, top_entropy_quantile):
    """TRL's top-entropy token mask (bool [B, T]), or None at quantile 1."""
    if not 0.0 <= top_entropy_quantile <= 1.0:
        raise ValueError(
            f"top_entropy_quantile: expected a number in [0, 1]; got {top_entropy_quantile!r}"
        )
    if top_entropy_quantile >= 1.0:
        return None
    if entropy is None:
        raise ValueError(
            "entropy: expected the per-token entropy [B, T] with top_entropy_quantile < 1"
        )
    threshold = grpo_math.entropy_threshold(entropy, mask, top_entropy_quantile)
    return grpo_math.entropy_mask(entropy, mask, threshold)


# ----------------------------------------------------------------------------- GMPO (TRL)


def gmpo_loss(
    logp,
    old_logp,
    advantages,
    mask,
    *,
    epsilon=0.4,
    epsilon_high=None,
    beta=0.0,
    ref_logp=None,
    entropy=None,
    top_entropy_quantile=1.0,
    gradient_accumulation_steps=1,
):
    """GMPO as TRL's `GMPOTrainer._compute_loss` (trl 1.16): advantages [B].

    l = logp − old (old None → logp.detach()); l~ = min(l, ε_high) where a > 0, max(l, −ε) where
    a ≤ 0; S_i = exp(Σ m' l~ / max(Σ m', 1)), m' = mask·entropy mask; L_i = −S_i·a_i +
    β·Σ m·k3 / max(Σ m, 1); loss = mean_i L_i / gradient_accumulation_steps. Like TRL it has no
    vLLM IS ratio, off-policy mask, delta or loss_type. ε_high None → ε (TRL's GRPOConfig)."""
    if epsilon < 0 or (epsilon_high is not None and epsilon_high < 0):
        raise ValueError(
            f"epsilon, epsilon_high: expected numbers >= 0; got {epsilon!r}, {epsilon_high!r}"
        )
    if beta != 0.0 and ref_logp is None:
        raise ValueError("ref_logp: expected the reference log-probs [B, T] with beta != 0")
    high = _gmpo_high(epsilon, epsilon_high)
    dtype = compute_dtype(logp, old_logp, ref_logp, advantages)
    lp, old, ref, a = cast(dtype, logp, old_logp, ref_logp, advantages)
    old = lp.detach() if old is None else old
    m = mask.to(dtype)
    keep = _entropy_keep(entropy, mask, top_entropy_quantile)
    seq_mask = m if keep is None else m * keep.to(dtype)
    lr = lp - old
    a_col = a.unsqueeze(1)
    sign = _trl_sign(a_col).to(dtype)
    coef = torch.exp(row_mean(sign_clipped_log_ratio(lr, sign, epsilon, high), seq_mask))
    per_seq = -coef * a
    metrics = {}
    if beta != 0.0:
        kl = grpo_math.k3(ref, lp, torch.ones_like(m))  # unmasked, as TRL logs it
        per_seq = per_seq + beta * row_mean(kl, m)
        metrics["kl"] = trl_global_mean(kl, m)
    loss = per_seq.sum() / max(per_seq.numel(), 1) / gradient_accumulation_steps
    if entropy is not None:
        metrics["entropy"] = trl_global_mean(entropy.to(dtype), m)
    low = ((lr < -epsilon) & (a_col < 0)).to(dtype)
    hi = ((lr > high) & (a_col > 0)).to(dtype)
    metrics.update(_trl_clip_metrics(low, hi, m))
    return loss, detached(metrics)


# ----------------------------------------------------------------------------- GSPO-token


def gspo_token_log_ratio(logp, old_logp, mask) -> torch.Tensor:
    """log s_it = logp − sg(logp) + sg(Σ m l / max(Σ m, 1)) [B, T]: the value of the sequence
    ratio's log, the gradient of logp_t."""
    seq = grpo_math.log_ratio(logp.detach(), old_logp, mask, Level.SEQUENCE)
    return logp - logp.detach() + seq


def gspo_token_loss(
    logp,
    old_logp,
    advantages,
    mask,
    *,
    loss_type="dapo",
    beta=0.0,
    epsilon_low=0.2,
    epsilon_high=0.2,
    ref_logp=None,
    max_completion_length=None,
    num_items_in_batch=None,
    vllm_is_ratio=None,
    entropy=None,
    sampling_logp=None,
    **options,
):
    """GSPO-token on TRL's clipped loss types (grpo, bnpo, dr_grpo, dapo, luspo): TRL's GRPO
    loss (`reference.grpo_loss`, same options: delta, clip_ratio_c, top_entropy_quantile,
    off_policy_mask_threshold, use_bias_correction_kl, entropy_coef, ...) with the per-token
    ratio s_it = exp(`gspo_token_log_ratio`) in place of π/π_old. Its value is TRL's
    sequence-level (GSPO) loss; its gradient puts s_i·∇logp_t on each token, so per-token
    weights (entropy mask, a [B, T] vLLM ratio) weight each token's own gradient."""
    opts = GRPOOptions.parse(
        loss_type, beta, epsilon_low, epsilon_high, "sequence", max_completion_length,
        **with_parsed_penalty(options),
    )  # fmt: skip
    if opts.objective != Objective.CLIPPED:
        raise ValueError(
            f"loss_type: GSPO-token needs a clipped loss type, one of 'grpo', 'bnpo', 'dr_grpo', "
            f"'dapo', 'luspo'; got {name_of(opts.loss_type)!r}"
        )
    if opts.needs_entropy and entropy is None:
        raise ValueError("entropy: expected the per-token entropy [B, T] with this option set")
    opts = dataclasses.replace(opts, level=Level.TOKEN)
    dtype = compute_dtype(logp, old_logp, ref_logp, advantages)
    lp, old, ref, a, ent, samp = cast(
        dtype, logp, old_logp, ref_logp, advantages, entropy, sampling_logp
    )
    old = lp.detach() if old is None else old
    # NB: token-level GRPO maths on old' = logp − log s_it sees log s_it as its log-ratio
    shifted_old = (lp - gspo_token_log_ratio(lp, old, mask)).detach()
    loss = reference.grpo(
        lp, shifted_old, ref, mask, a, num_items_in_batch, opts, vllm_is_ratio=vllm_is_ratio,
        entropy=ent, sampling_logps=old if samp is None else samp,
    )  # fmt: skip
    s = grpo_math.importance_ratio(lp.detach(), old, mask, Level.SEQUENCE)
    low, high = grpo_math.clip_indicators(s, a, opts)
    metrics = _trl_clip_metrics(low, high, mask.to(dtype))
    if opts.beta != 0.0 and ref is not None:  # TRL logs k3 unmasked (× s with bias correction)
        kl = grpo_math.k3(ref, lp.detach(), torch.ones_like(mask))
        kl = kl * s if opts.use_bias_correction_kl else kl
        metrics["kl"] = trl_global_mean(kl, mask.to(dtype))
    return loss, detached(metrics)
