"""The f-GRPO epilogue kernel (FDO maps onto it): loss and dL/dlogp from per-token log-probs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core.options import FGRPOOptions, Level, Reduction, Scale
from .epilogue_common import (
    Plan,
    contiguous,
    device_scalar,
    row_block,
    tl_group_center,
    tl_group_zscore,
    tl_load,
    tl_load_mask,
    tl_row_sums,
    tl_rows,
    tl_safe_inv,
    tl_store_row_grad,
    tl_tile,
)
from .tl_divergences import phi_constexprs, tl_phi


@triton.jit
def tl_group_is_weights(rewards, seq_old, positive, row_ok, n):
    """w_i = n·softmax_j(s_i·R_j − S_j)_i over the group, s_i = +1 where `positive` else −1;
    R, S float64 (the logits are shifted by their max in float64, exponentiated in fp32)."""
    z_pos = tl.where(row_ok, rewards - seq_old, -float("inf"))
    z_neg = tl.where(row_ok, -rewards - seq_old, -float("inf"))
    e_pos = tl.exp((z_pos - tl.max(z_pos, axis=0)).to(tl.float32))
    e_neg = tl.exp((z_neg - tl.max(z_neg, axis=0)).to(tl.float32))
    w_pos = e_pos / tl.sum(e_pos, axis=0)
    w_neg = e_neg / tl.sum(e_neg, axis=0)
    return n * tl.where(positive, w_pos, w_neg)


@triton.jit
def _fgrpo_epilogue_kernel(
    logp_ptr,
    ref_ptr,
    mask_ptr,
    adv_ptr,
    rewards_ptr,
    old_ptr,
    norm_ptr,
    sigma_ptr,
    ratio_ptr,
    dlogp_ptr,
    partial_ptr,
    B,
    T,
    ROWS,
    beta,
    eps,
    var_dof,
    PHI_POS: tl.constexpr,
    PHI_NEG: tl.constexpr,
    SEQUENCE_LEVEL: tl.constexpr,
    ROW_MEAN: tl.constexpr,
    HAS_ADVANTAGES: tl.constexpr,
    SCALE: tl.constexpr,
    HAS_IS_WEIGHTS: tl.constexpr,
    RATIO: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # Unit u (token or row i) with weight w_i = |a_i|·IS_i·norm costs w_i·φ_{a_i>0}(r_u), φ the
    # divergence whose twins PHI_POS / PHI_NEG are:
    #   token level:    r = β·m·(logp − ref),   dL/dlogp[i,t] = w_i·β·m·φ'(r[i,t])
    #   sequence level: r_i = β·Σ_t m·(logp − ref), dL/dlogp[i,t] = w_i·β·m·φ'(r_i)
    # a_i given, or (R_i − μ_g)/(σ + eps) with σ per group / whole batch / none (SCALE 0/1/2);
    # IS_i = G·softmax_j(s_i·R_j − S_j)_i, S_j = Σ_t m·old (detached). ROW_MEAN: norm/max(L_i,1).
    # RATIO 1 / 2: a rollout IS ratio ρ per row / per token multiplies each unit's cost.
    rows, row_ok, base = tl_rows(B, T, ROWS, BLOCK_G)
    NEED_SUMS: tl.constexpr = SEQUENCE_LEVEL or ROW_MEAN or HAS_IS_WEIGHTS
    seq = tl.zeros([BLOCK_G], dtype=tl.float64)
    length = tl.zeros([BLOCK_G], dtype=tl.float64)
    seq_old = tl.zeros([BLOCK_G], dtype=tl.float64)
    if NEED_SUMS:
        seq, length, seq_old = tl_row_sums(
            logp_ptr, ref_ptr, old_ptr, mask_ptr, base, row_ok, T, True, HAS_IS_WEIGHTS,
            BLOCK_G, BLOCK_T,
        )  # fmt: skip
    if HAS_ADVANTAGES and not HAS_IS_WEIGHTS:
        rewards = tl.zeros([BLOCK_G], dtype=tl.float64)
    else:
        rewards = tl.load(rewards_ptr + rows, mask=row_ok, other=0.0).to(tl.float64)
    if HAS_ADVANTAGES:
        a = tl.load(adv_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    elif SCALE == 0:
        _, _, a = tl_group_zscore(rewards, row_ok, ROWS, var_dof, eps)
    elif SCALE == 1:
        c, _ = tl_group_center(rewards, row_ok, ROWS, var_dof)
        a = c * tl_safe_inv(tl.load(sigma_ptr).to(tl.float64) + eps)
    else:
        a, _ = tl_group_center(rewards, row_ok, ROWS, var_dof)
    a = a.to(tl.float32)
    positive = a > 0
    weight = tl.abs(a) * tl.load(norm_ptr)
    if HAS_IS_WEIGHTS:
        is_w = tl_group_is_weights(rewards, seq_old, positive, row_ok, ROWS)
        weight = weight * is_w
    if RATIO == 1:
        weight = weight * tl.load(ratio_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    weight = tl.where(row_ok, weight, 0.0)

    if SEQUENCE_LEVEL:
        value, slope = tl_phi((beta * seq).to(tl.float32), positive, PHI_POS, PHI_NEG)
        tl.store(partial_ptr + tl.program_id(0), tl.sum(weight * value, axis=0))
        tl_store_row_grad(dlogp_ptr, mask_ptr, base, row_ok, weight * slope * beta, T, BLOCK_T)
    else:
        if ROW_MEAN:
            weight = weight / tl.maximum(length.to(tl.float32), 1.0)
        acc = tl.zeros([BLOCK_G, BLOCK_T], dtype=tl.float32)
        for t0 in range(0, T, BLOCK_T):
            offs, ok = tl_tile(base, row_ok, t0, T, BLOCK_T)
            m = tl_load_mask(mask_ptr, offs, ok)
            diff = tl.where(m, tl_load(logp_ptr, offs, ok) - tl_load(ref_ptr, offs, ok), 0.0)
            value, slope = tl_phi(beta * diff, positive[:, None], PHI_POS, PHI_NEG)
            if RATIO == 2:
                rho = tl_load(ratio_ptr, offs, ok)
                value *= rho
                slope *= rho
            acc += tl.where(m, weight[:, None] * value, 0.0)
            tl.store(dlogp_ptr + offs, tl.where(m, weight[:, None] * beta * slope, 0.0), mask=ok)
        tl.store(partial_ptr + tl.program_id(0), tl.sum(tl.sum(acc, axis=1), axis=0))


def _norm(mask: torch.Tensor, B: int, opts: FGRPOOptions) -> torch.Tensor:
    """The global factor of every unit: 1/max(Σ mask, 1) (token_mean), 1/B (seq_mean), 1."""
    if opts.reduction == Reduction.TOKEN_MEAN:
        return device_scalar(1.0, mask.device) / mask.sum(dtype=torch.float32).clamp(min=1.0)
    return device_scalar(1.0 / max(B, 1) if opts.reduction == Reduction.SEQ_MEAN else 1.0,
                         mask.device)  # fmt: skip


def fgrpo(
    logps, ref_logps, mask, advantages, rewards, old_logps, opts: FGRPOOptions, vllm_is_ratio=None
):
    """f-GRPO epilogue before the entropy bonus: (loss 0-d fp32, dL/dlogps [B, T] fp32), the
    semantics of `reference.fgrpo`. logps [B, T] fp32; ref_logps [B, T] any float; mask [B, T]
    0/1; advantages [B] or None with rewards [B] (normalised per group inside); old_logps
    [B, T] and rewards for opts.group_is_weights; vllm_is_ratio [B, T] (token level), [B, 1]
    or [B]."""
    B, T = logps.shape
    ratio = None if vllm_is_ratio is None else vllm_is_ratio.float().contiguous()
    per_token = ratio is not None and ratio.dim() == 2 and ratio.shape[1] != 1
    logps, ref_logps, mask = contiguous(logps), contiguous(ref_logps), contiguous(mask)
    grouped = advantages is None or opts.group_is_weights
    rows = opts.num_generations if grouped else row_block(B, T)
    sigma = None
    if advantages is None and opts.scale == Scale.BATCH:
        r = rewards.float()
        sigma = r.std(correction=int(opts.unbiased)) if B > 1 else r.new_zeros(())
        sigma = sigma.reshape(1)
    plan = Plan.of(B, T, rows, logps.device)
    _fgrpo_epilogue_kernel[plan.grid](
        logps,
        ref_logps,
        mask,
        contiguous(advantages),
        contiguous(rewards) if grouped else None,
        contiguous(old_logps) if opts.group_is_weights else None,
        _norm(mask, B, opts),
        sigma,
        ratio,
        *plan.group_args(rows, opts),
        **phi_constexprs(opts.divergence),
        SEQUENCE_LEVEL=opts.level == Level.SEQUENCE,
        ROW_MEAN=opts.level == Level.TOKEN and opts.reduction == Reduction.SEQ_MEAN,
        HAS_ADVANTAGES=advantages is not None,
        SCALE=int(opts.scale),
        HAS_IS_WEIGHTS=bool(opts.group_is_weights),
        RATIO=0 if ratio is None else 2 if per_token else 1,
        **plan.meta,
    )
    return plan.result()
