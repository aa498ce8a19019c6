"""Backward of the fused linear log-prob: dlogits per [chunk, wave] tile, then vendor GEMMs.

A fused kernel would need a [BLOCK_N, H] (or [BLOCK_V, H]) accumulator per program, which does
not fit at H = 4096, or float atomics. Instead each tile of `chunk` tokens × `wave` vocab
columns gets its dlogits strip from `_logprob_bwd_kernel` (logits recomputed from the saved
LSE), and then dH[chunk] += strip @ W[wave], dW[wave] += strip^T @ hidden[chunk],
db[wave] += Σ_n strip, all accumulated in fp32. No atomics, so the same inputs give bitwise the
same gradients. Extra memory: a few buffers of ≤ configs.SCRATCH elements each, plus one fp32
copy of dH or dW (the smaller) only when both axes take several tiles and that gradient is
bf16/fp16 (`configs.backward_plan`).

NB: the strip is stored scaled by a power of two 2^k chosen from max |g| (so that its largest
entries sit near 2^9): an fp16 strip of a mean-style gradient (g ~ 1/(B·T)) would otherwise
fall into fp16's subnormals. The GEMMs accumulate the scaled strip in fp32 and multiply by
2^-k before the one rounding to the gradient's dtype: exact, so bf16/fp32 are unaffected.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core.options import LogProbOptions
from .. import distributed
from . import autotune, configs
from .gemm import fp32_precision, gemm
from .launch import check_dtypes, dot_flags, interpreted
from .tl_utils import tl_block_start, tl_dlogits, tl_logits_tile


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
    scale_ptr,
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
    # written, times the power of two *scale_ptr, to the strip dz[n, v − v_begin] for v in
    # [v_begin, v_end); rows whose target is ignore_index are exactly 0, even where their hidden
    # state is NaN or inf (tl.where, not a product with 0).
    pid = tl.program_id(0)
    n0 = tl_block_start(pid // n_vtiles, BLOCK_N)
    v0 = v_begin + tl_block_start(pid % n_vtiles, BLOCK_V)
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_V)
    mask_n = rows < (N - n0).to(tl.int32)
    z = tl_logits_tile(
        h_ptr, w_ptr, b_ptr, n0, v0, N, V, H, stride_hn, stride_wv, inv_t,
        HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_K, UPCAST_DOT, DOT_PRECISION,
    )  # fmt: skip
    dz = tl_dlogits(z, n0, v0, N, y_ptr, lse_ptr, g_ptr, ent_ptr, g_ent_ptr, scale_ptr, inv_t,
                    ignore_index, HAS_GRAD_ENTROPY, BLOCK_N, BLOCK_V)  # fmt: skip
    dz_ptrs = dz_ptr + n0 * stride_dz + (v0 - v_begin) + (rows[:, None] * stride_dz + cols[None, :])
    mask = mask_n[:, None] & (cols < (v_end - v0).to(tl.int32))[None, :]
    tl.store(dz_ptrs, dz.to(dz_ptr.dtype.element_ty), mask=mask)


# the strip's largest entries land in [2^8, 2^9) × (at most ~23: |∂H/∂z| ≤ 1/e + log V)
STRIP_EXP = 9
# 2^±126: the largest shift whose power of two and inverse are both normal fp32
MAX_SHIFT = 126


def strip_scale(valid, g, g_ent, inv_t: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(2^k, 2^-k) as 0-d fp32 device tensors, 2^k·max|g|/τ ∈ [2^8, 2^9) over valid rows (k = 0
    when every g is 0). Built from the exponent bits: exact, and no host sync."""
    mag = torch.where(valid, g.abs(), 0.0).amax()
    if g_ent is not None:
        mag = torch.maximum(mag, torch.where(valid, g_ent.abs(), 0.0).amax())
    _, exp = torch.frexp(mag.float() * inv_t)
    k = torch.where(mag > 0, STRIP_EXP - exp, 0).clamp(-MAX_SHIFT, MAX_SHIFT).to(torch.int32)
    return ((k + 127) << 23).view(torch.float32), ((127 - k) << 23).view(torch.float32)


class _Accumulator:
    """fp32 accumulation of one gradient `out` [R, H] in blocks of rows (N-chunks of dH, waves
    of dW): into `out` itself when fp32, else a block buffer reused block after block, else
    (`full`) one fp32 copy; a finished block is unscaled and written to `out` in place."""

    def __init__(self, out: torch.Tensor, block: int, full: bool, inv_scale: torch.Tensor):
        self.out, self.inv_scale = out, inv_scale
        self.direct = out.dtype == torch.float32
        rows = 0 if self.direct else out.shape[0] if full else block
        self.buf = torch.empty(rows, out.shape[1], dtype=torch.float32, device=out.device)
        self.full = full

    def view(self, r0: int, r1: int) -> torch.Tensor:
        if self.direct:
            return self.out[r0:r1]
        return self.buf[r0:r1] if self.full else self.buf[: r1 - r0]

    def finish(self, r0: int, r1: int) -> None:
        acc = self.view(r0, r1).mul_(self.inv_scale)
        if not self.direct:
            self.out[r0:r1].copy_(acc)


class _Operand:
    """The last-used slice of an operand, converted or masked into a reused buffer."""

    def __init__(self, make, rows: int, cols: int, dtype: torch.dtype, device: torch.device):
        self.make, self.key, self.value = make, None, None
        self.buf = torch.empty(rows * cols, dtype=dtype, device=device)
        self.cols = cols

    def get(self, r0: int, r1: int) -> torch.Tensor:
        if self.key != (r0, r1):
            self.key = (r0, r1)
            self.value = self.make(r0, r1, self.buf[: (r1 - r0) * self.cols].view(r1 - r0, -1))
        return self.value


def logprob_bwd(hidden, weight, targets, bias, lse, entropy, grad_logp, grad_entropy,
                opts: LogProbOptions, needs: tuple[bool, bool, bool]):  # fmt: skip
    """Gradients (dhidden, dweight, dbias) of Σ g·logp + Σ g_H·entropy; None where not needed.

    hidden [N, H], weight [V, H], targets [N], bias [V] | None, lse/entropy/grads [N]; each
    gradient has its input's dtype. dH or dW work is skipped entirely when not needed.
    """
    targets = distributed.local_targets(targets, opts, weight.shape[0])
    need_h, need_w, need_b = needs[0], needs[1], needs[2] and bias is not None
    check_dtypes(hidden, weight, bias)
    if not (need_h or need_w or need_b):
        return None, None, None
    hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.contiguous()
    bias = None if bias is None else bias.contiguous()
    N, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    alloc = torch.empty if N else torch.zeros  # every tile writes its rows
    dh = alloc(N, H, dtype=hidden.dtype, device=dev) if need_h else None
    dw = alloc(V, H, dtype=weight.dtype, device=dev) if need_w else None
    if N == 0:
        db = torch.zeros(V, dtype=bias.dtype, device=dev) if need_b else None
        return dh, dw, db
    db = torch.empty(V, dtype=torch.float32, device=dev) if need_b else None
    inv_t = 1.0 / opts.temperature
    valid = targets != opts.ignore_index
    g = torch.zeros(N, device=dev) if grad_logp is None else grad_logp.contiguous()
    g_ent = None if grad_entropy is None else grad_entropy.contiguous()
    ent = entropy if g_ent is not None else None
    scale, inv_scale = strip_scale(valid, g, g_ent, inv_t)
    kernel = _logprob_bwd_kernel
    upcast, dot_precision = dot_flags(kernel, hidden.dtype, opts.fast_fp32)
    cands = configs.candidates("bwd", hidden.dtype, weight.dtype, opts.fast_fp32,
                               interpreted(kernel))  # fmt: skip
    plan = configs.backward_plan(
        N, H, V, max(c.block_n for c in cands), max(c.block_v for c in cands),
        fp32_dh=need_h and hidden.dtype != torch.float32,
        fp32_dw=need_w and weight.dtype != torch.float32,
    )  # fmt: skip
    strip_buf = torch.empty(plan.chunk * plan.wave, dtype=hidden.dtype, device=dev)

    def strip_of(n0, n1, v0, v1):
        return strip_buf[: (n1 - n0) * (v1 - v0)].view(n1 - n0, v1 - v0)

    def launch(cfg, n0, n1, v0, v1):
        strip = strip_of(n0, n1, v0, v1)
        n_vtiles = triton.cdiv(v1 - v0, cfg.block_v)
        kernel[(triton.cdiv(n1 - n0, cfg.block_n) * n_vtiles,)](
            hidden[n0:n1], weight, bias, targets[n0:n1], lse[n0:n1],
            None if ent is None else ent[n0:n1], g[n0:n1],
            None if g_ent is None else g_ent[n0:n1], scale, strip,
            n1 - n0, V, H, hidden.stride(0), weight.stride(0), strip.stride(0),
            v0, v1, n_vtiles, inv_t, opts.ignore_index,
            HAS_BIAS=bias is not None, HAS_GRAD_ENTROPY=g_ent is not None,
            BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k,
            UPCAST_DOT=upcast, DOT_PRECISION=dot_precision,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        return strip

    first = (0, plan.chunk, 0, plan.wave)
    shape = tuple(map(autotune.bucket, (plan.chunk, plan.wave, H)))
    key = ("bwd", hidden.dtype, weight.dtype, opts.fast_fp32, bias is not None,
           g_ent is not None, shape, dev.index)  # fmt: skip
    cfg = autotune.choose(key, cands, lambda c: launch(c, *first), tune=dev.type == "cuda")

    dh_acc = _Accumulator(dh, plan.chunk, plan.full_dh(N, V), inv_scale) if need_h else None
    dw_acc = _Accumulator(dw, plan.wave, plan.full_dw(N, V), inv_scale) if need_w else None
    w_wave = h_chunk = None
    if need_h and weight.dtype != hidden.dtype:
        w_wave = _Operand(lambda v0, v1, buf: buf.copy_(weight[v0:v1]), plan.wave, H,
                          hidden.dtype, dev)  # fmt: skip
    if need_w:
        # NB: ignored rows masked to 0, not just met by the strip's zero rows: NaN·0 poisons dW
        zero = hidden.new_zeros(())
        h_chunk = _Operand(
            lambda n0, n1, buf: torch.where(valid[n0:n1, None], hidden[n0:n1], zero, out=buf),
            plan.chunk, H, hidden.dtype, dev,
        )  # fmt: skip
    with fp32_precision(dev, hidden.dtype, opts.fast_fp32):
        for n0, n1, v0, v1 in plan.tiles(N, V):
            strip = launch(cfg, n0, n1, v0, v1)
            if need_h:
                w = weight[v0:v1] if w_wave is None else w_wave.get(v0, v1)
                gemm(dh_acc.view(n0, n1), strip, w, accumulate=v0 > 0)
                if v1 == V:
                    dh_acc.finish(n0, n1)
            if need_w:
                gemm(dw_acc.view(v0, v1), strip.T, h_chunk.get(n0, n1), accumulate=n0 > 0)
                if n1 == N:
                    dw_acc.finish(v0, v1)
            if need_b:
                part = strip.sum(0, dtype=torch.float32)
                if n0 > 0:
                    db[v0:v1] += part
                else:
                    db[v0:v1] = part
    if need_b:
        db = db.mul_(inv_scale).to(bias.dtype)
    return dh, dw, db
