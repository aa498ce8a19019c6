"""The GIFT epilogue kernel: z-scored implicit rewards against z-scored rewards, per group."""

from __future__ import annotations

import triton
import triton.language as tl

from ...core.options import GIFTOptions
from .epilogue_common import (
    Plan,
    contiguous,
    tl_group_zscore,
    tl_row_sums,
    tl_rows,
    tl_safe_inv,
    tl_store_row_grad,
)


@triton.jit
def _gift_epilogue_kernel(
    logp_ptr,
    ref_ptr,
    mask_ptr,
    rewards_ptr,
    dlogp_ptr,
    partial_ptr,
    B,
    T,
    ROWS,
    beta,
    eps,
    var_dof,
    inv_batch,
    DETACH_STATS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # k_i = Σ_t m·(logp − ref); k̂ = c/D, c = k − μ_g, D = σ_g + eps; R̂ likewise (constant);
    # loss = Σ_i (R̂_i − β·k̂_i)² / B, g_i = dL/dk̂_i = −2β·(R̂_i − β·k̂_i) / B;
    # detached μ, σ:  dL/dk_j = g_j / D;
    # through them:   dL/dk_j = (g_j − ḡ)/D − (Σ_i g_i·c_i)/D² · c_j/(dof·σ)  (0 where σ = 0),
    #   with ḡ = 0: R̂ and k̂ are both centred, so Σ_i g_i = 0;
    # dL/dlogp[j,t] = dL/dk_j · m[j,t]. The group math runs in float64 (O(G) per program).
    rows, row_ok, base = tl_rows(B, T, ROWS, BLOCK_G)
    k, _, _ = tl_row_sums(
        logp_ptr, ref_ptr, ref_ptr, mask_ptr, base, row_ok, T, True, False, BLOCK_G, BLOCK_T
    )
    # NB: the through-σ slope cancels two O(1/D) terms down to O(eps/D²) whenever R̂ ∥ k̂ (always
    # at G = 2, where both z-scores are ±1/√2): in fp32 that loses ~σ/eps·2^-24 (4.6e-4 seen).
    rewards = tl.load(rewards_ptr + rows, mask=row_ok, other=0.0).to(tl.float64)
    _, _, r_hat = tl_group_zscore(rewards, row_ok, ROWS, var_dof, eps)
    c, sigma, k_hat = tl_group_zscore(k.to(tl.float64), row_ok, ROWS, var_dof, eps)
    resid = tl.where(row_ok, r_hat - beta * k_hat, 0.0)
    loss = tl.sum(resid * resid, axis=0) * inv_batch
    tl.store(partial_ptr + tl.program_id(0), loss.to(tl.float32))
    g = -2.0 * beta * inv_batch * resid
    inv_d = tl_safe_inv(sigma + eps)
    if DETACH_STATS:
        dk = g * inv_d
    else:
        through_sigma = tl.sum(g * c, axis=0) * inv_d * inv_d * c * tl_safe_inv(var_dof * sigma)
        dk = tl.where(row_ok, g * inv_d - through_sigma, 0.0)
    tl_store_row_grad(dlogp_ptr, mask_ptr, base, row_ok, dk.to(tl.float32), T, BLOCK_T)


def gift(logps, ref_logps, mask, rewards, opts: GIFTOptions):
    """GIFT epilogue: (loss 0-d fp32, dL/dlogps [B, T] fp32), the semantics of
    `reference.gift_loss`. logps [B, T] fp32; ref_logps [B, T] any float; mask [B, T] 0/1;
    rewards [B]; groups of opts.num_generations contiguous rows, one program each."""
    B, T = logps.shape
    rows = opts.num_generations
    plan = Plan.of(B, T, rows, logps.device)
    _gift_epilogue_kernel[plan.grid](
        contiguous(logps),
        contiguous(ref_logps),
        contiguous(mask),
        contiguous(rewards),
        *plan.group_args(rows, opts),
        1.0 / max(B, 1),
        DETACH_STATS=bool(opts.detach_stats),
        **plan.meta,
    )
    return plan.result()
