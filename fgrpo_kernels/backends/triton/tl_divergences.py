"""Triton twins of the divergence table (`fgrpo_kernels.divergences.TABLE`).

Each divergence `<name>` has two `@triton.jit` twins here, `_<name>_pos(r)` and
`_<name>_neg(r)`, returning (φ(r), dφ/dr) with the table's clamp semantics (exponential
arguments held at 80, value and slope). `TWINS` is built from the table by that naming rule,
and a kernel receives the pair as constexpr function arguments (`phi_constexprs`), so
dispatch is a table lookup on the host, not a branch per divergence in the kernel. A new
divergence is its table entry plus its pair of twins here; tests/test_divergences_triton.py
sweeps every member against its PyTorch entry.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...core.divergences import EXP_CLAMP, LN2, TABLE, Divergence
from .tl_math import tl_expm1, tl_sat_exp, tl_sech2, tl_sigmoid, tl_softplus, tl_tanh

_CLAMP = tl.constexpr(EXP_CLAMP)
_LN2 = tl.constexpr(LN2)


@triton.jit
def _kl_pos(r):
    return -r, tl.zeros_like(r) - 1.0


@triton.jit
def _kl_neg(r):
    e = tl_sat_exp(r - 1.0)
    return e, e


@triton.jit
def _reverse_kl_pos(r):
    e = tl_sat_exp(-r)
    return e, -e


@triton.jit
def _reverse_kl_neg(r):
    return r - 1.0, tl.zeros_like(r) + 1.0


@triton.jit
def _pearson_pos(r):
    return -r, tl.zeros_like(r) - 1.0


@triton.jit
def _pearson_neg(r):
    # NB: the conjugate over u ≥ 0 is flat (−1) below r = −2, slope 0 there.
    inside = r >= -2.0
    return tl.where(inside, r + 0.25 * r * r, -1.0), tl.where(inside, 1.0 + 0.5 * r, 0.0)


@triton.jit
def _hellinger_pos(r):
    x = tl.minimum(-r, _CLAMP)
    return tl_expm1(x), -tl.exp(x)


@triton.jit
def _hellinger_neg(r):
    x = tl.minimum(r, _CLAMP)
    return tl_expm1(x), tl.exp(x)


@triton.jit
def _js_pos(r):
    return tl_softplus(-r) - _LN2, -tl_sigmoid(-r)


@triton.jit
def _js_neg(r):
    return tl_softplus(r) - _LN2, tl_sigmoid(r)


@triton.jit
def _tv_pos(r):
    return -0.5 * tl_tanh(r), -0.5 * tl_sech2(r)


@triton.jit
def _tv_neg(r):
    return 0.5 * tl_tanh(r), 0.5 * tl_sech2(r)


def _twins_of(divergence: Divergence) -> tuple[triton.JITFunction, triton.JITFunction] | None:
    """The pair `_<name>_pos`, `_<name>_neg` defined in this module, or None."""
    name = TABLE[divergence].name
    pair = globals().get(f"_{name}_pos"), globals().get(f"_{name}_neg")
    return None if None in pair else pair


TWINS: dict[Divergence, tuple[triton.JITFunction, triton.JITFunction]] = {
    d: pair for d in Divergence if (pair := _twins_of(d)) is not None
}


def phi_constexprs(divergence: Divergence) -> dict[str, triton.JITFunction]:
    """The constexpr arguments PHI_POS / PHI_NEG of a kernel that calls `tl_phi`."""
    pair = _twins_of(divergence)
    if pair is None:
        name = TABLE[divergence].name
        raise NotImplementedError(
            f"no Triton twin for divergence {name!r}: define _{name}_pos and _{name}_neg in "
            "fgrpo_kernels/backends/triton/tl_divergences.py"
        )
    return {"PHI_POS": pair[0], "PHI_NEG": pair[1]}


@triton.jit
def tl_phi(r, positive, PHI_POS: tl.constexpr, PHI_NEG: tl.constexpr):
    """(φ₊(r), dφ₊/dr) where `positive`, else (φ₋(r), dφ₋/dr); PHI_POS / PHI_NEG are one
    divergence's twins (`phi_constexprs`)."""
    vp, sp = PHI_POS(r)
    vn, sn = PHI_NEG(r)
    return tl.where(positive, vp, vn), tl.where(positive, sp, sn)
