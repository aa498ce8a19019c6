"""Each source's rollout-correction names: verl's, OpenRLHF's and TRL's option spellings mapped
to `RolloutCorrection`'s fields (`canonical`), and the metrics under each one's names
(`metrics`). Only strings and tensors here; rollout_correction.py validates the result."""

from __future__ import annotations

import math

import torch

from .options import Level
from .validation import choice, positive

VERL_LOSS_TYPES = ("ppo_clip", "reinforce")
VERL_IS_LEVELS = ("token", "sequence")
OPENRLHF_TYPES = ("tis", "icepop", "seq-mask-tis")
OPENRLHF_THRESHOLD = (0.5, 5.0)  # the CLI's --algo.advantage.is_correction_threshold default
OPENRLHF_PREFIX = "algo.advantage."
TRL_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

# verl's RolloutCorrectionConfig factories (and the SPEC's short names), in verl's spelling.
_GEO = {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"}
_K3 = {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01}
_SEQ_RS = {"rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.5_2.0"}
_TOK = {"rollout_is": "token", "rollout_is_threshold": 2.0}
_SEQ = {"rollout_is": "sequence", "rollout_is_threshold": 2.0}
_ICEPOP = {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"}
_PPO = {"bypass_mode": True, "loss_type": "ppo_clip"}
_PG = {"bypass_mode": True, "loss_type": "reinforce"}
PRESETS: dict[str, dict] = {
    "disabled": {},
    "geo_rs": _GEO,
    "k3_rs": _K3,
    "seq_rs": _SEQ_RS,
    "icepop": _ICEPOP,
    "decoupled_token_is": _TOK,
    "decoupled_seq_is": _SEQ,
    "decoupled_token_icepop": _ICEPOP,
    "decoupled_seq_is_rs": {**_SEQ, **_SEQ_RS},
    "decoupled_geo_rs": _GEO,
    "decoupled_geo_rs_seq_tis": {**_SEQ, **_GEO},
    "decoupled_geo_rs_token_tis": {**_TOK, **_GEO},
    "decoupled_k3_rs": _K3,
    "decoupled_k3_rs_seq_tis": {**_SEQ, **_K3},
    "decoupled_k3_rs_token_tis": {**_TOK, **_K3},
    "bypass_ppo_clip": _PPO,
    "bypass_ppo_clip_geo_rs": {**_PPO, **_GEO},
    "bypass_ppo_clip_k3_rs": {**_PPO, **_K3},
    "bypass_pg_is": {**_PG, **_SEQ},
    "bypass_pg_token_icepop": {**_PG, **_ICEPOP},
    "bypass_pg_geo_rs": {**_PG, **_GEO},
    "bypass_pg_geo_rs_seq_tis": {**_PG, **_SEQ, **_GEO},
    "bypass_pg_geo_rs_token_tis": {**_PG, **_TOK, **_GEO},
}

VERL_NAMES = (
    "rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
    "rollout_rs_threshold", "bypass_mode", "loss_type", "preset",
)  # fmt: skip
# OpenRLHF's PolicyLoss keywords -> its CLI's names (without the "algo.advantage." prefix).
OPENRLHF_NAMES = {
    "enable_vllm_is_correction": "is_correction_enable",
    "vllm_is_truncated_threshold": "is_correction_threshold",
    "vllm_is_correction_type": "is_correction_type",
}
TRL_NAMES = tuple(
    f"vllm_importance_sampling_{n}" for n in ("correction", "mode", "clip_min", "clip_max", "cap")
)


def _flag(arg: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{arg}: expected a bool; got {value!r}")
    return value


def _float(arg: str, text) -> float:
    try:
        return positive(arg, float(text) if isinstance(text, str) else text)
    except ValueError as e:
        raise ValueError(f"{arg}: expected a positive number; got {text!r}") from e


def _ordered(arg: str, lower: float, upper: float, spec) -> None:
    if lower > upper:
        raise ValueError(f"{arg}: expected lower <= upper; got {spec!r}")


def _verl_is(spec) -> dict:
    """rollout_is_threshold: a number (TIS upper) or "lower_upper" (IcePop)."""
    arg = "rollout_is_threshold"
    if isinstance(spec, str) and "_" in spec:
        lo, hi = (_float(arg, p) for p in spec.strip().split("_", 1))
        _ordered(arg, lo, hi, spec)
        return {"bound": "mask", "lower": lo, "upper": hi}
    if not isinstance(spec, (str, int, float)) or isinstance(spec, bool):
        raise TypeError(f"{arg}: expected a number or a 'lower_upper' string; got {spec!r}")
    return {"bound": "truncate", "lower": None, "upper": _float(arg, spec)}


def _verl_rs(modes, spec) -> tuple:
    """(name, lower, upper) per distinct comma-listed rollout_rs option, one threshold shared
    or one each; k1 takes "lower_upper" or u (lower = 1/u), the others a single upper."""
    if not isinstance(modes, str) or not modes.strip(", "):
        raise ValueError(f"rollout_rs: expected a comma-separated string of modes; got {modes!r}")
    options = list(dict.fromkeys(p.strip() for p in modes.split(",") if p.strip()))
    arg = "rollout_rs_threshold"
    if spec is None:
        raise ValueError(f"{arg}: required when rollout_rs is set")
    if isinstance(spec, bool) or not isinstance(spec, (str, int, float)):
        raise TypeError(f"{arg}: expected a number or a string; got {spec!r}")
    specs = [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"{arg}: expected 1 or {len(options)} thresholds; got {spec!r}")
    out = []
    for option, s in zip(options, specs * len(options) if len(specs) == 1 else specs):
        if option.endswith("k1"):
            lo_s, hi_s = s.split("_", 1) if "_" in s else (None, s)
            hi = _float(arg, hi_s)
            lo = 1.0 / hi if lo_s is None else _float(arg, lo_s)
            _ordered(arg, lo, hi, s)
        elif "_" in s:
            raise ValueError(f"{arg}: {option} takes a single upper bound; got {s!r}")
        else:
            lo, hi = None, _float(arg, s)
        out.append((option, lo, hi))
    return tuple(out)


def _verl(kw: dict) -> dict:
    preset = kw.pop("preset", None)
    if preset is not None:
        key = preset.lower().replace("-", "_") if isinstance(preset, str) else preset
        kw = {**PRESETS[choice("preset", key, PRESETS)], **kw}
    level = kw.get("rollout_is")
    out = {
        "source": "verl",
        "batch_normalize": _flag("rollout_is_batch_normalize",
                                 kw.get("rollout_is_batch_normalize", False)),
        "bypass": _flag("bypass_mode", kw.get("bypass_mode", False)),
        "loss_type": choice("loss_type", kw.get("loss_type", "ppo_clip"), VERL_LOSS_TYPES),
    }  # fmt: skip
    if level is not None:
        out["level"] = choice("rollout_is", level, VERL_IS_LEVELS)
        threshold = kw.get("rollout_is_threshold", 2.0)
        if threshold is None:
            raise ValueError("rollout_is_threshold: required when rollout_is is set")
        out.update(_verl_is(threshold))
    if kw.get("rollout_rs") is not None:
        out["rejection"] = _verl_rs(kw["rollout_rs"], kw.get("rollout_rs_threshold"))
    elif kw.get("rollout_rs_threshold") is not None:
        raise ValueError("rollout_rs_threshold: set without rollout_rs (a mode to test)")
    return out


def _openrlhf(kw: dict) -> dict:
    kw = {OPENRLHF_NAMES.get(k, k): v for k, v in kw.items()}
    if not _flag("enable_vllm_is_correction", kw.pop("is_correction_enable", False)):
        if kw:
            raise ValueError(
                f"enable_vllm_is_correction: {sorted(kw)} have no effect unless it is True"
            )
        return {"source": "openrlhf", "level": None}
    kind = choice("vllm_is_correction_type", kw.get("is_correction_type", "tis"), OPENRLHF_TYPES)
    bounds = kw.get("is_correction_threshold", OPENRLHF_THRESHOLD)
    arg = "vllm_is_truncated_threshold"
    if isinstance(bounds, (str, bytes)) or not hasattr(bounds, "__len__") or len(bounds) != 2:
        raise ValueError(f"{arg}: expected [low, high]; got {bounds!r}")
    lo, hi = (_float(arg, b) for b in bounds)
    _ordered(arg, lo, hi, bounds)
    out = {"source": "openrlhf", "level": "token", "log_ratio_bound": None}
    if kind == "seq-mask-tis":  # ρ unclipped; the geometric mean ρ in [lo, hi] as a k1 test
        return {**out, "bound": "none", "upper": None, "weight_filter": (
            ("seq_mean_k1", 1.0 / hi, 1.0 / lo),)}  # fmt: skip
    return {**out, "bound": "truncate" if kind == "tis" else "mask", "lower": lo, "upper": hi}


def _trl(kw: dict) -> dict:
    p = "vllm_importance_sampling_"
    if f"{p}cap" in kw:  # deprecated alias of clip_max
        if f"{p}clip_max" in kw:
            raise ValueError(f"{p}cap: deprecated alias of {p}clip_max; give one of them")
        kw[f"{p}clip_max"] = kw.pop(f"{p}cap")
    if not _flag(f"{p}correction", kw.get(f"{p}correction", True)):
        return {"source": "trl", "level": None}
    mode = choice(f"{p}mode", kw.get(f"{p}mode", "sequence_mask"), TRL_MODES)
    level, how = mode.split("_")
    bounds = {}
    for side, default in (("min", None), ("max", 3.0)):
        value = kw.get(f"{p}clip_{side}", default)
        bounds[side] = None if value is None else _float(f"{p}clip_{side}", value)
    if None not in bounds.values():
        _ordered(f"{p}clip_min", bounds["min"], bounds["max"], (bounds["min"], bounds["max"]))
    return {"source": "trl", "level": level, "bound": how, "lower": bounds["min"],
            "upper": bounds["max"], "log_ratio_bound": None}  # fmt: skip


def canonical(kwargs: dict, fields: set[str]) -> dict:
    """One source's option names -> RolloutCorrection's field names (a ValueError naming any
    unknown name, or names from two sources)."""
    families = {"verl": [], "openrlhf": [], "trl": [], "fields": []}
    for key in kwargs:
        bare = key.removeprefix(OPENRLHF_PREFIX)
        if key in VERL_NAMES:
            families["verl"].append(key)
        elif bare in OPENRLHF_NAMES or bare in OPENRLHF_NAMES.values():
            families["openrlhf"].append(key)
        elif key in TRL_NAMES:
            families["trl"].append(key)
        elif key in fields:
            families["fields"].append(key)
        else:
            known = [*VERL_NAMES, *OPENRLHF_NAMES, *OPENRLHF_NAMES.values(), *TRL_NAMES]
            raise ValueError(f"{key}: unknown option; expected one of {sorted(known + [*fields])}")
    used = {f: keys for f, keys in families.items() if keys}
    if len(used) > 1:
        raise ValueError(f"{next(iter(kwargs))}: names from several sources {used}; use one's")
    if not used or "fields" in used:
        return dict(kwargs)
    family = next(iter(used))
    kw = {k.removeprefix(OPENRLHF_PREFIX): v for k, v in kwargs.items()}
    if family == "openrlhf" and len({OPENRLHF_NAMES.get(k, k) for k in kw}) < len(kw):
        raise ValueError(f"{sorted(kw)}: an OpenRLHF option given under both of its names")
    return {"verl": _verl, "openrlhf": _openrlhf, "trl": _trl}[family](kw)


# ---- metrics, under each source's names ----------------------------------------------------


def saturating_exp(v: torch.Tensor) -> torch.Tensor:
    """e^v, saturating below the dtype's largest finite value (finite for finite v)."""
    return torch.exp(v.clamp(max=math.floor(math.log(torch.finfo(v.dtype).max))))


def _mean(v, m):  # verl's masked mean
    return (torch.where(m > 0, v, 0.0) * m).sum() / (m.sum() + 1e-8)


def _fraction(b: torch.Tensor, dtype) -> torch.Tensor:
    """The share of True in b, 0 for an empty b."""
    return b.to(dtype).sum() / max(b.numel(), 1)


def _extreme(v, mb, largest: bool):
    """Max (min) of v over mb, 0 when mb holds nothing."""
    if v.numel() == 0:
        return v.new_zeros(())
    held = torch.where(mb, v, float("-inf") if largest else float("inf"))
    return torch.where(mb.any(), held.amax() if largest else held.amin(), 0.0)


def _verl_is_metrics(opts, s) -> dict:
    out = {"rollout_is_mean": _mean(s.weights, s.m)}
    hi, bound = opts.upper, opts.log_ratio_bound
    lo = opts.lower if opts.lower is not None else (None if hi is None else 1.0 / hi)
    if opts.level == Level.SEQUENCE:
        rows = s.seq.squeeze(-1)
        top = _extreme(rows, torch.ones_like(rows, dtype=torch.bool), True)
        low = _extreme(rows, torch.ones_like(rows, dtype=torch.bool), False)
        out["rollout_is_max"] = saturating_exp(top if bound is None else top.clamp(max=bound))
        out["rollout_is_min"] = torch.exp(low)
        if hi is not None:
            out["rollout_is_ratio_fraction_high"] = _fraction(rows > math.log(hi), rows.dtype)
            out["rollout_is_ratio_fraction_low"] = _fraction(rows < math.log(lo), rows.dtype)
    else:
        out["rollout_is_max"] = _extreme(s.weights, s.mb, True)
        out["rollout_is_min"] = _extreme(s.weights, s.mb, False)
        raw = s.raw
        if hi is not None:
            out["rollout_is_ratio_fraction_high"] = _mean((raw > hi).to(raw.dtype), s.m)
            out["rollout_is_ratio_fraction_low"] = _mean((raw < lo).to(raw.dtype), s.m)
    if opts.bound.name == "MASK":
        raw = s.raw.expand_as(s.m)
        oob = torch.zeros_like(s.mb)
        oob = oob if opts.lower is None else oob | (raw < opts.lower)
        oob = oob if hi is None else oob | (raw > hi)
        out["rollout_is_oob_ratio"] = _mean(oob.to(raw.dtype), s.m)
    if s.factor is not None:
        out["rollout_is_batch_norm_factor"] = s.factor
    return out


def _verl_rs_metrics(opts, s) -> dict:
    out, dtype, valid = {}, s.m.dtype, s.mb.any(-1)
    n_valid = valid.to(dtype).sum()
    for test, keep in zip(opts.rejection, s.keeps):
        rejected_row = (~keep & s.mb).any(-1) & valid
        out[f"rollout_rs_{test.name}_masked_fraction"] = _mean((~keep).to(dtype), s.m)
        out[f"rollout_rs_{test.name}_seq_masked_fraction"] = torch.where(
            n_valid > 0, rejected_row.to(dtype).sum() / n_valid.clamp(min=1.0), 0.0
        )
    out["rollout_rs_masked_fraction"] = _mean((~s.kept).to(dtype), s.m)
    out["rollout_rs_seq_masked_fraction"] = _fraction((~s.kept & s.mb).any(-1), dtype)
    return out


def _verl_metrics(opts, s) -> dict:
    out = _verl_is_metrics(opts, s) if opts.level is not None else {}
    if opts.rejection:
        out.update(_verl_rs_metrics(opts, s))
    lr = s.log_rho
    out["kl"] = _mean(-lr, s.m)
    out["k3_kl"] = _mean(saturating_exp(lr) - lr - 1.0, s.m)
    return {f"rollout_corr/{k}": v for k, v in out.items()}


def _openrlhf_metrics(opts, s) -> dict:
    if opts.level is None:
        return {}
    return {"vllm_kl": (-s.log_rho * s.m).sum() / s.m.sum().clamp(min=1.0)}


def _trl_metrics(opts, s) -> dict:
    if opts.level is None:
        return {}
    delta = s.log_rho.abs()
    out = {
        "sampling/sampling_logp_difference/mean": (delta * s.m).sum() / s.m.sum().clamp(min=1.0),
        "sampling/sampling_logp_difference/max": _extreme(delta, s.mb, True),
    }
    per_row = opts.level == Level.SEQUENCE
    ratio, held = (s.ratio, torch.ones_like(s.ratio, dtype=torch.bool)) if per_row else (
        s.weights, s.mb)  # fmt: skip
    count = held.to(ratio.dtype).sum().clamp(min=1.0)
    for name, value in (
        ("min", _extreme(ratio, held, False)),
        ("mean", torch.where(held, ratio, 0.0).sum() / count),
        ("max", _extreme(ratio, held, True)),
    ):
        out[f"sampling/importance_sampling_ratio/{name}"] = value
    return out


def metrics(opts, state) -> dict:
    """Detached 0-d tensors under `opts.source`'s names. verl (prefix rollout_corr/):
    rollout_is_{mean,max,min,ratio_fraction_high,ratio_fraction_low,oob_ratio,batch_norm_factor},
    rollout_rs_{option}_masked_fraction, rollout_rs_{option}_seq_masked_fraction,
    rollout_rs_masked_fraction, rollout_rs_seq_masked_fraction, kl, k3_kl; OpenRLHF: vllm_kl;
    TRL: sampling/sampling_logp_difference/{mean,max},
    sampling/importance_sampling_ratio/{min,mean,max}."""
    fn = {"VERL": _verl_metrics, "OPENRLHF": _openrlhf_metrics, "TRL": _trl_metrics}
    return {k: v.detach() for k, v in fn[opts.source.name](opts, state).items()}
