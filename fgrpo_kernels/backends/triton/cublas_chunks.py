"""The log-prob primitive through the single pass's cuBLAS chunk path, recomputing in backward.

    forward : per chunk of rows, logits = h W^T (cuBLAS, fp32 out, into a bounded buffer) →
              `_logits_stats_kernel`: lse, logp, entropy
    backward: per chunk, the logits recomputed (cuBLAS) → `_logits_grad_kernel` → cuBLAS
              dh = dz W, dW (+)= dz^T h (fp32), db (+)= Σ dz

8·N·H·V FLOPs, as the Triton tiles (`logprob_fwd` / `logprob_bwd`); the products run at the
cuBLAS rate, the fp32 logits make a round trip through memory. Chosen with
$FGRPO_PRIMITIVE=cublas ("tiles", the default, keeps the Triton tiles); operands the row path
cannot take (mixed dtypes, no fp32-output cuBLAS product, a vocabulary shard) keep the tiles.
The buffer is `backends.memory.buffer_bytes` ($FGRPO_MAX_CHUNK_BYTES, else sized from free
memory on CUDA less the fp32 dW and its copy, 32 MiB on the CPU).
"""

from __future__ import annotations

import os

import torch

from ...core.options import LogProbOptions
from .. import memory
from ..phases import phase
from . import logits_rows
from .gemm import fp32_precision, gemm
from .launch import check_dtypes

ENV = "FGRPO_PRIMITIVE"
CHOICES = ("tiles", "cublas")


def chosen() -> str:
    got = os.environ.get(ENV, "tiles")
    if got not in CHOICES:
        raise ValueError(f"{ENV}: expected one of {CHOICES}; got {got!r}")
    return got


def applies(hidden, weight, opts: LogProbOptions) -> bool:
    """Whether this path serves the call: chosen, a whole vocabulary, operands it takes."""
    if chosen() != "cublas" or opts.vocab_total is not None:
        return False
    return logits_rows.unsupported(hidden, weight) is None


def rows_per_chunk(hidden, weight) -> int:
    """Rows per chunk; on CUDA the buffer rule leaves room for the fp32 dW and its copy."""
    V, H = weight.shape
    per_row = logits_rows.bytes_per_row(hidden, V)
    fixed = memory.fixed_bytes(V, H, weight.dtype)
    return max(1, memory.buffer_bytes(hidden.device, fixed=fixed) // per_row)


def logprob_fwd(hidden, weight, targets, bias, opts: LogProbOptions, return_entropy: bool):
    """As `logprob_fwd.logprob_fwd`: (logp [N], lse [N], entropy [N] | None) fp32."""
    check_dtypes(hidden, weight, bias)
    hidden, targets = hidden.contiguous(), targets.contiguous()
    N, V = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    logp = torch.zeros(N, dtype=torch.float32, device=dev)
    lse = torch.zeros_like(logp)
    entropy = torch.zeros_like(logp) if return_entropy else None
    rows = rows_per_chunk(hidden, weight)
    buf = logits_rows.logits_buffer(min(rows, N), V, hidden) if N else None
    for n0 in range(0, N, rows):
        n1 = min(n0 + rows, N)
        lp, ls, en = logits_rows.logits_fwd(hidden[n0:n1], weight, targets[n0:n1], bias, opts,
                                            return_entropy, buf[: n1 - n0])  # fmt: skip
        logp[n0:n1], lse[n0:n1] = lp, ls
        if entropy is not None:
            entropy[n0:n1] = en
    return logp, lse, entropy


def logprob_bwd(hidden, weight, targets, bias, lse, entropy, grad_logp, grad_entropy,
                opts: LogProbOptions, needs: tuple[bool, bool, bool]):  # fmt: skip
    """As `logprob_bwd.logprob_bwd`: (dhidden, dweight, dbias) in the inputs' dtypes."""
    check_dtypes(hidden, weight, bias)
    need_h, need_w, need_b = needs[0], needs[1], needs[2] and bias is not None
    if not (need_h or need_w or need_b):
        return None, None, None
    hidden, targets = hidden.contiguous(), targets.contiguous()
    N, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    acc = torch.float32
    dh = torch.empty(N, H, dtype=hidden.dtype, device=dev) if need_h else None
    dh_buf = None
    rows = rows_per_chunk(hidden, weight)
    if need_h and hidden.dtype != acc:
        dh_buf = torch.empty(min(rows, N), H, dtype=acc, device=dev)
    dw = torch.zeros(V, H, dtype=acc, device=dev) if need_w else None
    db = torch.zeros(V, dtype=acc, device=dev) if need_b else None
    buf = logits_rows.logits_buffer(min(rows, N), V, hidden) if N else None
    g_all = None if grad_logp is None else grad_logp.float()
    ge_all = None if grad_entropy is None or entropy is None else grad_entropy.float()
    for k, n0 in enumerate(range(0, N, rows)):
        n1 = min(n0 + rows, N)
        h, x = hidden[n0:n1], buf[: n1 - n0]
        with phase("logits_gemm"), fp32_precision(dev, hidden.dtype, opts.fast_fp32):
            gemm(x, h, weight.T, accumulate=False)
        d_h = None if dh is None else dh[n0:n1] if dh_buf is None else dh_buf[: n1 - n0]
        logits_rows.logits_bwd(
            x, h, weight, targets[n0:n1], bias, lse[n0:n1],
            None if entropy is None else entropy[n0:n1],
            None if g_all is None else g_all[n0:n1], None if ge_all is None else ge_all[n0:n1],
            opts, d_h, dw, db, k > 0,
        )  # fmt: skip
        if dh_buf is not None:
            dh[n0:n1] = d_h
    dw = None if dw is None else dw.to(weight.dtype)
    db = None if db is None else db.to(bias.dtype)
    return dh, dw, db
