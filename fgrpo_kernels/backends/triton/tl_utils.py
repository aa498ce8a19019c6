"""Small @triton.jit helpers shared by the log-prob kernels (two-pass and single-pass).

Offsets: every tile starts at an int64 base (n0 · stride, v0 · stride) and adds int32 in-tile
offsets, so N·H, N·V and V·H may pass 2^31 while the per-element index math stays 32-bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tl_math import tl_expm1


@triton.jit
def tl_block_start(pid, BLOCK: tl.constexpr):
    """int64 first index of block `pid` (multiplied by strides later, never overflows)."""
    return pid.to(tl.int64) * BLOCK


@triton.jit
def tl_logits_tile(
    h_ptr,
    w_ptr,
    b_ptr,
    n0,
    v0,
    N,
    V,
    H,
    stride_hn,
    stride_wv,
    inv_t,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """z[BLOCK_N, BLOCK_V] = (h W^T + b)·inv_t in fp32 for rows n0 + i and vocab v0 + j.

    Operands are multiplied in hidden's dtype (the weight tile is converted to it); rows ≥ N and
    columns ≥ V read zeros, so the caller masks them.
    """
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_V)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = rows < (N - n0).to(tl.int32)
    mask_v = cols < (V - v0).to(tl.int32)
    h_ptrs = h_ptr + n0 * stride_hn + (rows[:, None] * stride_hn + offs_k[None, :])
    w_ptrs = w_ptr + v0 * stride_wv + (cols[None, :] * stride_wv + offs_k[:, None])
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        mask_k = offs_k < H - k0
        h = tl.load(h_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_v[None, :], other=0.0).to(h.dtype)
        if UPCAST_DOT:
            # NB: under TRITON_INTERPRET=1 (Triton 3.9) tl.dot of two bf16/fp16 blocks returns
            # garbage; the launcher sets UPCAST_DOT only there. The upcast is exact, so the
            # interpreted product equals the compiled one (fp32 accumulation of low-precision
            # operands).
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, w, acc, input_precision=DOT_PRECISION)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + v0 + cols, mask=mask_v, other=0.0).to(tl.float32)[None, :]
    return acc * inv_t


@triton.jit
def tl_local_index(idx, start, BLOCK: tl.constexpr):
    """int32 idx − start where it falls in [0, BLOCK), else −1 (compares cheaply with arange)."""
    local = idx - start
    return tl.where((local >= 0) & (local < BLOCK), local, -1).to(tl.int32)


@triton.jit
def tl_online_fold(z, hit, m, s, t, z_y, HAS_ENTROPY: tl.constexpr):
    """Folds the logits tile z [BLOCK_N, BLOCK_V] (−inf past V) into its rows' online state:
    m = max z, s = Σ e^(z−m), t = Σ e^(z−m)(z−m) (with HAS_ENTROPY), z_y += z where `hit`.

    NB: banned tokens (−inf logits) have p = 0 and add nothing: a tile of them leaves m at −inf
    (shifted by 0, not by −inf), and u is zeroed where e = 0 before e·u (no 0·∞, also in the
    padded columns past V)."""
    z_y += tl.sum(tl.where(hit, z, 0.0), axis=1)
    m_new = tl.maximum(m, tl.max(z, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    scale = tl.exp(m - m_ref)
    u = z - m_ref[:, None]
    e = tl.exp(u)
    if HAS_ENTROPY:
        shift = tl.where(m == float("-inf"), 0.0, m - m_new)
        t = scale * (t + shift * s) + tl.sum(e * tl.where(e > 0.0, u, 0.0), axis=1)
    s = scale * s + tl.sum(e, axis=1)
    return m_new, s, t, z_y


@triton.jit
def tl_dlogits(z, n0, v0, N, y_ptr, lse_ptr, g_ptr, ent_ptr, g_ent_ptr, scale_ptr, inv_t,
               ignore_index, HAS_GRAD_ENTROPY: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_V: tl.constexpr):  # fmt: skip
    """dlogits of Σ g·logp + Σ g_H·H on the logits tile z of rows n0 + i (of N; per-row inputs
    at the pointers) and vocab v0 + j, times the power of two *scale_ptr:
    (g·(onehot − p) − g_H·p·(z − lse + H))/τ, p = e^(z − lse) (docs/math.md §1, Backward).
    Rows whose target is ignore_index (and rows past N) are exactly 0, even where z is not
    finite (tl.where, not a product with 0).

    NB: the target's g·(1 − p_y) as −g·expm1(u_y): a near-certain target keeps its precision."""
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_V)
    mask_n = rows < (N - n0).to(tl.int32)
    y = tl.load(y_ptr + n0 + rows, mask=mask_n, other=ignore_index)
    g = tl.load(g_ptr + n0 + rows, mask=mask_n, other=0.0).to(tl.float32)
    u = z - tl.load(lse_ptr + n0 + rows, mask=mask_n, other=0.0)[:, None]
    p = tl.exp(u)
    hit = cols[None, :] == tl_local_index(y, v0, BLOCK_V)[:, None]
    dz = -g[:, None] * tl.where(hit, tl_expm1(u), p)
    if HAS_GRAD_ENTROPY:
        g_ent = tl.load(g_ent_ptr + n0 + rows, mask=mask_n, other=0.0).to(tl.float32)
        ent = tl.load(ent_ptr + n0 + rows, mask=mask_n, other=0.0)
        dz -= g_ent[:, None] * p * tl.where(p > 0.0, u + ent[:, None], 0.0)  # u = −inf: p = 0
    valid = mask_n & (y != ignore_index)
    return tl.where(valid[:, None], dz * (inv_t * tl.load(scale_ptr)), 0.0)
