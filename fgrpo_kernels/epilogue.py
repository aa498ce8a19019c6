"""The loss epilogue: from per-token log-probs to (loss, dL/dlogp) in one pass, no vocabulary.

Every loss of SPEC §4 is a function of the fp32 per-token log-probs [B, T] and O(B·T) side
inputs. The epilogue returns the loss *and* its gradient with respect to the log-probs, so the
fused modules run [log-prob kernel → epilogue] forward and [log-prob backward fed dL/dlogp ·
grad_output] backward. Two implementations share the signatures below:

- Triton (`kernels.epilogue`), on CUDA tensors and under TRITON_INTERPRET=1;
- PyTorch: autograd of the `reference` losses on a detached leaf (exact; the CPU path).

Options travel as frozen dataclasses of enums, validated once at the public edge.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from . import reference
from .autograd import use_triton
from .divergences import Divergence


class Level(enum.IntEnum):
    TOKEN = 0
    SEQUENCE = 1


class Reduction(enum.IntEnum):
    TOKEN_MEAN = 0
    SEQ_MEAN = 1
    SUM = 2


class Scale(enum.IntEnum):
    GROUP = 0
    BATCH = 1
    NONE = 2


class LossType(enum.IntEnum):
    GRPO = 0
    BNPO = 1
    DR_GRPO = 2
    DAPO = 3


def enum_of(kind: type[enum.IntEnum], value: str) -> enum.IntEnum:
    return kind[value.upper()]


def name_of(value: enum.IntEnum) -> str:
    return value.name.lower()


@dataclass(frozen=True)
class FGRPOOptions:
    divergence: Divergence
    beta: float
    level: Level
    reduction: Reduction
    num_generations: int | None = None
    scale: Scale = Scale.GROUP
    eps: float = 1e-4
    unbiased: bool = True
    group_is_weights: bool = False


@dataclass(frozen=True)
class GRPOOptions:
    loss_type: LossType
    beta: float
    epsilon_low: float
    epsilon_high: float
    level: Level
    max_completion_length: int | None = None


@dataclass(frozen=True)
class GIFTOptions:
    num_generations: int
    beta: float
    eps: float = 1e-4
    unbiased: bool = True
    detach_stats: bool = False


@dataclass(frozen=True)
class FDOOptions:
    divergence: Divergence
    beta: float


def _with_grad(loss_fn, logps: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, dloss/dlogps) of a reference loss, by autograd on a detached float64 leaf.

    NB: O(B·T) work, so float64 costs nothing here and keeps slopes that cancel in fp32
    (sech² of a saturated tanh, a z-score's eps-only gradient) exact; results come back in
    the dtype of `logps`."""
    with torch.enable_grad():
        x = logps.detach().double().requires_grad_(True)
        loss = loss_fn(x, **kwargs)
        (grad,) = torch.autograd.grad(loss, x)
    return loss.detach().to(logps.dtype), grad.to(logps.dtype)


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
        return kernels.fgrpo(logps, ref_logps, mask, advantages, rewards, old_logps, opts)
    if advantages is None:
        advantages = reference.group_normalize(
            rewards, opts.num_generations, opts.eps, opts.unbiased, name_of(opts.scale)
        )
    return _with_grad(
        reference.fgrpo_loss,
        logps,
        ref_logps=ref_logps,
        advantages=advantages,
        mask=mask,
        divergence=opts.divergence,
        beta=opts.beta,
        level=name_of(opts.level),
        reduction=name_of(opts.reduction),
        group_is_weights=opts.group_is_weights,
        old_logps=old_logps,
        rewards=rewards if opts.group_is_weights else None,
        num_generations=opts.num_generations,
    )


def grpo(logps, old_logps, ref_logps, mask, advantages, num_items_in_batch, opts: GRPOOptions):
    """TRL/Liger GRPO family: (loss, dL/dlogps). old/ref None → logps (no ratio drift, no KL)."""
    kernels = _triton(logps.device)
    if kernels is not None:
        return kernels.grpo(logps, old_logps, ref_logps, mask, advantages, num_items_in_batch, opts)
    return _with_grad(
        reference.grpo_loss,
        logps,
        old_logps=old_logps,
        ref_logps=ref_logps,
        advantages=advantages,
        mask=mask,
        loss_type=name_of(opts.loss_type),
        beta=opts.beta,
        epsilon_low=opts.epsilon_low,
        epsilon_high=opts.epsilon_high,
        importance_sampling_level=name_of(opts.level),
        max_completion_length=opts.max_completion_length,
        num_items_in_batch=num_items_in_batch,
    )


def gift(logps, ref_logps, mask, rewards, opts: GIFTOptions):
    """GIFT: (loss, dL/dlogps), through the group statistics unless opts.detach_stats."""
    kernels = _triton(logps.device)
    if kernels is not None:
        return kernels.gift(logps, ref_logps, mask, rewards, opts)
    return _with_grad(
        reference.gift_loss,
        logps,
        ref_logps=ref_logps,
        rewards=rewards,
        mask=mask,
        num_generations=opts.num_generations,
        beta=opts.beta,
        eps=opts.eps,
        unbiased=opts.unbiased,
        detach_stats=opts.detach_stats,
    )


def fdo(logps, ref_logps, mask, chosen, opts: FDOOptions):
    """FDO: (loss, dL/dlogps); on the Triton path it is sequence-level f-GRPO with advantages
    +1/n_chosen and −1/n_rejected and reduction "sum"."""
    kernels = _triton(logps.device)
    if kernels is not None:
        n_chosen = chosen.sum()
        dtype = torch.float32
        adv = torch.where(
            chosen, 1.0 / n_chosen.to(dtype), -1.0 / (chosen.numel() - n_chosen).to(dtype)
        )
        seq = FGRPOOptions(opts.divergence, opts.beta, Level.SEQUENCE, Reduction.SUM)
        return kernels.fgrpo(logps, ref_logps, mask, adv, None, None, seq)
    return _with_grad(
        reference.fdo_loss,
        logps,
        ref_logps=ref_logps,
        mask=mask,
        chosen=chosen,
        divergence=opts.divergence,
        beta=opts.beta,
    )
