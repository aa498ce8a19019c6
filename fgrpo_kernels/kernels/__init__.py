"""Triton backend of the fused linear log-prob (imports triton; CUDA tensors or the interpreter).

`logprob_fwd` / `logprob_bwd` have the signatures and semantics of `fgrpo_kernels.cpu.chunked`.
"""

from .logprob_bwd import logprob_bwd
from .logprob_fwd import logprob_fwd

__all__ = ["logprob_bwd", "logprob_fwd"]
