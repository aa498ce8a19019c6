"""The divergence table: the one home of every f-divergence formula (docs/math.md §3).

A unit (token or sequence) with implicit reward r = β·log(π_θ/π_ref) costs
    φ₊(r) = −g(r)        if its advantage a > 0,
    φ₋(r) = f*(g(r))     if a ≤ 0,
where g is the canonical f-GAN output link and f* the convex conjugate of f over u ≥ 0.

Every exponential argument passes through `clamp_exp_arg` (at EXP_CLAMP = 80): beyond the clamp
the value *and* the derivative are held at their value at 80, so nothing overflows and the push
never vanishes. The derivatives `dphi_pos` / `dphi_neg` are written in closed form and equal
autograd of `phi_pos` / `phi_neg` everywhere (tests/test_divergences.py checks this).

The Triton twins of φ₊/φ₋ and their derivatives are `_<name>_pos` / `_<name>_neg` in
`fgrpo_kernels/backends/triton/tl_divergences.py`, found by the `name` of each entry here.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

EXP_CLAMP = 80.0
LN2 = math.log(2.0)

Fn = Callable[[torch.Tensor], torch.Tensor]


def clamp_exp_arg(x: torch.Tensor) -> torch.Tensor:
    """min(x, 80) in value, identity in slope: exp(clamp_exp_arg(x)) saturates value and slope.

    NB: 80 + (x − x.detach()) is exactly 80; x − (x − 80).detach() rounds to x − x = 0 once the
    spacing of x passes 80 (x > 2^30 in fp32, 2^59 in fp64), and e^0 is silently wrong."""
    return torch.where(x > EXP_CLAMP, EXP_CLAMP + (x - x.detach()), x)


def sat_exp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(clamp_exp_arg(x))


def sat_expm1(x: torch.Tensor) -> torch.Tensor:
    return torch.expm1(clamp_exp_arg(x))


def softplus(x: torch.Tensor) -> torch.Tensor:
    """Exact, stable softplus ln(1 + e^x) = logaddexp(x, 0), slope sigmoid(x) (no threshold)."""
    return torch.logaddexp(x, torch.zeros_like(x))


class Divergence(enum.IntEnum):
    """The six divergences; the integer value is the constexpr the Triton epilogue sees."""

    KL = 0
    REVERSE_KL = 1
    PEARSON = 2
    HELLINGER = 3
    JS = 4
    TV = 5


@dataclass(frozen=True)
class DivergenceSpec:
    """One row of the table: the generator f, the link g, the loss pieces and their slopes.

    `conjugate` is f*(t) and `maximiser` the u ≥ 0 attaining sup_u t·u − f(u); both exist for the
    Fenchel–Young tests. The `*_doc` strings feed the README table (`markdown_table`).
    """

    name: str
    f: Fn
    g: Fn
    phi_pos: Fn
    phi_neg: Fn
    dphi_pos: Fn
    dphi_neg: Fn
    conjugate: Fn
    maximiser: Fn
    f_doc: str
    g_doc: str
    phi_pos_doc: str
    phi_neg_doc: str


def _pearson_neg(r: torch.Tensor) -> torch.Tensor:
    # NB: the conjugate over u ≥ 0 is flat (−1) below t = −2; the naive r + r²/4 would turn back up.
    return torch.where(r >= -2.0, r + 0.25 * r * r, torch.full_like(r, -1.0))


def _tv_conjugate(t: torch.Tensor) -> torch.Tensor:
    inf = torch.full_like(t, math.inf)
    return torch.where(t > 0.5, inf, torch.where(t < -0.5, torch.full_like(t, -0.5), t))


def _spec(name: str, docs: tuple[str, str, str, str], **formulas: Fn) -> DivergenceSpec:
    """A table row from its name, its README row (f, g, φ₊, φ₋) and its formulas."""
    f_doc, g_doc, phi_pos_doc, phi_neg_doc = docs
    return DivergenceSpec(
        name, **formulas, f_doc=f_doc, g_doc=g_doc, phi_pos_doc=phi_pos_doc, phi_neg_doc=phi_neg_doc
    )


TABLE: dict[Divergence, DivergenceSpec] = {
    Divergence.KL: _spec(
        "kl",
        ("u ln u", "r", "−r", "e^(r−1)"),
        f=lambda u: torch.xlogy(u, u),
        g=lambda r: r,
        phi_pos=lambda r: -r,
        phi_neg=lambda r: sat_exp(r - 1.0),
        dphi_pos=lambda r: -torch.ones_like(r),
        dphi_neg=lambda r: sat_exp(r - 1.0),
        conjugate=lambda t: sat_exp(t - 1.0),
        maximiser=lambda t: sat_exp(t - 1.0),
    ),
    Divergence.REVERSE_KL: _spec(
        "reverse_kl",
        ("−ln u", "−e^(−r)", "e^(−r)", "r − 1"),
        f=lambda u: -torch.log(u),
        g=lambda r: -sat_exp(-r),
        phi_pos=lambda r: sat_exp(-r),
        phi_neg=lambda r: r - 1.0,
        dphi_pos=lambda r: -sat_exp(-r),
        dphi_neg=lambda r: torch.ones_like(r),
        conjugate=lambda t: -1.0 - torch.log(-t),
        maximiser=lambda t: -1.0 / t,
    ),
    Divergence.PEARSON: _spec(
        "pearson",
        ("(u−1)²", "r", "−r", "r + r²/4 for r ≥ −2, else −1"),
        f=lambda u: (u - 1.0) ** 2,
        g=lambda r: r,
        phi_pos=lambda r: -r,
        phi_neg=_pearson_neg,
        dphi_pos=lambda r: -torch.ones_like(r),
        dphi_neg=lambda r: torch.where(r >= -2.0, 1.0 + 0.5 * r, torch.zeros_like(r)),
        conjugate=_pearson_neg,
        maximiser=lambda t: (1.0 + 0.5 * t).clamp(min=0.0),
    ),
    Divergence.HELLINGER: _spec(
        "hellinger",
        ("(√u−1)²", "1 − e^(−r)", "e^(−r) − 1", "e^r − 1"),
        f=lambda u: (torch.sqrt(u) - 1.0) ** 2,
        g=lambda r: -sat_expm1(-r),
        phi_pos=lambda r: sat_expm1(-r),
        phi_neg=lambda r: sat_expm1(r),
        dphi_pos=lambda r: -sat_exp(-r),
        dphi_neg=lambda r: sat_exp(r),
        conjugate=lambda t: t / (1.0 - t),
        maximiser=lambda t: 1.0 / (1.0 - t) ** 2,
    ),
    Divergence.JS: _spec(
        "js",
        (
            "u ln u − (u+1) ln((u+1)/2)",
            "ln 2 − softplus(−r)",
            "softplus(−r) − ln 2",
            "softplus(r) − ln 2",
        ),
        f=lambda u: torch.xlogy(u, u) - torch.xlogy(u + 1.0, (u + 1.0) / 2.0),
        g=lambda r: LN2 - softplus(-r),
        phi_pos=lambda r: softplus(-r) - LN2,
        phi_neg=lambda r: softplus(r) - LN2,
        dphi_pos=lambda r: -torch.sigmoid(-r),
        dphi_neg=lambda r: torch.sigmoid(r),
        conjugate=lambda t: -torch.log(2.0 - torch.exp(t)),
        maximiser=lambda t: torch.exp(t) / (2.0 - torch.exp(t)),
    ),
    Divergence.TV: _spec(
        "tv",
        ("½\\|u−1\\|", "½ tanh r", "−½ tanh r", "½ tanh r"),
        f=lambda u: 0.5 * (u - 1.0).abs(),
        g=lambda r: 0.5 * torch.tanh(r),
        phi_pos=lambda r: -0.5 * torch.tanh(r),
        phi_neg=lambda r: 0.5 * torch.tanh(r),
        dphi_pos=lambda r: -0.5 * (1.0 - torch.tanh(r) ** 2),
        dphi_neg=lambda r: 0.5 * (1.0 - torch.tanh(r) ** 2),
        conjugate=_tv_conjugate,
        maximiser=lambda t: torch.ones_like(t),
    ),
}

NAMES: tuple[str, ...] = tuple(spec.name for spec in TABLE.values())


def get_divergence(divergence: str | Divergence, arg: str = "divergence") -> Divergence:
    """The enum for a public name; unknown names raise a ValueError listing the valid ones."""
    if isinstance(divergence, Divergence):
        return divergence
    if isinstance(divergence, str):
        for key, spec in TABLE.items():
            if spec.name == divergence.lower():
                return key
    raise ValueError(f"{arg}: expected one of {', '.join(NAMES)}; got {divergence!r}")


def phi(r: torch.Tensor, positive: torch.Tensor, divergence: str | Divergence) -> torch.Tensor:
    """φ₊(r) where `positive` else φ₋(r), elementwise (both branches are finite everywhere)."""
    spec = TABLE[get_divergence(divergence)]
    return torch.where(positive, spec.phi_pos(r), spec.phi_neg(r))


def dphi(r: torch.Tensor, positive: torch.Tensor, divergence: str | Divergence) -> torch.Tensor:
    """dφ₊/dr where `positive` else dφ₋/dr, in closed form."""
    spec = TABLE[get_divergence(divergence)]
    return torch.where(positive, spec.dphi_pos(r), spec.dphi_neg(r))


def markdown_table() -> str:
    """The README's divergence table, generated from TABLE."""
    rows = [
        "| name | f(u) | g(r) | φ₊(r) = −g(r) | φ₋(r) = f*(g(r)) |",
        "|---|---|---|---|---|",
    ]
    for spec in TABLE.values():
        rows.append(
            f"| `{spec.name}` | {spec.f_doc} | {spec.g_doc} | {spec.phi_pos_doc} | "
            f"{spec.phi_neg_doc} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
