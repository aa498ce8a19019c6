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
from .policy_terms import Objective


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
    """TRL's / Liger's `loss_type`: a policy term (`Objective`) and a normaliser."""

    GRPO = 0
    BNPO = 1
    DR_GRPO = 2
    DAPO = 3
    LUSPO = 4
    CISPO = 5
    SAPO = 6
    VESPO = 7


class Normaliser(enum.IntEnum):
    """n_i such that loss = Σ_i n_i Σ_t mask·pt (`grpo_math.row_scale`)."""

    ROW_MEAN = 0  # 1/(B·max(L_i, 1))
    TOKENS = 1  # 1/max(Σ mask, 1)
    CONSTANT = 2  # 1/(B·max_completion_length), default T
    ITEMS = 3  # 1/max(num_items_in_batch or Σ mask, 1)
    ROWS = 4  # 1/B


@dataclass(frozen=True)
class LossTypeSpec:
    """What a loss type is made of. `params` are its own options with TRL's defaults; they
    may only be set for this loss type. `token_level_only`: no sequence-level ratio."""

    objective: Objective
    normaliser: Normaliser
    token_level_only: bool = False
    params: tuple[tuple[str, float], ...] = ()


LOSS_TYPE_SPECS: dict[LossType, LossTypeSpec] = {
    LossType.GRPO: LossTypeSpec(Objective.CLIPPED, Normaliser.ROW_MEAN),
    LossType.BNPO: LossTypeSpec(Objective.CLIPPED, Normaliser.TOKENS),
    LossType.DR_GRPO: LossTypeSpec(Objective.CLIPPED, Normaliser.CONSTANT),
    LossType.DAPO: LossTypeSpec(Objective.CLIPPED, Normaliser.ITEMS),
    LossType.LUSPO: LossTypeSpec(Objective.CLIPPED, Normaliser.ROWS),
    LossType.CISPO: LossTypeSpec(Objective.CISPO, Normaliser.ITEMS, token_level_only=True),
    LossType.SAPO: LossTypeSpec(
        Objective.SAPO,
        Normaliser.ROW_MEAN,
        token_level_only=True,
        params=(("sapo_temperature_pos", 1.0), ("sapo_temperature_neg", 1.05)),
    ),
    LossType.VESPO: LossTypeSpec(
        Objective.VESPO,
        Normaliser.ITEMS,
        token_level_only=True,
        params=(
            ("vespo_k_pos", 2.0),
            ("vespo_lambda_pos", 3.0),
            ("vespo_k_neg", 3.0),
            ("vespo_lambda_neg", 2.0),
        ),
    ),
}
# The names of the loss types' own parameters.
LOSS_TYPE_PARAMS = {name for spec in LOSS_TYPE_SPECS.values() for name, _ in spec.params}
# The GRPO family's options beyond TRL's core five, each with its "off" value.
GRPO_OPTIONS = {
    "delta": None,
    "clip_ratio_c": None,
    "use_bias_correction_kl": False,
    "entropy_coef": 0.0,
    "top_entropy_quantile": 1.0,
    "off_policy_mask_threshold": None,
}


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
    entropy_coef: float = 0.0

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
        entropy_coef=0.0,
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
            entropy_coef=check.real("entropy_coef", entropy_coef),
        )


@dataclass(frozen=True)
class GRPOOptions:
    """The GRPO family's options (TRL's GRPOConfig / Liger's LigerFusedLinearGRPOLoss names).

    delta: cap of the unclipped ratio (INTELLECT-2); clip_ratio_c: verl's dual clip, the cost
    of a token with a < 0 at most −a·c; use_bias_correction_kl: the k3 term times the
    unclipped ratio; entropy_coef: c of the bonus −c·(masked mean entropy);
    top_entropy_quantile: the policy term only on the top-q entropy tokens;
    off_policy_mask_threshold: drop sequences with a < 0 whose mean (sampling − current)
    log-prob exceeds it. The sapo_* / vespo_* fields are those loss types' own parameters.
    kl_penalty: the β term's estimator, a `kl_estimators.KLPenalty` (None: k3, TRL's, which the
    Triton epilogue computes in-kernel; any other runs the epilogue in PyTorch).
    """

    loss_type: LossType
    beta: float
    epsilon_low: float
    epsilon_high: float
    level: Level
    max_completion_length: int | None = None
    delta: float | None = None
    clip_ratio_c: float | None = None
    use_bias_correction_kl: bool = False
    entropy_coef: float = 0.0
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    kl_penalty: object = None

    @property
    def spec(self) -> LossTypeSpec:
        return LOSS_TYPE_SPECS[self.loss_type]

    @property
    def objective(self) -> Objective:
        return self.spec.objective

    @property
    def entropy_mask(self) -> bool:
        """Whether the policy term is restricted to high-entropy tokens."""
        return self.top_entropy_quantile < 1.0

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_mask or self.entropy_coef != 0.0

    @classmethod
    def parse(
        cls,
        loss_type,
        beta,
        epsilon_low,
        epsilon_high,
        importance_sampling_level,
        max_completion_length,
        **options,
    ) -> GRPOOptions:
        """Validate every option once. `options` are GRPO_OPTIONS (absent: off) and the loss
        types' own parameters (sapo_temperature_pos, ..., vespo_lambda_neg; None or absent: the
        loss type's default; set for another loss type: a ValueError naming it)."""
        options = dict(options)
        kl_penalty = _kl_penalty(options.pop("kl_penalty", None), options)
        for arg in options:
            if arg not in GRPO_OPTIONS and arg not in LOSS_TYPE_PARAMS:
                raise TypeError(f"{arg}: not an option of the GRPO family")
        params = {k: v for k, v in options.items() if k in LOSS_TYPE_PARAMS}
        (
            delta,
            clip_ratio_c,
            use_bias_correction_kl,
            entropy_coef,
            top_entropy_quantile,
            off_policy_mask_threshold,
        ) = (options.get(k, off) for k, off in GRPO_OPTIONS.items())
        loss_type = parse(LossType, "loss_type", loss_type)
        spec = LOSS_TYPE_SPECS[loss_type]
        level = parse(Level, "importance_sampling_level", importance_sampling_level)
        if level == Level.SEQUENCE and spec.token_level_only:
            raise ValueError(
                "importance_sampling_level: Sequence-level importance sampling is not supported "
                f"for loss_type={name_of(loss_type)!r}; expected 'token'"
            )
        beta = check.positive("beta", beta, allow_zero=True)
        low = check.unit_fraction(
            "epsilon_low", epsilon_low, "the lower clip bound 1 − epsilon_low must stay > 0"
        )
        high = check.positive("epsilon_high", epsilon_high, allow_zero=True)
        if max_completion_length is not None:
            check.positive_int("max_completion_length", max_completion_length)
        delta, clip_ratio_c = _clip_options(delta, clip_ratio_c, spec, loss_type)
        quantile = check.real("top_entropy_quantile", top_entropy_quantile)
        if not 0.0 <= quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile: expected a number in [0, 1]; got {quantile!r}")
        if off_policy_mask_threshold is not None:
            off_policy_mask_threshold = check.real(
                "off_policy_mask_threshold", off_policy_mask_threshold
            )
        values = _loss_type_params(params, spec, loss_type)
        return cls(
            loss_type, beta, low, high, level, max_completion_length, delta, clip_ratio_c,
            bool(use_bias_correction_kl), check.real("entropy_coef", entropy_coef), quantile,
            off_policy_mask_threshold, **values, kl_penalty=kl_penalty,
        )  # fmt: skip


def _clip_options(delta, clip_ratio_c, spec: LossTypeSpec, loss_type) -> tuple:
    """(delta, clip_ratio_c) checked: the clipped loss types only, delta > 0, c > 1."""
    clipped_only = {"delta": delta, "clip_ratio_c": clip_ratio_c}
    for arg, value in clipped_only.items():
        if value is not None and spec.objective != Objective.CLIPPED:
            raise ValueError(
                f"{arg}: applies to the clipped loss types (grpo, bnpo, dr_grpo, dapo, "
                f"luspo) only; got {value!r} with loss_type={name_of(loss_type)!r}"
            )
    if delta is not None:
        delta = check.positive("delta", delta)
    if clip_ratio_c is not None:
        clip_ratio_c = check.real("clip_ratio_c", clip_ratio_c)
        if clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c: expected a number > 1; got {clip_ratio_c!r}")
    return delta, clip_ratio_c


def _loss_type_params(params: dict, spec: LossTypeSpec, loss_type) -> dict:
    """The loss types' own parameters that are set, checked (None: the loss type's default;
    set for another loss type: a ValueError naming it)."""
    values = {}
    for arg, value in params.items():
        if value is None:
            continue
        if arg not in dict(spec.params):
            raise ValueError(
                f"{arg}: applies to loss_type={arg.split('_')[0]!r} only; got {value!r} "
                f"with loss_type={name_of(loss_type)!r}"
            )
        if arg.startswith("sapo") or "lambda" in arg:
            values[arg] = check.positive(arg, value)
        else:
            values[arg] = check.real(arg, value)
    return values


def _kl_penalty(name, options: dict):
    """None for k3 (the default), else a `kl_estimators.KLPenalty`, parsed by the caller (this
    module sits below kl_estimators); bias correction is defined for k3 only."""
    if name is None:  # k3
        return None
    if isinstance(name, str):
        raise TypeError(
            "kl_penalty: GRPOOptions.parse takes a parsed KLPenalty; pass the options through "
            "kl_estimators.with_parsed_penalty first"
        )
    penalty = name
    if options.get("use_bias_correction_kl"):
        raise ValueError(
            f"kl_penalty: use_bias_correction_kl corrects the k3 estimate only; got "
            f"kl_penalty={penalty.name!r} with use_bias_correction_kl=True"
        )
    return penalty


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
