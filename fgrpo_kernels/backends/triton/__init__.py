"""Triton kernels: tensors in, tensors out, no autograd (imports triton; CUDA or interpreter).

`logprob_fwd` / `logprob_bwd` and the single pass's `logits_fwd` / `logits_bwd` have the
signatures and semantics of `fgrpo_kernels.backends.cpu.chunked`; `epilogue` holds the loss
epilogues behind `fgrpo_kernels.losses.epilogue`. $FGRPO_PRIMITIVE=cublas runs the log-prob
primitive through the single pass's cuBLAS chunks instead of the Triton tiles (`cublas_chunks`).
"""

from . import cublas_chunks
from . import logprob_bwd as _bwd
from . import logprob_fwd as _fwd
from .logits_rows import bytes_per_row, logits_buffer, logits_bwd, logits_fwd, unsupported


def logprob_fwd(hidden, weight, targets, bias, opts, return_entropy):
    """hidden [N, H], weight [V, H], targets [N] → (logp [N], lse [N], entropy [N] | None)."""
    if cublas_chunks.applies(hidden, weight, opts):
        return cublas_chunks.logprob_fwd(hidden, weight, targets, bias, opts, return_entropy)
    return _fwd.logprob_fwd(hidden, weight, targets, bias, opts, return_entropy)


def logprob_bwd(hidden, weight, targets, bias, lse, entropy, grad_logp, grad_entropy, opts,
                needs):  # fmt: skip
    """(dhidden, dweight, dbias) of Σ g·logp + Σ g_H·entropy; None where not needed."""
    fn = cublas_chunks if cublas_chunks.applies(hidden, weight, opts) else _bwd
    return fn.logprob_bwd(hidden, weight, targets, bias, lse, entropy, grad_logp, grad_entropy,
                          opts, needs)  # fmt: skip


__all__ = [
    "bytes_per_row",
    "logits_buffer",
    "logits_bwd",
    "logits_fwd",
    "logprob_bwd",
    "logprob_fwd",
    "unsupported",
]
