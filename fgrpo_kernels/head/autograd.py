"""Autograd glue: the fused log-prob as a torch.autograd.Function over a chosen backend.

Backends (Triton, C++ CPU, chunked-PyTorch CPU) share two launchers, `logprob_fwd` and
`logprob_bwd`; the Function saves (hidden, weight, targets, bias, lse, entropy) and feeds the
gradient of every per-row output back to `logprob_bwd`, so any loss built on the rows
backpropagates through the kernel without the kernel knowing the loss.

Both backward passes are first-order only: under create_graph=True their results carry a
grad_fn that raises `HIGHER_ORDER` when differentiated (never a silently wrong value).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from types import ModuleType

import torch
from torch._C import _functions

from ..backends import distributed
from ..core.options import LogProbOptions


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(device: torch.device) -> bool:
    """Triton on CUDA tensors and under TRITON_INTERPRET=1; else the CPU path.

    FGRPO_BACKEND=cpu forces the CPU path for CPU tensors even under the interpreter (the tests
    use it to run both paths in one process); =triton forces the Triton kernels.
    """
    forced = os.environ.get("FGRPO_BACKEND", "auto")
    if forced not in ("auto", "cpu", "triton"):
        raise ValueError(f"FGRPO_BACKEND: expected one of 'auto', 'cpu', 'triton'; got {forced!r}")
    if device.type == "cuda":
        return True
    return interpreting() if forced == "auto" else forced == "triton"


HIGHER_ORDER = (
    "fgrpo_kernels: higher-order gradients are not supported (the fused log-prob and loss "
    "backward passes are first-order only); for a gradient of a gradient use "
    "fgrpo_kernels.reference, which materialises the logits"
)


def first_order_only(backward):
    """`torch.autograd.function.once_differentiable` with a message that says why: the
    backward runs without recording a graph, and under create_graph=True its outputs get a
    grad_fn that raises HIGHER_ORDER when a second derivative reaches it.

    NB: the error node also takes the saved tensors that require grad, so that the inputs of
    the forward stay reachable from the gradients (torch.autograd.grad(g, weight) then raises
    HIGHER_ORDER rather than "appears to not have been used in the graph")."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not torch.is_grad_enabled() or not any(ctx.needs_input_grad):
            return outputs
        inputs = [t for t in ctx.saved_tensors if t is not None and t.requires_grad]
        error = _functions.DelayedError(HIGHER_ORDER.encode(), len(outputs) + len(inputs))

        def alias(t):
            return t if t is None else t.detach().requires_grad_()

        return tuple(error(*[alias(t) for t in outputs], *inputs)[: len(outputs)])

    return wrapper


def select_backend(device: torch.device) -> ModuleType:
    """The module whose `logprob_fwd` / `logprob_bwd` serve tensors on `device`."""
    if use_triton(device):
        from ..backends import triton as kernels

        return kernels
    from ..backends.cpu import backend_module

    return backend_module()


class LinearLogProbFunction(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], targets [N], bias [V] | None) → (logp [N], entropy [N]).

    With a `distributed.Shard`, weight and bias are this rank's vocabulary rows and targets are
    global ids: the per-row statistics are combined over the group (docs/math.md §7)."""

    @staticmethod
    def forward(
        ctx, hidden, weight, targets, bias, opts: LogProbOptions, return_entropy: bool,
        shard: distributed.Shard | None = None,
    ):  # fmt: skip
        ctx.set_materialize_grads(False)
        backend = select_backend(hidden.device)
        if shard is not None:
            opts = dataclasses.replace(opts, vocab_start=shard.start, vocab_total=shard.total)
        logp, lse, entropy = backend.logprob_fwd(
            hidden, weight, targets, bias, opts, return_entropy
        )
        if shard is not None:
            owned = distributed.owned_targets(targets, shard, opts.ignore_index)
            valid = targets != opts.ignore_index
            logp, lse, entropy = distributed.combine(logp, lse, entropy, owned, valid, shard)
        ctx.save_for_backward(hidden, weight, targets, bias, lse, entropy)
        ctx.opts, ctx.backend, ctx.shard = opts, backend, shard
        if entropy is None:
            entropy = logp.new_zeros(0)
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @first_order_only
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, bias, lse, entropy = ctx.saved_tensors
        if entropy is None:
            grad_entropy = None
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None, None, None
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3])
        dh, dw, db = ctx.backend.logprob_bwd(
            hidden, weight, targets, bias, lse, entropy, grad_logp, grad_entropy, ctx.opts, needs
        )
        if ctx.shard is not None:
            dh = distributed.reduce_hidden_grad(dh, ctx.shard)
        return dh, dw, None, db, None, None, None


class EpilogueFunction(torch.autograd.Function):
    """loss = epilogue(logps, *args) whose forward already returns the gradients.

    `epilogue(logps, *args) -> (loss, dloss_dlogps[, dloss_dargs0])` is one of the
    `fgrpo_kernels.losses.epilogue` functions. `logps` is differentiable, and so is `args[0]` (the
    per-token entropy) when the epilogue returns a third, non-None gradient for it.
    """

    @staticmethod
    def forward(ctx, logps, epilogue, *args):
        loss, *grads = epilogue(logps, *args)
        ctx.has_arg_grad = len(grads) > 1 and grads[1] is not None
        # logps (and the entropy) are saved for `first_order_only`: the inputs stay reachable
        saved = [grads[0], logps] + ([grads[1], args[0]] if ctx.has_arg_grad else [])
        ctx.save_for_backward(*saved)
        ctx.n_args = len(args)
        return loss

    @staticmethod
    @first_order_only
    def backward(ctx, grad_loss):
        grad, _, *arg_grad = ctx.saved_tensors
        rest = [None] * ctx.n_args
        if ctx.has_arg_grad and ctx.needs_input_grad[2]:
            rest[0] = arg_grad[0] * grad_loss
        return (grad * grad_loss, None, *rest)


SCALED = (
    "fgrpo_kernels: a single-pass loss is backpropagated a second time after a backward whose "
    "incoming gradient was not 1 (its stored gradients were scaled in place, to save a copy); "
    "build the module with max_chunk_bytes=0 (the two-pass path) to backpropagate through it "
    "several times"
)


class SinglePassFunction(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias [V] | None) → (loss, logp [N], entropy [N]) of a fused
    loss whose forward sweep also forms d loss/d(hidden, weight, bias) (`sweep(hidden, weight,
    bias, needs) -> (loss, logp, entropy, dh, dw, db)`, see `fgrpo_kernels.losses.single_pass`);
    backward only scales them by the incoming gradient. logp and entropy are not
    differentiable (they feed the metrics).

    NB: the gradients are saved tensors, which autograd releases as soon as the first backward
    returns them (without retain_graph), so `.grad` takes them without a copy; an incoming
    gradient other than 1 scales them in place. A later backward through a retained graph
    returns copies, or raises `SCALED` after an in-place scaling."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, sweep):
        needs = tuple(ctx.needs_input_grad[:3])
        loss, logp, entropy, *grads = sweep(hidden, weight, bias, needs)
        entropy = logp.new_zeros(0) if entropy is None else entropy
        ctx.mark_non_differentiable(logp, entropy)
        # hidden, weight, bias are saved for `first_order_only`: the inputs stay reachable
        ctx.save_for_backward(hidden, weight, bias, *grads)
        ctx.handed_out = ctx.scaled = False
        return loss, logp, entropy

    @staticmethod
    @first_order_only
    def backward(ctx, grad_loss, _grad_logp, _grad_entropy):
        if grad_loss is None:
            return None, None, None, None
        if ctx.scaled:
            raise RuntimeError(SCALED)
        grads = ctx.saved_tensors[3:]
        if ctx.handed_out:  # the first backward's results may be these very tensors
            return (*(None if g is None else g * grad_loss.to(g.dtype) for g in grads), None)
        ctx.handed_out = True
        if bool(grad_loss != 1.0):
            ctx.scaled = True
            grads = [None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in grads]
        return (*grads, None)
