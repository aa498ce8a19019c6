"""Autograd glue: the fused log-prob as a torch.autograd.Function over a chosen backend.

Backends (Triton, C++ CPU, chunked-PyTorch CPU) share two launchers, `logprob_fwd` and
`logprob_bwd`; the Function saves (hidden, weight, targets, bias, lse, entropy) and feeds the
gradient of every per-row output back to `logprob_bwd`, so any loss built on the rows
backpropagates through the kernel without the kernel knowing the loss.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from .options import LogProbOptions


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def select_backend(device: torch.device) -> ModuleType:
    """Triton on CUDA tensors and under TRITON_INTERPRET=1; else the CPU backend.

    FGRPO_BACKEND=cpu forces the CPU backend for CPU tensors even under the interpreter (the
    tests use it to run both paths in one process); =triton forces the Triton kernels.
    """
    forced = os.environ.get("FGRPO_BACKEND", "auto")
    if forced not in ("auto", "cpu", "triton"):
        raise ValueError(f"FGRPO_BACKEND: expected one of 'auto', 'cpu', 'triton'; got {forced!r}")
    use_triton = device.type == "cuda" or interpreting()
    if forced != "auto" and device.type != "cuda":
        use_triton = forced == "triton"
    if use_triton:
        from . import kernels

        return kernels
    from .cpu import backend_module

    return backend_module()


class LinearLogProbFunction(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], targets [N], bias [V] | None) → (logp [N], entropy [N])."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, bias, opts: LogProbOptions, return_entropy: bool):
        backend = select_backend(hidden.device)
        logp, lse, entropy = backend.logprob_fwd(
            hidden, weight, targets, bias, opts, return_entropy
        )
        ctx.save_for_backward(hidden, weight, targets, bias, lse, entropy)
        ctx.opts, ctx.backend = opts, backend
        if entropy is None:
            entropy = logp.new_zeros(0)
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, bias, lse, entropy = ctx.saved_tensors
        if entropy is None:
            grad_entropy = None
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3])
        dh, dw, db = ctx.backend.logprob_bwd(
            hidden, weight, targets, bias, lse, entropy, grad_logp, grad_entropy, ctx.opts, needs
        )
        return dh, dw, None, db, None, None
