"""The GRPO-family epilogue kernel (TRL / Liger semantics): loss and dL/dlogp per token."""

from __future__ import annotations

import triton
import triton.language as tl

from .. import grpo_math
from ..options import GRPOOptions, Level
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
def tl_clipped_surrogate(log_ratio, a, clip_low, clip_high):
    """pt = −min(c1·a, clamp(c1, lo, hi)·a), c1 = e^log_ratio (clamped at 80), and dpt/dlog_ratio:
    −a·c1, zero where the clipped branch is taken (a > 0, c1 > hi or a < 0, c1 < lo)."""
    c1 = tl_sat_exp(log_ratio)
    c2 = tl.minimum(tl.maximum(c1, clip_low), clip_high)
    clipped = ((a > 0) & (c1 > clip_high)) | ((a < 0) & (c1 < clip_low))
    return -tl.minimum(c1 * a, c2 * a), tl.where(clipped, 0.0, -a * c1)


@triton.jit
def _grpo_epilogue_kernel(
    logp_ptr,
    old_ptr,
    ref_ptr,
    mask_ptr,
    adv_ptr,
    scale_ptr,
    dlogp_ptr,
    partial_ptr,
    B,
    T,
    ROWS,
    beta,
    clip_low,
    clip_high,
    SEQUENCE_LEVEL: tl.constexpr,
    HAS_OLD: tl.constexpr,
    HAS_KL: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # pt[i,t] = −min(c1·a_i, clip(c1, 1−ε_low, 1+ε_high)·a_i) + β·(e^d − d − 1), d = ref − logp,
    #   c1 = exp(logp − old) per token, or exp(Σ_t m·(logp − old) / max(L_i, 1)) per row (GSPO);
    # loss = Σ m·n_i·pt with n_i the loss type's row scale (grpo_math.row_scale);
    # dL/dlogp[i,t] = n_i·m·(dpt/dlog_ratio + β·(1 − e^d)): the GSPO row slope reaches each of
    #   its L_i tokens through m/L_i, times the L_i tokens that carry it. old None → old = logp.
    rows, row_ok, base = tl_rows(B, T, ROWS, BLOCK_G)
    a = tl.load(adv_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    n = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
    if SEQUENCE_LEVEL:
        seq, length, _ = tl_row_sums(
            logp_ptr, old_ptr, old_ptr, mask_ptr, base, row_ok, T, HAS_OLD, False, BLOCK_G, BLOCK_T
        )
        if not HAS_OLD:
            seq = tl.zeros([BLOCK_G], dtype=tl.float64)
        log_ratio = (seq / tl.maximum(length, 1.0)).to(tl.float32)
        row_pt, row_slope = tl_clipped_surrogate(log_ratio, a, clip_low, clip_high)
    n = tl.where(row_ok, n, 0.0)
    acc = tl.zeros([BLOCK_G, BLOCK_T], dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        offs, ok = tl_tile(base, row_ok, t0, T, BLOCK_T)
        m = tl_load_mask(mask_ptr, offs, ok)
        lp = tl_load(logp_ptr, offs, ok)
        if SEQUENCE_LEVEL:
            pt = tl.zeros([BLOCK_G, BLOCK_T], dtype=tl.float32) + row_pt[:, None]
            slope = tl.zeros([BLOCK_G, BLOCK_T], dtype=tl.float32) + row_slope[:, None]
        else:
            log_ratio = tl.zeros([BLOCK_G, BLOCK_T], dtype=tl.float32)
            if HAS_OLD:
                log_ratio = tl.where(m, lp - tl_load(old_ptr, offs, ok), 0.0)
            pt, slope = tl_clipped_surrogate(log_ratio, a[:, None], clip_low, clip_high)
        if HAS_KL:
            d = tl.where(m, tl_load(ref_ptr, offs, ok) - lp, 0.0)
            e = tl_sat_exp(d)
            pt += beta * (e - d - 1.0)
            slope += beta * (1.0 - e)
        acc += tl.where(m, n[:, None] * pt, 0.0)
        tl.store(dlogp_ptr + offs, tl.where(m, n[:, None] * slope, 0.0), mask=ok)
    tl.store(partial_ptr + tl.program_id(0), tl.sum(tl.sum(acc, axis=1), axis=0))


def grpo(logps, old_logps, ref_logps, mask, advantages, num_items_in_batch, opts: GRPOOptions):
    """GRPO-family epilogue: (loss 0-d fp32, dL/dlogps [B, T] fp32), the semantics of
    `reference.grpo_loss`. logps [B, T] fp32; old/ref [B, T] any float or None (→ logps: ratio
    1, no KL); mask [B, T] 0/1; advantages [B]; num_items_in_batch int, tensor or None."""
    B, T = logps.shape
    logps, mask = contiguous(logps), contiguous(mask)
    has_kl = ref_logps is not None and opts.beta != 0.0
    rows = row_block(B, T)
    plan = Plan.of(B, T, rows, logps.device)
    _grpo_epilogue_kernel[plan.grid](
        logps,
        contiguous(old_logps),
        contiguous(ref_logps) if has_kl else None,
        mask,
        contiguous(advantages),
        grpo_math.row_scale(mask, opts.loss_type, opts.max_completion_length, num_items_in_batch),
        plan.dlogp,
        plan.partial,
        B,
        T,
        rows,
        float(opts.beta),
        1.0 - opts.epsilon_low,
        1.0 + opts.epsilon_high,
        SEQUENCE_LEVEL=opts.level == Level.SEQUENCE,
        HAS_OLD=old_logps is not None,
        HAS_KL=has_kl,
        **plan.meta,
    )
    return plan.result()
