"""KL estimators per token: one table, selected by name (SPEC-variants §5).

d = logp − ref per token (0 where masked, so every estimator costs 0 there):
    k1 = d    abs = |d|    k2 = ½·d²    k3 = e^x − x − 1, x = −d (e^x saturating at x = 80)
    low_var_kl = clamp(e^x − x − 1, −10, 10), x = clamp(−d, −20, 20)
k3 is the GRPO losses' β·k3 (TRL's; `grpo_math.k3` gives the same values); verl's "k3" and
"low_var_kl" are low_var_kl. A "+" name (e.g. "k3+") keeps the named estimator's value and
takes the gradient of k2 (verl's straight-through form). OpenRLHF's `compute_approx_kl` clamps
k1, k2 and k3 to [−10, 10] and computes in fp32.

Sources: verl 0.9.1 `core_algos.kl_penalty` / `kl_penalty_forward`; OpenRLHF v0.11.0
(commit 3c3be6234e0cb353e76bb8019947db9dfe99fca7) `openrlhf/models/utils.compute_approx_kl`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from .divergences import sat_exp
from .options import name_of
from .validation import choice, positive, tensor

LOW_VAR_KL_LOG_BOUND = 20.0  # verl clamps ref − logp to ±20 ...
LOW_VAR_KL_VALUE_BOUND = 10.0  # ... and the estimate to ±10
OPENRLHF_VALUE_BOUND = 10.0


class KLEstimator(enum.IntEnum):
    K1 = 0
    ABS = 1
    K2 = 2
    K3 = 3
    LOW_VAR_KL = 4


# Each source's spellings (without the "+" suffix) -> the estimator; "+" is verl's and ours.
SPELLINGS: dict[str, dict[str, KLEstimator]] = {
    "fgrpo": {name_of(e): e for e in KLEstimator},
    "verl": {
        "kl": KLEstimator.K1,
        "k1": KLEstimator.K1,
        "abs": KLEstimator.ABS,
        "mse": KLEstimator.K2,
        "k2": KLEstimator.K2,
        "low_var_kl": KLEstimator.LOW_VAR_KL,
        "k3": KLEstimator.LOW_VAR_KL,
    },
    "openrlhf": {"k1": KLEstimator.K1, "k2": KLEstimator.K2, "k3": KLEstimator.K3},
}
SOURCES = tuple(SPELLINGS)
STRAIGHT_THROUGH_SOURCES = ("fgrpo", "verl")


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _value(estimator: KLEstimator, d: torch.Tensor) -> torch.Tensor:
    if estimator == KLEstimator.K1:
        return d
    if estimator == KLEstimator.ABS:
        return d.abs()
    if estimator == KLEstimator.K2:
        return 0.5 * d.square()
    x = -d
    if estimator == KLEstimator.K3:
        return sat_exp(x) - x - 1.0
    x = x.clamp(-LOW_VAR_KL_LOG_BOUND, LOW_VAR_KL_LOG_BOUND)
    return (torch.exp(x) - x - 1.0).clamp(-LOW_VAR_KL_VALUE_BOUND, LOW_VAR_KL_VALUE_BOUND)


@dataclass(frozen=True)
class KLPenalty:
    """One per-token KL estimate: `estimator`'s value (clamped to ±value_bound when set), with
    k2's gradient when `k2_gradient` (the "+" forms); `fp32` computes fp16/bf16 inputs in fp32
    (OpenRLHF's `.float()`; fp64 stays fp64).
    Build it with `KLPenalty.parse(name, source)`; the default is k3."""

    estimator: KLEstimator = KLEstimator.K3
    k2_gradient: bool = False
    value_bound: float | None = None
    fp32: bool = False

    def __post_init__(self):
        if not isinstance(self.estimator, KLEstimator):
            raise TypeError(f"estimator: expected a KLEstimator; got {self.estimator!r}")
        if self.value_bound is not None:
            positive("value_bound", self.value_bound)

    @classmethod
    def parse(cls, name="k3", source: str = "fgrpo") -> KLPenalty:
        """`name` in `source`'s spelling ("fgrpo": k1, abs, k2, k3, low_var_kl; "verl": kl, k1,
        abs, mse, k2, low_var_kl, k3; "openrlhf": k1, k2, k3), with a "+" suffix for k2's
        gradient under fgrpo and verl. A KLPenalty passes through."""
        if isinstance(name, KLPenalty):
            return name
        choice("source", source, SOURCES)
        table = SPELLINGS[source]
        plus = source in STRAIGHT_THROUGH_SOURCES
        valid = [*table, *(f"{n}+" for n in table if plus)]
        arg = "kl_estimator" if source == "openrlhf" else "kl_penalty"
        choice(arg, name, valid)
        estimator = table[name.removesuffix("+")]
        openrlhf = source == "openrlhf"
        return cls(
            estimator=estimator,
            k2_gradient=name.endswith("+") and estimator != KLEstimator.K2,
            value_bound=OPENRLHF_VALUE_BOUND if openrlhf else None,
            fp32=openrlhf,
        )

    @property
    def name(self) -> str:
        return name_of(self.estimator) + ("+" if self.k2_gradient else "")

    def __call__(self, logp: torch.Tensor, ref: torch.Tensor, mask=None) -> torch.Tensor:
        """The estimate per token [B, T] (any float dtype, differentiable in logp and ref),
        0 where `mask` (optional, same shape) is 0."""
        tensor("logp", logp, floating=True)
        tensor("ref", ref, shape=tuple(logp.shape), floating=True)
        if self.fp32:
            logp, ref = _at_least_fp32(logp), _at_least_fp32(ref)
        d = logp - ref
        if mask is not None:
            tensor("mask", mask, shape=tuple(logp.shape))
            d = torch.where(mask.bool(), d, 0.0)
        value = _value(self.estimator, d)
        if self.value_bound is not None:
            value = value.clamp(-self.value_bound, self.value_bound)
        if not self.k2_gradient:
            return value
        # NB: verl's order, so the value is the named estimator's bit for bit.
        k2 = 0.5 * d.square()
        return k2 - k2.detach() + value.detach()


def with_parsed_penalty(options: dict) -> dict:
    """GRPO-family options with a `kl_penalty` name parsed (None for plain k3, the default and
    the one the Triton epilogue computes), as `GRPOOptions.parse` takes it."""
    if options.get("kl_penalty") is None:
        return options
    penalty = KLPenalty.parse(options["kl_penalty"])
    plain_k3 = penalty == KLPenalty()
    return {**options, "kl_penalty": None if plain_k3 else penalty}


def kl_estimate(logp, ref, estimator="k3", mask=None, source: str = "fgrpo") -> torch.Tensor:
    """`KLPenalty.parse(estimator, source)(logp, ref, mask)`: the per-token KL estimate [B, T]."""
    return KLPenalty.parse(estimator, source)(logp, ref, mask)


ESTIMATORS = tuple(SPELLINGS["fgrpo"])
