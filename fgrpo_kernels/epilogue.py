"""The loss epilogue: from per-token log-probs to (loss, dL/dlogp) in one pass, no vocabulary.

Every loss of docs/math.md is a function of the fp32 per-token log-probs [B, T] and O(B·T) side
inputs. The epilogue returns the loss *and* its gradient with respect to the log-probs, so the
fused modules run [log-prob kernel → epilogue] forward and [log-prob backward fed dL/dlogp ·
grad_output] backward. Two implementations share the signatures below:

- Triton (`kernels.epilogue`), on CUDA tensors and under TRITON_INTERPRET=1;
- PyTorch: autograd of the option-taking `reference` losses on a detached leaf (exact; the CPU
  path).

Options arrive parsed (`fgrpo_kernels.options`): nothing here validates or converts them.
"""

from __future__ import annotations

import torch

from . import reference
from .autograd import use_triton
from .options import FDOOptions, FGRPOOptions, GIFTOptions, GRPOOptions, Level, Reduction


def _with_grad(loss_fn, logps: torch.Tensor, *args) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, dloss/dlogps) of a reference loss, by autograd on a detached float64 leaf.

    NB: O(B·T) work, so float64 costs nothing here and keeps slopes that cancel in fp32
    (sech² of a saturated tanh, a z-score's eps-only gradient) exact; results come back in
    the dtype of `logps`."""
    with torch.enable_grad():
        x = logps.detach().double().requires_grad_(True)
        loss = loss_fn(x, *args)
        (grad,) = torch.autograd.grad(loss, x)
    return loss.detach().to(logps.dtype), grad.to(logps.dtype)


def _no_tokens_zero(result: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor):
    """The Triton twin of `reference.zero_without_tokens` (dL/dlogp is already 0 where masked)."""
    loss, grad = result
    return reference.zero_without_tokens(loss, mask), grad


def _triton(device: torch.device):
    if use_triton(device):
        from .kernels import epilogue

        return epilogue
    return None


def fgrpo(logps, ref_logps, mask, advantages, rewards, old_logps, opts: FGRPOOptions):
    """f-GRPO: (loss, dL/dlogps). `advantages` [B], or None with `rewards` [B] (then normalised
    per group inside); `old_logps` [B, T] only for group_is_weights."""
    kernels = _triton(logps.device)
    if kernels is not None:
        result = kernels.fgrpo(logps, ref_logps, mask, advantages, rewards, old_logps, opts)
        return _no_tokens_zero(result, mask)
    return _with_grad(reference.fgrpo, logps, ref_logps, mask, advantages, rewards, old_logps, opts)


def grpo(logps, old_logps, ref_logps, mask, advantages, num_items_in_batch, opts: GRPOOptions):
    """TRL/Liger GRPO family: (loss, dL/dlogps). old None → logps (ratio 1); ref None → no KL."""
    kernels = _triton(logps.device)
    if kernels is not None:
        return kernels.grpo(logps, old_logps, ref_logps, mask, advantages, num_items_in_batch, opts)
    return _with_grad(
        reference.grpo, logps, old_logps, ref_logps, mask, advantages, num_items_in_batch, opts
    )


def gift(logps, ref_logps, mask, rewards, opts: GIFTOptions):
    """GIFT: (loss, dL/dlogps), through the group statistics unless opts.detach_stats."""
    kernels = _triton(logps.device)
    if kernels is not None:
        return _no_tokens_zero(kernels.gift(logps, ref_logps, mask, rewards, opts), mask)
    return _with_grad(reference.gift, logps, ref_logps, mask, rewards, opts)


def fdo_as_fgrpo(chosen, opts: FDOOptions) -> tuple[torch.Tensor, FGRPOOptions]:
    """FDO as sequence-level f-GRPO with reduction "sum": (advantages +1/n_chosen on chosen rows,
    −1/n_rejected on rejected ones, the f-GRPO options)."""
    n_chosen = chosen.sum()
    dtype = torch.float32
    adv = torch.where(
        chosen, 1.0 / n_chosen.to(dtype), -1.0 / (chosen.numel() - n_chosen).to(dtype)
    )
    return adv, FGRPOOptions(opts.divergence, opts.beta, Level.SEQUENCE, Reduction.SUM)


def fdo(logps, ref_logps, mask, chosen, opts: FDOOptions):
    """FDO: (loss, dL/dlogps); on the Triton path it is sequence-level f-GRPO (`fdo_as_fgrpo`)."""
    kernels = _triton(logps.device)
    if kernels is None:
        return _with_grad(reference.fdo, logps, ref_logps, mask, chosen, opts)
    adv, seq = fdo_as_fgrpo(chosen, opts)
    return _no_tokens_zero(kernels.fgrpo(logps, ref_logps, mask, adv, None, None, seq), mask)
