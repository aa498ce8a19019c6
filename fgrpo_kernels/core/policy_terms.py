"""The GRPO family's policy terms, one table (docs/math.md, "The GRPO family").

A term is its per-token formula, the tokens it clips, the metrics those feed and the id of its
Triton branch. `Objective` (the enum a loss type names, `options.LOSS_TYPE_SPECS`) is built from
`_TERMS`, so a new term is one entry here, plus its branch in
`backends/triton/epilogue_grpo.py` under that id. Shapes: logps and w [B, T] (w = exp(log
ratio)), a the advantage [B, 1]; `opts` the parsed `options.GRPOOptions` (not imported: options
imports this module).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


def _clipped(logps, w, a, opts) -> torch.Tensor:
    unclipped = w if opts.delta is None else w.clamp(max=opts.delta)
    clipped = w.clamp(1.0 - opts.epsilon_low, 1.0 + opts.epsilon_high)
    pt = -torch.minimum(unclipped * a, clipped * a)
    if opts.clip_ratio_c is not None:
        pt = torch.where(a < 0, torch.minimum(pt, -a * opts.clip_ratio_c), pt)
    return pt


def _cispo(logps, w, a, opts) -> torch.Tensor:
    return -(w.clamp(max=opts.epsilon_high).detach() * a) * logps


def _sapo(logps, w, a, opts) -> torch.Tensor:
    tau = torch.where(a > 0, w.new_tensor(opts.sapo_temperature_pos),
                      w.new_tensor(opts.sapo_temperature_neg))  # fmt: skip
    return -a * torch.sigmoid(tau * (w - 1.0)) * (4.0 / tau)


def _plain(logps, w, a, opts) -> torch.Tensor:
    return -a * logps


def _clipped_tokens(ratio, a, opts):
    low = (ratio < 1.0 - opts.epsilon_low) & (a < 0)
    return low, (ratio > 1.0 + opts.epsilon_high) & (a > 0)


def _capped_tokens(ratio, a, opts):
    return None, (ratio > opts.epsilon_high) & (a > 0)


def _never(ratio, a, opts):
    return None, None


@dataclass(frozen=True)
class PolicyTerm:
    """One GRPO policy term: its per-token formula `term(logps, w, a, opts)` (w = exp(log
    ratio), a the advantage [B, 1]; autograd gives its gradient), the tokens it clips
    `clips(ratio, a, opts) -> (low | None, high | None)` (bools), the metrics those feed
    (`metrics.py`), the ratio bounds the Triton epilogue takes, and the id of its branch there
    (`backends/triton/epilogue_grpo.py`). `sequence_weight`: its detached row weight is a
    statistic of whole sequences (VESPO's φ), which also takes the IS ratio in."""

    term: object
    clips: object
    triton_id: int
    clip_metrics: str = ""  # "trl": clip_ratio/*; "cispo": cispo_clip_ratio; "": none
    raw_cap: bool = False  # the Triton bounds are (0, ε_high), not [1 − ε_low, 1 + ε_high]
    sequence_weight: bool = False


# One entry per objective: (its Objective name, its term). The Triton ids are the branches of
# `epilogue_grpo.py`; `Objective[name]` is that id.
_TERMS = (
    # PPO's clipped surrogate −min(min(w, δ)·a, clip(w, 1 − ε_low, 1 + ε_high)·a), capped at
    # −a·c for a < 0 (delta and clip_ratio_c apply)
    ("CLIPPED", PolicyTerm(_clipped, _clipped_tokens, 0, clip_metrics="trl")),
    # −sg(min(w, ε_high))·a·logp
    ("CISPO", PolicyTerm(_cispo, _capped_tokens, 1, clip_metrics="cispo", raw_cap=True)),
    # −a·(4/τ)·σ(τ(w − 1)), τ = τ₊ for a > 0 else τ₋
    ("SAPO", PolicyTerm(_sapo, _never, 2)),
    # −a·logp, times its detached gamma weight φ of the sequence ratio (a row weight)
    ("VESPO", PolicyTerm(_plain, _never, 3, sequence_weight=True)),
)

Objective = enum.IntEnum(
    "Objective", [(name, term.triton_id) for name, term in _TERMS], module=__name__
)
Objective.__doc__ = """The per-token policy term of a loss type (`_TERMS`); the integer is the
constexpr the Triton epilogue sees."""

POLICY_TERMS: dict[Objective, PolicyTerm] = {Objective[name]: term for name, term in _TERMS}
