"""Rollout correction: one option set, shared by every loss, for a sampler that is not the
trainer (SPEC-variants §4). Plain PyTorch, any float dtype, no triton; tensors are [B, T].

Per token log ρ = old − mu (logp − mu in verl's bypass mode), detached; x = clamp(log ρ, ±20)
(verl's safety bound; OpenRLHF and TRL have none: then only e^· saturates, at the dtype's max).
  IS weights w (× mask): token  w = e^x;  sequence  w = exp(clamp(Σ_t m·log ρ, ±20)), then
    truncate  clamp(w, lo, hi) (TIS; verl has no lo)  |  mask  w·1[lo ≤ w ≤ hi] (IcePop)  |  none,
    and optionally w / mean(w) (the batch mean over tokens, or over sequences at sequence level).
  Rejection (verl): a statistic of k1 = −x, k2 = ½x², k3 = e^x − 1 − x per token (token) or its
    masked sum / mean / max per sequence; k1 keeps log lo ≤ s ≤ log hi, k2 and k3 keep s ≤ hi.
    A list is ANDed; rejected tokens leave the mask. A weight filter (OpenRLHF's seq-mask-tis)
    tests the same way but zeroes the weights and keeps the mask (the loss's denominator).
Sources: verl 0.9.1 `trainer/ppo/rollout_corr_helper.py` and `RolloutCorrectionConfig`;
OpenRLHF v0.11.0 (3c3be6234e0cb353e76bb8019947db9dfe99fca7) `models/loss.PolicyLoss`; TRL 1.16
`GRPOTrainer` (`vllm_importance_sampling_*`). `RolloutCorrection.parse` takes each one's names.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace

import torch

from . import rollout_sources as sources
from .options import Level, name_of, names, parse
from .rollout_sources import saturating_exp as _exp
from .validation import choice, positive, tensor

SAFETY_BOUND = 20.0  # verl: exp(±20) bounds every weight and statistic
MEAN_EPS = 1e-8  # verl's masked mean: Σ m·v / (Σ m + 1e-8)


class Bound(enum.IntEnum):
    NONE = 0
    TRUNCATE = 1  # TIS: clamp into [lower, upper]
    MASK = 2  # IcePop: zero outside [lower, upper]


class Agg(enum.IntEnum):
    TOKEN = 0
    SEQ_SUM = 1
    SEQ_MEAN = 2
    SEQ_MAX = 3


class Stat(enum.IntEnum):
    K1 = 0
    K2 = 1
    K3 = 2


class Source(enum.IntEnum):
    """Whose metric names the metrics take."""

    VERL = 0
    OPENRLHF = 1
    TRL = 2


REJECTION_MODES = tuple(
    f"{a}_{s}" for a in names(Agg) for s in names(Stat) if (a, s) != ("seq_max", "k1")
)


def _bounded(v: torch.Tensor, bound: float | None) -> torch.Tensor:
    return v if bound is None else v.clamp(-bound, bound)


def _masked_sum(v, m, dim=None, keepdim=False):
    return (torch.where(m > 0, v, 0.0) * m).sum(dim=dim, keepdim=keepdim)


def _masked_mean(v, m, dim=None, keepdim=False):
    return _masked_sum(v, m, dim, keepdim) / (m.sum(dim=dim, keepdim=keepdim) + MEAN_EPS)


def _masked_extreme(v, mb, largest: bool, dim=None, keepdim=False):
    """Max (min) of v over mb, 0 where mb holds nothing."""
    if v.numel() == 0:
        return v.new_zeros(()) if dim is None else v.sum(dim=dim, keepdim=keepdim)
    fill = float("-inf") if largest else float("inf")
    held = torch.where(mb, v, fill)
    out = held.amax(dim, keepdim) if largest else held.amin(dim, keepdim)
    return torch.where(mb.any(dim, keepdim) if dim is not None else mb.any(), out, 0.0)


def _positive_or_none(arg: str, value) -> float | None:
    return None if value is None else positive(arg, value)


@dataclass(frozen=True)
class Rejection:
    """One rejection test, `name` = f"{agg}_{stat}" (verl's rollout_rs option). k1 keeps
    log(lower) ≤ s ≤ log(upper) (verl's ratio bounds: the geometric ρ in [1/upper, 1/lower]);
    k2 and k3 keep s ≤ upper."""

    agg: Agg
    stat: Stat
    upper: float
    lower: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "agg", parse(Agg, "agg", self.agg))
        object.__setattr__(self, "stat", parse(Stat, "stat", self.stat))
        choice("rollout_rs", self.name, REJECTION_MODES)
        upper = positive(f"{self.name} upper threshold", self.upper)
        lower = _positive_or_none(f"{self.name} lower threshold", self.lower)
        if self.stat == Stat.K1:
            if lower is None or lower > upper:
                raise ValueError(
                    f"{self.name} thresholds: k1 needs lower <= upper; got {lower!r}_{upper!r}"
                )
        elif lower is not None:
            raise ValueError(f"{self.name} thresholds: only k1 takes a lower bound; got {lower!r}")
        object.__setattr__(self, "upper", upper)
        object.__setattr__(self, "lower", lower)

    @property
    def name(self) -> str:
        return f"{name_of(self.agg)}_{name_of(self.stat)}"

    @classmethod
    def of(cls, test) -> Rejection:
        """A Rejection, or one from (verl's mode name, lower, upper)."""
        if isinstance(test, Rejection):
            return test
        if not isinstance(test, tuple) or len(test) != 3 or not isinstance(test[0], str):
            raise TypeError(f"rollout_rs: expected a Rejection or (mode, lower, upper); got {test}")
        name, lower, upper = test
        agg, _, stat = choice("rollout_rs", name, REJECTION_MODES).rpartition("_")
        return cls(agg, stat, upper, lower)

    def statistic(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """The statistic per token [B, T] or per sequence [B, 1] of the bounded log ρ x."""
        if self.stat == Stat.K1:
            t = -x
        elif self.stat == Stat.K2:
            t = 0.5 * x.square()
        else:
            t = _exp(x) - 1.0 - x
        if self.agg == Agg.TOKEN:
            return t
        if self.agg == Agg.SEQ_SUM:
            return _masked_sum(t, m, -1, True)
        if self.agg == Agg.SEQ_MEAN:
            return _masked_mean(t, m, -1, True)
        return _masked_extreme(t, m > 0, True, -1, True)

    def keep(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """Which tokens pass, bool [B, T]."""
        s = self.statistic(x, m)
        if self.stat == Stat.K1:
            ok = (s >= math.log(self.lower)) & (s <= math.log(self.upper))
        else:
            ok = s <= self.upper
        return ok.expand_as(x)


@dataclass(frozen=True)
class RolloutCorrection:
    """Every rollout-correction option, validated once (strings accepted for the enums).

    level: IS weights per token or per sequence, None for none; bound, lower, upper: what
    happens to w outside [lower, upper] (None: unbounded that side); batch_normalize: w / its
    batch mean; rejection / weight_filter: Rejection tests ANDed into the mask / the weights;
    bypass: log ρ = logp − mu (verl's bypass mode); log_ratio_bound: the clamp of log ρ (None:
    none); loss_type: verl's bypass loss ("ppo_clip" does not apply the weights, the ratio
    already holds them); source: whose metric names are returned. Build from a source's names
    with `RolloutCorrection.parse(**kwargs)`."""

    level: Level | None = None
    bound: Bound = Bound.TRUNCATE
    lower: float | None = None
    upper: float | None = 2.0
    batch_normalize: bool = False
    rejection: tuple[Rejection, ...] = ()
    weight_filter: tuple[Rejection, ...] = ()
    bypass: bool = False
    log_ratio_bound: float | None = SAFETY_BOUND
    loss_type: str = "ppo_clip"
    source: Source = Source.VERL

    def __post_init__(self):
        set_ = object.__setattr__
        if self.level is not None:
            set_(self, "level", parse(Level, "level", self.level))
        set_(self, "bound", parse(Bound, "bound", self.bound))
        set_(self, "source", parse(Source, "source", self.source))
        set_(self, "lower", _positive_or_none("lower", self.lower))
        set_(self, "upper", _positive_or_none("upper", self.upper))
        if self.lower is not None and self.upper is not None and self.lower > self.upper:
            raise ValueError(
                f"lower: the IS bounds need lower <= upper; got {self.lower!r} > {self.upper!r}"
            )
        set_(self, "log_ratio_bound", _positive_or_none("log_ratio_bound", self.log_ratio_bound))
        for arg in ("rejection", "weight_filter"):
            set_(self, arg, tuple(map(Rejection.of, getattr(self, arg))))
        choice("loss_type", self.loss_type, sources.VERL_LOSS_TYPES)
        for arg in ("batch_normalize", "bypass"):
            if not isinstance(getattr(self, arg), bool):
                raise TypeError(f"{arg}: expected a bool; got {getattr(self, arg)!r}")

    @classmethod
    def parse(cls, **kwargs) -> RolloutCorrection:
        """The option set from one source's names: verl (rollout_is, rollout_is_threshold,
        rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold, bypass_mode, loss_type,
        preset: a verl factory name or geo_rs / k3_rs / seq_rs / icepop), OpenRLHF
        (enable_vllm_is_correction, vllm_is_truncated_threshold, vllm_is_correction_type, or the
        CLI's is_correction_enable / _threshold / _type), TRL (vllm_importance_sampling_correction,
        _mode, _clip_min, _clip_max, _cap), or this class's own field names."""
        return cls(**sources.canonical(kwargs, set(cls.__dataclass_fields__)))

    @property
    def applies_weights(self) -> bool:
        return self.level is not None and not (self.bypass and self.loss_type == "ppo_clip")

    def with_source(self, source) -> RolloutCorrection:
        return replace(self, source=source)


def _is_ratio(log_rho, m, opts: RolloutCorrection):
    """(ρ after the bounds, unmasked [B, T] or [B, 1]; raw ρ; Σ m·log ρ per row or None)."""
    seq = _masked_sum(log_rho, m, -1, True) if opts.level == Level.SEQUENCE else None
    raw = _exp(_bounded(log_rho if seq is None else seq, opts.log_ratio_bound))
    lo, hi = opts.lower, opts.upper
    if opts.bound == Bound.TRUNCATE and (lo is not None or hi is not None):
        ratio = raw.clamp(min=lo, max=hi)
    elif opts.bound == Bound.MASK:
        inside = torch.ones_like(raw, dtype=torch.bool)
        inside = inside if lo is None else inside & (raw >= lo)
        inside = inside if hi is None else inside & (raw <= hi)
        ratio = torch.where(inside, raw, 0.0)
    else:
        ratio = raw
    return ratio, raw, seq


def _batch_mean(w, m, mb, level: Level):
    """verl's batch mean of the weights: over tokens, or over valid sequences' means."""
    if level == Level.TOKEN:
        return _masked_mean(w, m)
    valid = mb.any(-1).to(w.dtype)
    return (_masked_mean(w, m, -1) * valid).sum() / valid.sum().clamp_min(MEAN_EPS)


def rollout_correction(logp, old_logp, rollout_logp, mask, options=None):
    """(weights [B, T], mask [B, T], metrics) for log-probs logp, old_logp and rollout_logp
    [B, T] (old_logp may be None in bypass mode) and a 0/1 mask [B, T], under `options` (a
    RolloutCorrection, a dict of a source's names, or None for no correction).

    weights: detached, 0 where masked, the mask's 1 where no weight applies; the loss multiplies
    each token's term by it. mask: `mask` less the rejected tokens, in mask's dtype. metrics:
    detached 0-d tensors under the source's names (see `rollout_sources.metrics`)."""
    opts = _options(options)
    tensor("logp", logp, ndim=2, floating=True)
    shape = tuple(logp.shape)
    tensor("rollout_logp", rollout_logp, shape=shape, floating=True)
    tensor("mask", mask, shape=shape)
    base = logp if opts.bypass else old_logp
    if base is None:
        raise ValueError("old_logp: required unless bypass (verl's bypass_mode) is set")
    tensor("old_logp" if not opts.bypass else "logp", base, shape=shape, floating=True)
    log_rho = base.detach() - rollout_logp.detach()
    m = mask.to(log_rho.dtype)
    mb = m > 0
    x = _bounded(log_rho, opts.log_ratio_bound)
    weights, ratio, raw, seq, factor = m, None, None, None, None
    if opts.level is not None:
        ratio, raw, seq = _is_ratio(log_rho, m, opts)
        weights = ratio.expand_as(m) * m
    for test in opts.weight_filter:
        weights = torch.where(test.keep(x, m), weights, 0.0)
    pre_norm = weights
    if opts.level is not None and opts.batch_normalize:
        mean = _batch_mean(weights, m, mb, opts.level)
        factor = torch.where(mean > MEAN_EPS, mean, torch.ones_like(mean))
        weights = weights / factor
    keeps = [test.keep(x, m) for test in opts.rejection]
    kept = torch.ones_like(mb)
    for k in keeps:
        kept = kept & k
    new_mask = torch.where(kept, mask, torch.zeros_like(mask))
    state = _State(
        log_rho,
        base.detach(),
        rollout_logp.detach(),
        m,
        mb,
        pre_norm,
        ratio,
        raw,
        seq,
        factor,
        keeps,
        kept,
    )
    metrics = sources.metrics(opts, state)
    return (weights if opts.applies_weights else m), new_mask, metrics


def _options(options) -> RolloutCorrection:
    if options is None:
        return RolloutCorrection()
    if isinstance(options, dict):
        return RolloutCorrection.parse(**options)
    if not isinstance(options, RolloutCorrection):
        raise TypeError(f"options: expected a RolloutCorrection or a dict; got {options!r}")
    return options


@dataclass
class _State:
    log_rho: torch.Tensor
    base: torch.Tensor
    mu: torch.Tensor
    m: torch.Tensor
    mb: torch.Tensor
    weights: torch.Tensor
    ratio: torch.Tensor | None
    raw: torch.Tensor | None
    seq: torch.Tensor | None
    factor: torch.Tensor | None
    keeps: list
    kept: torch.Tensor
