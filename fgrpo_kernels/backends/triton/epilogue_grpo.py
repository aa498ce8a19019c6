"""The GRPO-family epilogue kernel (TRL / Liger semantics): loss and dL/dlogp per token."""

from __future__ import annotations

import triton
import triton.language as tl

from ...core import grpo_math
from ...core.options import GRPOOptions, Level
from .epilogue_common import (
    Plan,
    contiguous,
    row_block,
    tl_load,
    tl_load_mask,
    tl_row_sums,
    tl_rows,
    tl_tile,
)
from .tl_math import tl_sat_exp


@triton.jit
def tl_policy(
    OBJECTIVE: tl.constexpr, log_ratio, a, lp, clip_low, clip_high, delta, clip_c, tau_pos, tau_neg
):
    """(pt, ∂pt/∂logp) of the loss type's policy term, w = e^log_ratio (clamped at 80):
    0 clipped: −min(min(w, δ)·a, clamp(w, lo, hi)·a), at most −a·c for a < 0; its slope −a·w
    on the branch taken where that branch is not clamped, 0 elsewhere;
    1 cispo: −min(w, hi)·a·logp (coefficient detached; hi = ε_high), slope −min(w, hi)·a;
    2 sapo: −a·(4/τ)·σ(τ(w − 1)), slope −4a·σ(1 − σ)·w; 3 vespo: −a·logp, slope −a."""
    w = tl_sat_exp(log_ratio)
    if OBJECTIVE == 0:
        unclipped = tl.minimum(w, delta)
        clipped = tl.minimum(tl.maximum(w, clip_low), clip_high)
        take_unclipped = unclipped * a <= clipped * a
        live = tl.where(take_unclipped, w <= delta, (w >= clip_low) & (w <= clip_high))
        chosen = tl.where(take_unclipped, unclipped, clipped)
        capped = (a < 0) & (chosen > clip_c)  # −a·chosen > −a·c
        slope = tl.where(live & ~capped, -a * w, 0.0)
        return -tl.where(capped, clip_c, chosen) * a, slope
    elif OBJECTIVE == 1:
        coef = tl.minimum(w, clip_high)
        return -coef * a * lp, -coef * a
    elif OBJECTIVE == 2:
        tau = tl.where(a > 0, tau_pos, tau_neg)
        s = tl.sigmoid(tau * (w - 1.0))
        return -a * (4.0 / tau) * s, -4.0 * a * s * (1.0 - s) * w
    else:
        return -a * lp, -a + 0.0 * lp


@triton.jit
def tl_k3(ref, lp, m):
    """(k3, ∂k3/∂logp) = (e^d − d − 1, 1 − e^d), d = ref − logp (0 where masked)."""
    d = tl.where(m, ref - lp, 0.0)
    e = tl_sat_exp(d)
    return e - d - 1.0, 1.0 - e


@triton.jit
def _grpo_epilogue_kernel(
    logp_ptr,
    old_ptr,
    ref_ptr,
    mask_ptr,
    adv_ptr,
    scale_ptr,
    row_w_ptr,
    tok_w_ptr,
    dlogp_ptr,
    partial_ptr,
    B,
    T,
    ROWS,
    beta,
    clip_low,
    clip_high,
    delta,
    clip_c,
    tau_pos,
    tau_neg,
    OBJECTIVE: tl.constexpr,
    SEQUENCE_LEVEL: tl.constexpr,
    HAS_OLD: tl.constexpr,
    HAS_KL: tl.constexpr,
    BIAS_CORRECTION: tl.constexpr,
    HAS_ROW_WEIGHT: tl.constexpr,
    HAS_TOKEN_WEIGHT: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # pt[i,t] = P(lr)·u_i·v[i,t] + β·k3[i,t]·(w if BIAS_CORRECTION), P the loss type's policy
    #   term (tl_policy), u / v the detached row / token weights, k3 = e^d − d − 1 with
    #   d = ref − logp, lr = logp − old per token or Σ_t m·(logp − old)/max(L_i, 1) per row
    #   (GSPO); w = e^lr. loss = Σ m·n_i·pt, n_i the loss type's row scale.
    # dL/dlogp[i,t] = n_i·m·(∂P·u_i·v + β·(∂k3·w + k3·∂w)); a row-level lr reaches each of the
    #   row's tokens through m/L_i: n_i·m/L_i·(P'(lr_i)·u_i·Σ_s m·v + β·w_i·Σ_s m·k3).
    #   old None → old = logp (ratio 1, slope kept).
    rows, row_ok, base = tl_rows(B, T, ROWS, BLOCK_G)
    a = tl.load(adv_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    n = tl.where(row_ok, tl.load(scale_ptr + rows, mask=row_ok, other=0.0), 0.0)
    u = tl.full([BLOCK_G], 1.0, dtype=tl.float32)
    if HAS_ROW_WEIGHT:
        u = tl.load(row_w_ptr + rows, mask=row_ok, other=0.0)
    if SEQUENCE_LEVEL:
        s_lr, length, carry = tl_row_sums(
            logp_ptr, old_ptr, tok_w_ptr, mask_ptr, base, row_ok, T, HAS_OLD, HAS_TOKEN_WEIGHT,
            BLOCK_G, BLOCK_T,
        )  # fmt: skip
        if not HAS_OLD:
            s_lr = tl.zeros([BLOCK_G], dtype=tl.float64)
        s_kl = tl.zeros([BLOCK_G], dtype=tl.float32)
        if HAS_KL and BIAS_CORRECTION:
            for t0 in range(0, T, BLOCK_T):
                offs, ok = tl_tile(base, row_ok, t0, T, BLOCK_T)
                m = tl_load_mask(mask_ptr, offs, ok)
                kl, _ = tl_k3(tl_load(ref_ptr, offs, ok), tl_load(logp_ptr, offs, ok), m)
                s_kl += tl.sum(tl.where(m, kl, 0.0), axis=1)
        if not HAS_TOKEN_WEIGHT:
            carry = length
        carry = carry.to(tl.float32)
        inv_len = 1.0 / tl.maximum(length, 1.0).to(tl.float32)
        lr_row = (s_lr / tl.maximum(length, 1.0)).to(tl.float32)
        zero = tl.zeros([BLOCK_G], dtype=tl.float32)
        row_pt, row_slope = tl_policy(
            OBJECTIVE, lr_row, a, zero, clip_low, clip_high, delta, clip_c, tau_pos, tau_neg
        )
        w_row = tl_sat_exp(lr_row)
        row_grad = u * row_slope * carry * inv_len
        if HAS_KL and BIAS_CORRECTION:
            row_grad += beta * s_kl * w_row * inv_len
    acc = tl.zeros([BLOCK_G, BLOCK_T], dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        offs, ok = tl_tile(base, row_ok, t0, T, BLOCK_T)
        m = tl_load_mask(mask_ptr, offs, ok)
        lp = tl_load(logp_ptr, offs, ok)
        weight = tl.zeros([BLOCK_G, BLOCK_T], dtype=tl.float32) + u[:, None]
        if HAS_TOKEN_WEIGHT:
            weight *= tl_load(tok_w_ptr, offs, ok)
        if SEQUENCE_LEVEL:
            value = weight * row_pt[:, None]
            grad = tl.zeros([BLOCK_G, BLOCK_T], dtype=tl.float32) + row_grad[:, None]
            w_kl = tl.zeros([BLOCK_G, BLOCK_T], dtype=tl.float32) + w_row[:, None]
            dw_kl = tl.zeros([BLOCK_G, BLOCK_T], dtype=tl.float32)
        else:
            lr = tl.zeros([BLOCK_G, BLOCK_T], dtype=tl.float32)
            if HAS_OLD:
                lr = tl.where(m, lp - tl_load(old_ptr, offs, ok), 0.0)
            pt, slope = tl_policy(
                OBJECTIVE, lr, a[:, None], lp, clip_low, clip_high, delta, clip_c, tau_pos, tau_neg
            )
            value = weight * pt
            grad = weight * slope
            w_kl = tl_sat_exp(lr)
            dw_kl = w_kl
        if HAS_KL:
            kl, dkl = tl_k3(tl_load(ref_ptr, offs, ok), lp, m)
            if BIAS_CORRECTION:
                value += beta * kl * w_kl
                grad += beta * (dkl * w_kl + kl * dw_kl)
            else:
                value += beta * kl
                grad += beta * dkl
        acc += tl.where(m, n[:, None] * value, 0.0)
        tl.store(dlogp_ptr + offs, tl.where(m, n[:, None] * grad, 0.0), mask=ok)
    tl.store(partial_ptr + tl.program_id(0), tl.sum(tl.sum(acc, axis=1), axis=0))


def clip_bounds(opts: GRPOOptions) -> tuple[float, float]:
    """(lo, hi) of the ratio: [1 − ε_low, 1 + ε_high] for the clipped family, hi = ε_high (the
    raw cap) for cispo."""
    if grpo_math.POLICY_TERMS[opts.objective].raw_cap:
        return 0.0, opts.epsilon_high
    return 1.0 - opts.epsilon_low, 1.0 + opts.epsilon_high


def grpo(
    logps, old_logps, ref_logps, mask, advantages, opts: GRPOOptions, norms, vllm_is_ratio=None,
    entropy=None, sampling_logps=None,
):  # fmt: skip
    """GRPO-family epilogue before the entropy bonus: (loss 0-d fp32, dL/dlogps [B, T] fp32),
    the semantics of `reference.grpo`. logps [B, T] fp32; old/ref/sampling [B, T] any float or
    None (old → logps: ratio 1; ref → no KL); mask [B, T] 0/1; advantages [B]; norms a
    `grpo_math.Normalisers`; vllm_is_ratio [B, T], [B, 1] or [B]; entropy [B, T] for the
    entropy mask."""
    B, T = logps.shape
    logps, mask = contiguous(logps), contiguous(mask)
    has_kl = ref_logps is not None and opts.beta != 0.0
    # NB: the detached weights in float64: VESPO's φ exponentiates a sum of T log-ratios.
    lp64 = logps.double()
    old64 = None if old_logps is None else old_logps.double()
    row_w = grpo_math.row_weight(
        lp64, old64, mask, advantages.double(), opts, vllm_is_ratio, sampling_logps
    )
    tok_w = grpo_math.token_weight(mask, opts, vllm_is_ratio, entropy, norms.entropy_threshold)
    lo, hi = clip_bounds(opts)
    inf = float("inf")
    rows = row_block(B, T)
    plan = Plan.of(B, T, rows, logps.device)
    _grpo_epilogue_kernel[plan.grid](
        logps,
        contiguous(old_logps),
        contiguous(ref_logps) if has_kl else None,
        mask,
        contiguous(advantages),
        norms.row_scale.float().contiguous(),
        None if row_w is None else row_w.float().reshape(B).contiguous(),
        None if tok_w is None else tok_w.float().contiguous(),
        plan.dlogp,
        plan.partial,
        B,
        T,
        rows,
        float(opts.beta),
        lo,
        hi,
        inf if opts.delta is None else float(opts.delta),
        inf if opts.clip_ratio_c is None else float(opts.clip_ratio_c),
        float(opts.sapo_temperature_pos),
        float(opts.sapo_temperature_neg),
        OBJECTIVE=grpo_math.POLICY_TERMS[opts.objective].triton_id,
        SEQUENCE_LEVEL=opts.level == Level.SEQUENCE,
        HAS_OLD=old_logps is not None,
        HAS_KL=has_kl,
        BIAS_CORRECTION=opts.use_bias_correction_kl,
        HAS_ROW_WEIGHT=row_w is not None,
        HAS_TOKEN_WEIGHT=tok_w is not None,
        **plan.meta,
    )
    return plan.result()
