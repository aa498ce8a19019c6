"""Forward of the fused linear log-prob: split-vocab online LSE, then an O(S·N) combine."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core.options import LogProbOptions
from .. import distributed
from . import autotune, configs
from .launch import check_dtypes, dot_flags, interpreted
from .tl_utils import tl_block_start, tl_local_index, tl_logits_tile, tl_online_fold


@triton.jit
def _logprob_fwd_kernel(
    h_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    m_ptr,
    s_ptr,
    zy_ptr,
    t_ptr,
    N,
    V,
    H,
    stride_hn,
    stride_wv,
    inv_t,
    n_splits,
    tiles_per_split,
    HAS_BIAS: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Program (token block b, split k) scans vocab tiles [k·T, (k+1)·T) of z = (h W^T + b)/τ:
    #   m = max_v z,  s = Σ_v e^(z−m),  t = Σ_v e^(z−m)(z−m),  z_y = z[y]
    # rescaling s and t whenever m grows, and writes (m, s, z_y, t) to partials [S, N] each.
    # lse = m + log s and H = log s − t/s after the combine; relative to m, nothing cancels.
    pid = tl.program_id(0)
    split = pid % n_splits
    n0 = tl_block_start(pid // n_splits, BLOCK_N)
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_V)
    mask_n = rows < (N - n0).to(tl.int32)
    y = tl.load(y_ptr + n0 + rows, mask=mask_n, other=-1)
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    t = tl.zeros((BLOCK_N,), tl.float32)
    z_y = tl.zeros((BLOCK_N,), tl.float32)
    v_begin = tl_block_start(split, BLOCK_V) * tiles_per_split
    v_end = tl.minimum(v_begin + tiles_per_split * BLOCK_V, V)
    for v0 in range(v_begin, v_end, BLOCK_V):
        z = tl_logits_tile(
            h_ptr, w_ptr, b_ptr, n0, v0, N, V, H, stride_hn, stride_wv, inv_t,
            HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_K, UPCAST_DOT, DOT_PRECISION,
        )  # fmt: skip
        in_v = (cols < (V - v0).to(tl.int32))[None, :]
        z = tl.where(in_v, z, float("-inf"))
        hit = cols[None, :] == tl_local_index(y, v0, BLOCK_V)[:, None]
        m, s, t, z_y = tl_online_fold(z, hit, m, s, t, z_y, HAS_ENTROPY)
    row = split.to(tl.int64) * N + n0 + rows
    tl.store(m_ptr + row, m, mask=mask_n)
    tl.store(s_ptr + row, s, mask=mask_n)
    tl.store(zy_ptr + row, z_y, mask=mask_n)
    if HAS_ENTROPY:
        tl.store(t_ptr + row, t, mask=mask_n)


def combine_partials(part: torch.Tensor, return_entropy: bool):
    """Partials [4, S, N] (m, s, z_y, t) → (lse [N], z_y [N], entropy [N] | None)."""
    m, s, z_y = part[0], part[1], part[2]
    m_max = m.amax(0)
    w = torch.exp(m - m_max)
    s_tot = (w * s).sum(0)
    log_s = torch.log(s_tot)
    lse = m_max + log_s
    if not return_entropy:
        return lse, z_y.sum(0), None
    shift = torch.where(torch.isfinite(m), m - m_max, 0.0)  # a split of banned tokens: s = 0
    t_tot = (w * (part[3] + shift * s)).sum(0)
    return lse, z_y.sum(0), log_s - t_tot / s_tot


def logprob_fwd(hidden, weight, targets, bias, opts: LogProbOptions, return_entropy: bool):
    """hidden [N, H], weight [V, H], targets [N] → (logp [N], lse [N], entropy [N] | None), fp32."""
    targets = distributed.local_targets(targets, opts, weight.shape[0])
    check_dtypes(hidden, weight, bias)
    hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.contiguous()
    bias = None if bias is None else bias.contiguous()
    N, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    if N == 0:
        empty = torch.zeros(0, dtype=torch.float32, device=dev)
        return empty, empty.clone(), empty.clone() if return_entropy else None
    upcast, dot_precision = dot_flags(_logprob_fwd_kernel, hidden.dtype, opts.fast_fp32)

    def run(cfg: configs.KernelConfig) -> torch.Tensor:
        n_splits, per_split = configs.vocab_splits(N, V, cfg, dev)
        # t's row is unused (and unwritten) without entropy; 4·S·N floats either way.
        part = torch.empty(4, n_splits, N, dtype=torch.float32, device=dev)
        grid = (n_splits * triton.cdiv(N, cfg.block_n),)
        _logprob_fwd_kernel[grid](
            hidden, weight, bias, targets, *part.unbind(0), N, V, H, hidden.stride(0),
            weight.stride(0), 1.0 / opts.temperature, n_splits, per_split,
            HAS_BIAS=bias is not None, HAS_ENTROPY=return_entropy,
            BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k,
            UPCAST_DOT=upcast, DOT_PRECISION=dot_precision,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        return part

    cands = configs.candidates("fwd", hidden.dtype, weight.dtype, opts.fast_fp32,
                               interpreted(_logprob_fwd_kernel))  # fmt: skip
    shape = tuple(map(autotune.bucket, (N, V, H)))
    key = ("fwd", hidden.dtype, weight.dtype, opts.fast_fp32, bias is not None, return_entropy,
           shape, dev.index)  # fmt: skip
    part = run(autotune.choose(key, cands, run, tune=dev.type == "cuda"))
    lse, z_y, entropy = combine_partials(part, return_entropy)
    valid = targets != opts.ignore_index
    logp = torch.where(valid, z_y - lse, 0.0)
    if entropy is not None:
        entropy = torch.where(valid, entropy, 0.0)
    return logp, lse, entropy
