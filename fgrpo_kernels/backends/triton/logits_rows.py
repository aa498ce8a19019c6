"""Single pass of the fused linear log-prob on the Triton path: one chunk of rows whose logits
sit in a bounded fp32 buffer between a cuBLAS product and two row kernels.

    logits_fwd: buffer = h W^T (cuBLAS, fp32 out) → `_logits_stats_kernel`: lse, logp, entropy
    logits_bwd: `_logits_grad_kernel`: dlogits (in place for fp32, into an operand-dtype buffer
                otherwise) → cuBLAS dh = dz W, dW (+)= dz^T h, db (+)= Σ_n dz (fp32)

Three GEMM-sized passes over the chunk where the two-pass path takes four. The row kernels read
the raw product and apply z = (x + b)·inv_t on the fly.

NB: fp16 dlogits are stored scaled by a power of two 2^k (`logprob_bwd.strip_scale`: fp16's
subnormals would swallow a mean-style gradient); the products are unscaled by 2^-k, exactly.
bf16 shares fp32's exponent range and is stored unscaled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core.options import LogProbOptions
from .. import fold_into
from ..phases import phase
from . import configs
from .gemm import fp32_precision, gemm, has_out_dtype_mm
from .launch import check_dtypes, interpreted
from .logprob_bwd import strip_scale
from .tl_utils import tl_block_start, tl_dlogits, tl_local_index, tl_online_fold


@triton.jit
def tl_row_tile(x_ptr, b_ptr, n0, v0, M, V, stride_x, inv_t, HAS_BIAS: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):  # fmt: skip
    """(z, ok): z = (x + b)·inv_t of the buffer tile at (n0, v0) [BLOCK_N, BLOCK_V], −inf in
    the columns past V (rows past M read 0: finite, and never stored); ok = inside [M, V]."""
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_V)
    in_v = (cols < (V - v0).to(tl.int32))[None, :]
    ok = (rows < (M - n0).to(tl.int32))[:, None] & in_v
    x_ptrs = x_ptr + n0 * stride_x + v0 + (rows[:, None] * stride_x + cols[None, :])
    x = tl.load(x_ptrs, mask=ok, other=0.0)
    if HAS_BIAS:
        x += tl.load(b_ptr + v0 + cols, mask=cols < V - v0, other=0.0).to(tl.float32)[None, :]
    return tl.where(in_v, x * inv_t, float("-inf")), ok


@triton.jit
def _logits_stats_kernel(
    x_ptr,
    b_ptr,
    y_ptr,
    lse_ptr,
    logp_ptr,
    ent_ptr,
    M,
    V,
    stride_x,
    inv_t,
    ignore_index,
    HAS_BIAS: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # For rows n0 + i of z = (x + b)·inv_t (x = the buffered h W^T), over vocab tiles:
    #   m = max_v z,  s = Σ_v e^(z−m),  t = Σ_v e^(z−m)(z−m),  z_y = z[y]
    #   lse = m + log s,  logp = z_y − lse,  H = log s − t/s   (logp, H: 0 on ignored rows)
    n0 = tl_block_start(tl.program_id(0), BLOCK_N)
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_V)
    mask_n = rows < (M - n0).to(tl.int32)
    y = tl.load(y_ptr + n0 + rows, mask=mask_n, other=ignore_index)
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    t = tl.zeros((BLOCK_N,), tl.float32)
    z_y = tl.zeros((BLOCK_N,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        z, _ = tl_row_tile(x_ptr, b_ptr, n0, v0, M, V, stride_x, inv_t, HAS_BIAS, BLOCK_N, BLOCK_V)
        hit = cols[None, :] == tl_local_index(y, v0, BLOCK_V)[:, None]
        m, s, t, z_y = tl_online_fold(z, hit, m, s, t, z_y, HAS_ENTROPY)
    valid = y != ignore_index
    log_s = tl.log(s)
    lse = m + log_s
    tl.store(lse_ptr + n0 + rows, lse, mask=mask_n)
    tl.store(logp_ptr + n0 + rows, tl.where(valid, z_y - lse, 0.0), mask=mask_n)
    if HAS_ENTROPY:
        tl.store(ent_ptr + n0 + rows, tl.where(valid, log_s - t / s, 0.0), mask=mask_n)


@triton.jit
def _logits_grad_kernel(
    x_ptr,
    b_ptr,
    y_ptr,
    lse_ptr,
    ent_ptr,
    g_ptr,
    g_ent_ptr,
    scale_ptr,
    dz_ptr,
    M,
    V,
    stride_x,
    stride_dz,
    n_vtiles,
    inv_t,
    ignore_index,
    HAS_BIAS: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # dz = (g·(onehot − p) − g_H·p·(z − lse + H)) / τ on the tile (n0, v0) of the buffer, times
    # the power of two *scale_ptr, written to dz (the buffer itself when it is fp32: every
    # element is read and written by the same program); ignored rows are exactly 0.
    pid = tl.program_id(0)
    n0 = tl_block_start(pid // n_vtiles, BLOCK_N)
    v0 = tl_block_start(pid % n_vtiles, BLOCK_V)
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_V)
    z, ok = tl_row_tile(x_ptr, b_ptr, n0, v0, M, V, stride_x, inv_t, HAS_BIAS, BLOCK_N, BLOCK_V)
    dz = tl_dlogits(z, n0, v0, M, y_ptr, lse_ptr, g_ptr, ent_ptr, g_ent_ptr, scale_ptr, inv_t,
                    ignore_index, HAS_GRAD_ENTROPY, BLOCK_N, BLOCK_V)  # fmt: skip
    dz_ptrs = dz_ptr + n0 * stride_dz + v0 + (rows[:, None] * stride_dz + cols[None, :])
    tl.store(dz_ptrs, dz.to(dz_ptr.dtype.element_ty), mask=ok)


def unsupported(hidden: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why this backend cannot run a single pass on these operands (None: it can)."""
    if hidden.dtype != weight.dtype:
        return (f"hidden {hidden.dtype} and weight {weight.dtype} differ (cuBLAS multiplies one "
                "dtype; the two-pass kernels convert the weight tile by tile)")  # fmt: skip
    if hidden.is_cuda and hidden.dtype in configs.LOWP and not has_out_dtype_mm(hidden.device):
        return "this torch has no fp32-output cuBLAS product for bf16/fp16 operands"
    return None


def bytes_per_row(hidden: torch.Tensor, V: int) -> int:
    """Buffer bytes per chunk row: the fp32 logits, plus the dlogits in the operand dtype."""
    return V * (4 + (hidden.element_size() if hidden.dtype in configs.LOWP else 0))


def logits_buffer(rows: int, V: int, hidden: torch.Tensor) -> torch.Tensor:
    """The fp32 logits buffer for `rows` rows (uninitialised)."""
    return torch.empty(rows, V, dtype=torch.float32, device=hidden.device)


def _meta(kernel) -> tuple[configs.RowConfig, dict]:
    cfg = configs.row_config(interpreted(kernel))
    return cfg, {"BLOCK_N": cfg.block_n, "BLOCK_V": cfg.block_v, "num_warps": cfg.num_warps}


def logits_fwd(hidden, weight, targets, bias, opts: LogProbOptions, return_entropy: bool, logits):
    """One chunk of the single pass: (logp [M], lse [M], entropy [M] | None) fp32 of hidden
    [M, H], leaving h W^T in `logits` [M, V] fp32 for `logits_bwd`."""
    check_dtypes(hidden, weight, bias)
    M, V = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    lse = torch.empty(M, dtype=torch.float32, device=dev)
    logp = torch.empty_like(lse)
    entropy = torch.empty_like(lse) if return_entropy else None
    if M == 0:
        return logp, lse, entropy
    with phase("logits_gemm"), fp32_precision(dev, hidden.dtype, opts.fast_fp32):
        gemm(logits, hidden, weight.T, accumulate=False)
    cfg, meta = _meta(_logits_stats_kernel)
    with phase("stats_kernel"):
        _logits_stats_kernel[(triton.cdiv(M, cfg.block_n),)](
            logits, bias, targets, lse, logp, entropy, M, V, logits.stride(0),
            1.0 / opts.temperature, opts.ignore_index,
            HAS_BIAS=bias is not None, HAS_ENTROPY=return_entropy, **meta,
        )  # fmt: skip
    return logp, lse, entropy


def logits_bwd(logits, hidden, weight, targets, bias, lse, entropy, grad_logp, grad_entropy,
               opts: LogProbOptions, dh, dw, db, accumulate: bool, fold=None):  # fmt: skip
    """`logits` (left by `logits_fwd`) → dlogits; dh [M, H] = dz W, dw [V, H] (+)= dz^T h,
    db [V] (+)= Σ_n dz, all fp32 (None: not wanted; `accumulate` False overwrites dw and db);
    `fold` (dw_src, db_src, alpha): dw, db also take alpha times these (`backends.fold_into`)."""
    accumulate = fold_into(dw, db, fold, accumulate)
    M, V = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    if M == 0:
        for t in (dw, db):
            if t is not None and not accumulate:
                t.zero_()
        return
    inv_t = 1.0 / opts.temperature
    valid = targets != opts.ignore_index
    g = torch.zeros(M, device=dev) if grad_logp is None else grad_logp.contiguous()
    g_ent = None if grad_entropy is None else grad_entropy.contiguous()
    lowp = hidden.dtype in configs.LOWP
    dz = torch.empty(M, V, dtype=hidden.dtype, device=dev) if lowp else logits
    scale = inv_scale = torch.ones((), device=dev)
    alpha = 1.0
    if hidden.dtype == torch.float16:
        scale, inv_scale = strip_scale(valid, g, g_ent, inv_t)
        alpha = float(inv_scale)  # NB: one host sync per fp16 chunk: addmm takes alpha on host
    cfg, meta = _meta(_logits_grad_kernel)
    n_vtiles = triton.cdiv(V, cfg.block_v)
    with phase("grad_kernel"):
        _logits_grad_kernel[(triton.cdiv(M, cfg.block_n) * n_vtiles,)](
            logits, bias, targets, lse, entropy if g_ent is not None else None, g, g_ent, scale,
            dz, M, V, logits.stride(0), dz.stride(0), n_vtiles, inv_t, opts.ignore_index,
            HAS_BIAS=bias is not None, HAS_GRAD_ENTROPY=g_ent is not None, **meta,
        )  # fmt: skip
    with fp32_precision(dev, hidden.dtype, opts.fast_fp32):
        if dh is not None:
            with phase("dh_gemm"):
                gemm(dh, dz, weight, accumulate=False, alpha=alpha)
        if dw is not None:
            with phase("dw_gemm"):
                # NB: ignored rows masked to 0, not just met by dz's zero rows: NaN·0 poisons dW
                h = torch.where(valid[:, None], hidden, hidden.new_zeros(()))
                gemm(dw, dz.T, h, accumulate=accumulate, alpha=alpha)
    if db is not None:
        with phase("bias"):
            part = dz.sum(0, dtype=torch.float32).mul_(inv_scale)
            if accumulate:
                db += part
            else:
                db.copy_(part)
