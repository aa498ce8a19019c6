"""Triton kernels: tensors in, tensors out, no autograd (imports triton; CUDA or interpreter).

`logprob_fwd` / `logprob_bwd` have the signatures and semantics of `fgrpo_kernels.cpu.chunked`;
`epilogue` holds the loss epilogues behind `fgrpo_kernels.epilogue`.
"""

from .logprob_bwd import logprob_bwd
from .logprob_fwd import logprob_fwd

__all__ = ["logprob_bwd", "logprob_fwd"]
