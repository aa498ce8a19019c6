"""Backward of the fused linear log-prob: dlogits per vocab wave, then vendor GEMMs.

A fused kernel would need a [BLOCK_N, H] (or [BLOCK_V, H]) accumulator per program, which does
not fit at H = 4096, or float atomics. Instead each wave of Vw vocab columns gets its dlogits
strip [N, Vw] from `_logprob_bwd_kernel` (logits recomputed from the saved LSE), and then
dH += strip @ W[wave], dW[wave] = strip^T @ hidden, db[wave] = Σ_n strip. No atomics, so the
same inputs give bitwise the same gradients; extra memory ≤ max(N·H, SCRATCH_FLOOR) elements.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import triton
import triton.language as tl

from ..options import LogProbOptions
from . import configs
from .launch import check_dtypes, dot_flags, interpreted
from .tl_math import tl_expm1
from .tl_utils import tl_block_start, tl_local_index, tl_logits_tile


@triton.jit
def _logprob_bwd_kernel(
    h_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    lse_ptr,
    ent_ptr,
    g_ptr,
    g_ent_ptr,
    dz_ptr,
    N,
    V,
    H,
    stride_hn,
    stride_wv,
    stride_dz,
    v_begin,
    v_end,
    n_vtiles,
    inv_t,
    ignore_index,
    HAS_BIAS: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # For L = Σ_n g_n·logp_n + g_H,n·H_n and z = (h W^T + b)/τ, p = e^(z − lse):
    #   ∂logp/∂z_v = 1[v = y] − p_v,   ∂H/∂z_v = −p_v·(z_v − lse + H)
    #   dlogits = (g·(onehot − p) − g_H·p·(z − lse + H)) / τ
    # written to the strip dz[n, v − v_begin] for v in [v_begin, v_end); g, g_H are zeroed on
    # rows whose target is ignore_index.
    pid = tl.program_id(0)
    n0 = tl_block_start(pid // n_vtiles, BLOCK_N)
    v0 = v_begin + tl_block_start(pid % n_vtiles, BLOCK_V)
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_V)
    mask_n = rows < (N - n0).to(tl.int32)
    y = tl.load(y_ptr + n0 + rows, mask=mask_n, other=ignore_index)
    valid = mask_n & (y != ignore_index)
    g = tl.where(valid, tl.load(g_ptr + n0 + rows, mask=mask_n, other=0.0).to(tl.float32), 0.0)
    lse = tl.load(lse_ptr + n0 + rows, mask=mask_n, other=0.0)
    z = tl_logits_tile(
        h_ptr, w_ptr, b_ptr, n0, v0, N, V, H, stride_hn, stride_wv, inv_t,
        HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_K, UPCAST_DOT, DOT_PRECISION,
    )  # fmt: skip
    u = z - lse[:, None]
    p = tl.exp(u)
    hit = cols[None, :] == tl_local_index(y, v0, BLOCK_V)[:, None]
    # NB: the target's g·(1 − p_y) as −g·expm1(u_y): a near-certain target keeps its precision.
    dz = -g[:, None] * tl.where(hit, tl_expm1(u), p)
    if HAS_GRAD_ENTROPY:
        g_ent = tl.load(g_ent_ptr + n0 + rows, mask=mask_n, other=0.0).to(tl.float32)
        g_ent = tl.where(valid, g_ent, 0.0)
        ent = tl.load(ent_ptr + n0 + rows, mask=mask_n, other=0.0)
        dz -= g_ent[:, None] * p * tl.where(p > 0.0, u + ent[:, None], 0.0)  # u = −inf: p = 0
    dz_ptrs = dz_ptr + n0 * stride_dz + (v0 - v_begin) + (rows[:, None] * stride_dz + cols[None, :])
    mask = mask_n[:, None] & (cols < (v_end - v0).to(tl.int32))[None, :]
    tl.store(dz_ptrs, (dz * inv_t).to(dz_ptr.dtype.element_ty), mask=mask)


@contextmanager
def _fp32_matmul(device: torch.device, fast_fp32: bool):
    """cuBLAS fp32 GEMMs in full IEEE fp32 (TF32 only with fast_fp32), whatever the global flag."""
    if device.type != "cuda":
        yield
        return
    flags = torch.backends.cuda.matmul
    saved = flags.fp32_precision
    flags.fp32_precision = "tf32" if fast_fp32 else "ieee"
    try:
        yield
    finally:
        flags.fp32_precision = saved


@functools.cache
def _has_out_dtype_mm(device: torch.device) -> bool:
    """Whether torch.mm/addmm take out_dtype=float32 for bf16 operands here (recent torch, CUDA)."""
    a = torch.zeros(16, 16, dtype=torch.bfloat16, device=device)
    try:
        torch.addmm(torch.zeros(16, 16, device=device), a, a, torch.float32)
        return True
    except (TypeError, RuntimeError):
        return False


def _gemm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """out (+)= a @ b, products accumulated in fp32; a and b share a dtype."""
    if a.dtype == out.dtype:
        if accumulate:
            torch.addmm(out, a, b, out=out)
        else:
            torch.mm(a, b, out=out)
    elif a.is_cuda and out.dtype == torch.float32 and _has_out_dtype_mm(a.device):
        # bf16/fp16 operands straight into an fp32 output (cuBLAS's out_dtype overloads)
        if accumulate:
            torch.addmm(out, a, b, torch.float32, out=out)
        else:
            torch.mm(a, b, torch.float32, out=out)
    else:
        # CPU (interpreter) or older-torch low-precision operands, or fp32 operands into a
        # bf16/fp16 output: exact upcast, fp32 products, one rounding at the end
        prod = torch.mm(a.float(), b.float())
        if accumulate:
            out.add_(prod)
        else:
            out.copy_(prod)


def logprob_bwd(hidden, weight, targets, bias, lse, entropy, grad_logp, grad_entropy,
                opts: LogProbOptions, needs: tuple[bool, bool, bool]):  # fmt: skip
    """Gradients (dhidden, dweight, dbias) of Σ g·logp + Σ g_H·entropy; None where not needed.

    hidden [N, H], weight [V, H], targets [N], bias [V] | None, lse/entropy/grads [N]; each
    gradient has its input's dtype. dH or dW work is skipped entirely when not needed.
    """
    need_h, need_w, need_b = needs[0], needs[1], needs[2] and bias is not None
    check_dtypes(hidden, weight, bias)
    if not (need_h or need_w or need_b):
        return None, None, None
    hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.contiguous()
    bias = None if bias is None else bias.contiguous()
    N, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    dh = torch.zeros(N, H, dtype=torch.float32, device=dev) if need_h else None
    alloc = torch.empty if N else torch.zeros  # every wave writes its rows of dW
    dw = alloc(V, H, dtype=weight.dtype, device=dev) if need_w else None
    db = torch.zeros(V, dtype=torch.float32, device=dev) if need_b else None
    if N > 0:
        g = torch.zeros(N, device=dev) if grad_logp is None else grad_logp.contiguous()
        has_g_ent = grad_entropy is not None
        g_ent = grad_entropy.contiguous() if has_g_ent else None
        ent = entropy if has_g_ent else None
        upcast, dot_precision = dot_flags(_logprob_bwd_kernel, hidden.dtype, opts.fast_fp32)
        cfg = configs.kernel_config(
            "bwd", hidden.dtype, weight.dtype, opts.fast_fp32, interpreted(_logprob_bwd_kernel)
        )
        wave = configs.wave_width(N, H, V, cfg, mixed=weight.dtype != hidden.dtype)
        scratch = torch.empty(N * wave, dtype=hidden.dtype, device=dev)
        with _fp32_matmul(dev, opts.fast_fp32):
            for v0 in range(0, V, wave):
                v1 = min(v0 + wave, V)
                strip = scratch[: N * (v1 - v0)].view(N, v1 - v0)
                n_vtiles = triton.cdiv(v1 - v0, cfg.block_v)
                _logprob_bwd_kernel[(triton.cdiv(N, cfg.block_n) * n_vtiles,)](
                    hidden, weight, bias, targets, lse, ent, g, g_ent, strip,
                    N, V, H, hidden.stride(0), weight.stride(0), strip.stride(0),
                    v0, v1, n_vtiles, 1.0 / opts.temperature, opts.ignore_index,
                    HAS_BIAS=bias is not None, HAS_GRAD_ENTROPY=has_g_ent,
                    BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k,
                    UPCAST_DOT=upcast, DOT_PRECISION=dot_precision,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                )  # fmt: skip
                if need_h:
                    _gemm(dh, strip, weight[v0:v1].to(hidden.dtype), accumulate=True)
                if need_w:
                    _gemm(dw[v0:v1], strip.T, hidden, accumulate=False)
                if need_b:
                    db[v0:v1] = strip.sum(0, dtype=torch.float32)
    return (
        None if dh is None else dh.to(hidden.dtype),
        dw,
        None if db is None else db.to(bias.dtype),
    )
