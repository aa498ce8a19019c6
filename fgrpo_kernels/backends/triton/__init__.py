"""Triton kernels: tensors in, tensors out, no autograd (imports triton; CUDA or interpreter).

`logprob_fwd` / `logprob_bwd` and the single pass's `logits_fwd` / `logits_bwd` have the
signatures and semantics of `fgrpo_kernels.backends.cpu.chunked`; `epilogue` holds the loss
epilogues behind `fgrpo_kernels.losses.epilogue`.
"""

from .logits_rows import bytes_per_row, logits_buffer, logits_bwd, logits_fwd, unsupported
from .logprob_bwd import logprob_bwd
from .logprob_fwd import logprob_fwd

__all__ = [
    "bytes_per_row",
    "logits_buffer",
    "logits_bwd",
    "logits_fwd",
    "logprob_bwd",
    "logprob_fwd",
    "unsupported",
]
