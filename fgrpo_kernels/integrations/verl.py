"""verl drop-in: verl 0.9.1's fused-kernel path (`use_fused_kernels`) computed by our fused head.

verl's monkey patch replaces a causal LM's forward by one that returns per-token log-probs and
entropies from the last hidden state and the lm_head (`CausalLMOutputForPPO`), through one of its
backends (`fused_kernel_options.impl_backend`: triton, torch, liger). This module adds a fourth,
`"fgrpo"`, for every model the patch covers: verl's own Triton-backend forward of that model type
runs, with its `linear_cross_entropy` call answered by `linear_cross_entropy` below. In a verl
run (each worker imports `external_lib`, which turns the backend on):

    actor_rollout_ref.model.external_lib=fgrpo_kernels.integrations.verl_enable
    actor_rollout_ref.model.use_fused_kernels=True
    actor_rollout_ref.model.fused_kernel_options.impl_backend=fgrpo

or call `use_fused_head()` in your process before verl patches the model. The backends triton,
torch and liger stay verl's. Nothing falls back: a model whose patched forward does not reach
the fused head, `impl_backend=fgrpo` without `use_fused_kernels`, and inputs the head does not
take raise named errors.
"""

from __future__ import annotations

import contextvars
import functools
import numbers

import torch

from ..backends.distributed import VocabParallel
from ..head.logprobs import fused_linear_logprobs

BACKEND = "fgrpo"

# the calls into the fused head during one patched forward; None outside such a forward
_CALLS: contextvars.ContextVar[list | None] = contextvars.ContextVar("fgrpo_verl", default=None)


def linear_cross_entropy(
    hidden, weight, labels, temperature=1.0, reduction="none", dist_process_group=None
):
    """verl's `linear_cross_entropy` on our fused head: (logp, entropy), both fp32 and shaped like
    `labels`, logp = log_softmax(h Wᵀ / τ)[label], entropy = H(softmax(h Wᵀ / τ)).

    hidden [..., H] (verl passes [B, T, H] padded or [1, N, H] packed), weight [V, H] (a plain
    tensor or an FSDP2 DTensor, gathered for the call), labels [...] integer ids in [0, V).
    Differentiable in hidden and weight through both outputs (verl's entropy bonus needs the
    entropy's gradient). `dist_process_group`: weight is this rank's equal shard of the vocabulary
    and labels are global ids, as in verl's kernel; each rank returns its partial hidden-state
    gradient (verl's tensor-parallel caller reduces it). Only `reduction="none"` is taken.
    Labels of -100 give 0 and no gradient.
    """
    if reduction != "none":
        raise ValueError(f"reduction: expected 'none' (per-token outputs); got {reduction!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature: expected a float; got {type(temperature).__name__}")
    if not isinstance(labels, torch.Tensor) or labels.dtype.is_floating_point:
        raise TypeError(f"labels: expected an integer tensor; got {_describe(labels)}")
    if not isinstance(hidden, torch.Tensor) or tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"labels: expected the shape of hidden without its last dimension, "
            f"{tuple(hidden.shape[:-1]) if isinstance(hidden, torch.Tensor) else '?'}; "
            f"got {tuple(labels.shape)}"
        )
    calls = _CALLS.get()
    if calls is not None:
        calls.append(tuple(hidden.shape))
    vocab_parallel = None
    if dist_process_group is not None:
        vocab_parallel = VocabParallel(group=dist_process_group, reduce_hidden_grad=False)
    return fused_linear_logprobs(
        hidden,
        weight,
        labels,
        temperature=float(temperature),
        return_entropy=True,
        vocab_parallel=vocab_parallel,
    )


def _describe(x) -> str:
    return f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__


def use_fused_head() -> None:
    """Make `fused_kernels_backend="fgrpo"` (config: `fused_kernel_options.impl_backend=fgrpo`)
    a backend of verl's monkey patch, computed by `linear_cross_entropy` above. Idempotent;
    imports verl."""
    from verl.models.transformers import monkey_patch
    from verl.utils.kernel import linear_cross_entropy as verl_lce

    if not getattr(monkey_patch.patch_forward_with_backends, "_fgrpo", False):
        monkey_patch.patch_forward_with_backends = _with_our_backend(
            monkey_patch.patch_forward_with_backends
        )
    if not getattr(verl_lce.linear_cross_entropy, "_fgrpo", False):
        verl_lce.linear_cross_entropy = _dispatch(verl_lce.linear_cross_entropy)


def _with_our_backend(patch):
    """verl's `patch_forward_with_backends`, which also takes the backend "fgrpo": the model
    type's Triton-backend forward, run with our head."""

    @functools.wraps(patch)
    def patch_forward_with_backends(model, use_fused_kernels=False, fused_kernels_backend=None):
        if fused_kernels_backend != BACKEND:
            return patch(model, use_fused_kernels, fused_kernels_backend)
        if not use_fused_kernels:
            raise ValueError(
                f"use_fused_kernels: expected True with fused_kernels_backend={BACKEND!r} "
                "(actor_rollout_ref.model.use_fused_kernels=True); got "
                f"{use_fused_kernels!r}"
            )
        patch(model, True, "triton")
        cls = model.__class__
        cls.forward = _through_fused_head(cls.forward, cls.__name__)
        model._verl_fused_kernels_backend = BACKEND

    patch_forward_with_backends._fgrpo = True
    return patch_forward_with_backends


def _through_fused_head(forward, name: str):
    """The patched forward, run with verl's `linear_cross_entropy` answered by ours; a forward
    that never reaches it is an error, not a silent logits path."""

    @functools.wraps(forward)
    def forward_with_fgrpo_backend(self, *args, **kwargs):
        calls = []
        token = _CALLS.set(calls)
        try:
            out = forward(self, *args, **kwargs)
        finally:
            _CALLS.reset(token)
        if not calls:
            raise NotImplementedError(
                f"fused_kernels_backend: {BACKEND!r} is not reached by {name}'s patched forward "
                "(it computes no log-probs through verl's linear_cross_entropy); use verl's "
                "torch backend for this model"
            )
        return out

    return forward_with_fgrpo_backend


def _dispatch(verl_kernel):
    """verl's `linear_cross_entropy` for the backend "triton", ours inside an "fgrpo" forward."""

    @functools.wraps(verl_kernel)
    def dispatch(*args, **kwargs):
        fn = verl_kernel if _CALLS.get() is None else linear_cross_entropy
        return fn(*args, **kwargs)

    dispatch._fgrpo = True
    return dispatch
