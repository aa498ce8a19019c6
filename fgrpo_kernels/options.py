"""Every non-tensor option of the package: enums inside, strings at the public edge.

The enums are the vocabulary; the public string choices (`LEVELS`, `LOSS_TYPES`, ...) are their
lower-case names. Each frozen dataclass carries one loss's options as enums and plain numbers,
so a launcher or an autograd `ctx` holds a single hashable object. `X.parse(...)` is the public
edge: it takes the strings a user passes, validates every value once, and returns the
dataclass; nothing below it converts back to strings or validates again. Defaults belong to the
public signatures (the reference functions, the modules), not to `parse`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from . import validation as check
from .divergences import Divergence, get_divergence


class Level(enum.IntEnum):
    """Where the implicit reward or importance ratio lives: per token or per sequence."""

    TOKEN = 0
    SEQUENCE = 1


class Reduction(enum.IntEnum):
    TOKEN_MEAN = 0
    SEQ_MEAN = 1
    SUM = 2


class Scale(enum.IntEnum):
    """Rewards → advantages: σ per group, σ over the batch, or centring only."""

    GROUP = 0
    BATCH = 1
    NONE = 2


class LossType(enum.IntEnum):
    """The normaliser of the GRPO family (TRL's `loss_type`)."""

    GRPO = 0
    BNPO = 1
    DR_GRPO = 2
    DAPO = 3


def names(kind: type[enum.Enum]) -> tuple[str, ...]:
    """The public spellings of an enum's members: their lower-case names."""
    return tuple(member.name.lower() for member in kind)


def name_of(value: enum.Enum) -> str:
    return value.name.lower()


def parse(kind: type[enum.IntEnum], arg: str, value, allowed=None):
    """The member of `kind` that `value` names (a member passes through); a ValueError naming
    `arg` and the allowed spellings otherwise. `allowed` narrows the members accepted."""
    allowed = tuple(kind) if allowed is None else tuple(allowed)
    if isinstance(value, kind) and value in allowed:
        return value
    spellings = tuple(name_of(member) for member in allowed)
    if isinstance(value, str) and value in spellings:
        return kind[value.upper()]
    raise ValueError(f"{arg}: expected one of {', '.join(map(repr, spellings))}; got {value!r}")


LEVELS = names(Level)
SCALES = names(Scale)
LOSS_TYPES = names(LossType)
# The reductions each level allows; the first is its default.
LEVEL_REDUCTIONS: dict[Level, tuple[Reduction, ...]] = {
    Level.TOKEN: (Reduction.TOKEN_MEAN, Reduction.SEQ_MEAN, Reduction.SUM),
    Level.SEQUENCE: (Reduction.SEQ_MEAN, Reduction.SUM),
}
REDUCTIONS: dict[str, tuple[str, ...]] = {
    name_of(level): tuple(map(name_of, allowed)) for level, allowed in LEVEL_REDUCTIONS.items()
}


def parse_level_reduction(level, reduction, level_arg: str = "level") -> tuple[Level, Reduction]:
    """(level, reduction) with the level's default reduction for None."""
    level = parse(Level, level_arg, level)
    allowed = LEVEL_REDUCTIONS[level]
    reduction = allowed[0] if reduction is None else reduction
    return level, parse(Reduction, "reduction", reduction, allowed)


@dataclass(frozen=True)
class LogProbOptions:
    """temperature τ divides the logits; rows whose target is `ignore_index` give logp 0,
    entropy 0 and no gradient; `fast_fp32` lets fp32 inputs use TF32 tensor cores on CUDA
    (off by default: fp32 products are full fp32)."""

    temperature: float = 1.0
    ignore_index: int = -100
    fast_fp32: bool = False
    # Under vocabulary parallelism weight holds rows [vocab_start, vocab_start + V) of a
    # vocabulary of vocab_total (None: V) and targets stay global ids.
    vocab_start: int = 0
    vocab_total: int | None = None


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

    @classmethod
    def parse(
        cls,
        divergence,
        beta,
        level,
        reduction,
        num_generations,
        scale,
        eps,
        unbiased,
        group_is_weights,
        *,
        scale_arg: str = "scale",
    ) -> FGRPOOptions:
        level, reduction = parse_level_reduction(level, reduction)
        if num_generations is not None:
            check.positive_int("num_generations", num_generations)
        return cls(
            divergence=get_divergence(divergence),
            beta=check.positive("beta", beta, allow_zero=True),
            level=level,
            reduction=reduction,
            num_generations=num_generations,
            scale=parse(Scale, scale_arg, scale),
            eps=check.positive("eps", eps, allow_zero=True),
            unbiased=bool(unbiased),
            group_is_weights=bool(group_is_weights),
        )


@dataclass(frozen=True)
class GRPOOptions:
    loss_type: LossType
    beta: float
    epsilon_low: float
    epsilon_high: float
    level: Level
    max_completion_length: int | None = None

    @classmethod
    def parse(
        cls, loss_type, beta, epsilon_low, epsilon_high, importance_sampling_level,
        max_completion_length,
    ) -> GRPOOptions:  # fmt: skip
        loss_type = parse(LossType, "loss_type", loss_type)
        level = parse(Level, "importance_sampling_level", importance_sampling_level)
        beta = check.positive("beta", beta, allow_zero=True)
        low = check.unit_fraction(
            "epsilon_low", epsilon_low, "the lower clip bound 1 − epsilon_low must stay > 0"
        )
        high = check.positive("epsilon_high", epsilon_high, allow_zero=True)
        if max_completion_length is not None:
            check.positive_int("max_completion_length", max_completion_length)
        return cls(loss_type, beta, low, high, level, max_completion_length)


@dataclass(frozen=True)
class GIFTOptions:
    num_generations: int
    beta: float
    eps: float = 1e-4
    unbiased: bool = True
    detach_stats: bool = False

    @classmethod
    def parse(cls, num_generations, beta, eps, unbiased, detach_stats) -> GIFTOptions:
        check.positive_int("num_generations", num_generations)
        return cls(
            num_generations,
            check.positive("beta", beta, allow_zero=True),
            check.positive("eps", eps, allow_zero=True),
            bool(unbiased),
            bool(detach_stats),
        )


@dataclass(frozen=True)
class FDOOptions:
    divergence: Divergence
    beta: float

    @classmethod
    def parse(cls, divergence, beta) -> FDOOptions:
        return cls(get_divergence(divergence), check.positive("beta", beta, allow_zero=True))


def mixing_weight(lam) -> float:
    """f-HAL's λ in [0, 1]."""
    check.real("lam", lam)
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam: expected a number in [0, 1]; got {lam!r}")
    return float(lam)
