"""Triton twins of the divergence table (`divergences.TABLE`), keyed by the same enum.

Each divergence has two `@triton.jit` twins, `_<name>_pos(r)` and `_<name>_neg(r)`, returning
(φ(r), dφ/dr) with the table's clamp semantics: exponential arguments are clamped at
EXP_CLAMP = 80, value and slope held at their value there. `tl_phi` dispatches on the
`Divergence` value as a constexpr; `TWINS` lists the twins per member, and
tests/test_divergences_triton.py sweeps every member against its PyTorch entry, so a new
divergence is one TABLE entry plus one pair of twins here (and its branch in `tl_phi`).

Only core `tl` operations are used (libdevice is not available under TRITON_INTERPRET=1):
expm1, log1p and tanh are written in their stable forms below.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .divergences import EXP_CLAMP, LN2, Divergence

_CLAMP = tl.constexpr(EXP_CLAMP)
_LN2 = tl.constexpr(LN2)
_KL = tl.constexpr(int(Divergence.KL))
_REVERSE_KL = tl.constexpr(int(Divergence.REVERSE_KL))
_PEARSON = tl.constexpr(int(Divergence.PEARSON))
_HELLINGER = tl.constexpr(int(Divergence.HELLINGER))
_JS = tl.constexpr(int(Divergence.JS))
_TV = tl.constexpr(int(Divergence.TV))


# ----------------------------------------------------------------------------- stable pieces


@triton.jit
def tl_sat_exp(x):
    """exp(min(x, 80)): its own slope, held at its value at 80 beyond (straight-through)."""
    return tl.exp(tl.minimum(x, _CLAMP))


@triton.jit
def tl_expm1(x):
    """e^x − 1 without cancellation: a degree-8 Taylor polynomial for |x| < 0.5 (truncation
    below 2^-26 relative there), exp(x) − 1 beyond (at most 2.6x amplification of its error)."""
    p = 1.0 + x * (1.0 / 8.0)
    p = 1.0 + x * (1.0 / 7.0) * p
    p = 1.0 + x * (1.0 / 6.0) * p
    p = 1.0 + x * (1.0 / 5.0) * p
    p = 1.0 + x * (1.0 / 4.0) * p
    p = 1.0 + x * (1.0 / 3.0) * p
    p = 1.0 + x * 0.5 * p
    return tl.where(tl.abs(x) < 0.5, x * p, tl.exp(x) - 1.0)


@triton.jit
def tl_log1p_unit(x):
    """ln(1 + x) for x in [0, 1] without a log: 2·atanh(s), s = x/(2 + x) ≤ 1/3, odd series to
    s^17 (truncation below 2^-28 relative)."""
    s = x / (2.0 + x)
    s2 = s * s
    p = 1.0 / 17.0
    p = 1.0 / 15.0 + s2 * p
    p = 1.0 / 13.0 + s2 * p
    p = 1.0 / 11.0 + s2 * p
    p = 1.0 / 9.0 + s2 * p
    p = 1.0 / 7.0 + s2 * p
    p = 1.0 / 5.0 + s2 * p
    p = 1.0 / 3.0 + s2 * p
    p = 1.0 + s2 * p
    return 2.0 * s * p


@triton.jit
def tl_softplus(x):
    """ln(1 + e^x) = max(x, 0) + ln(1 + e^(−|x|)), exact for every x (no threshold)."""
    return tl.maximum(x, 0.0) + tl_log1p_unit(tl.exp(-tl.abs(x)))


@triton.jit
def tl_sigmoid(x):
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def tl_tanh(x):
    """tanh x = −expm1(−2|x|) / (2 + expm1(−2|x|)), sign restored (no cancellation near 0)."""
    e = tl_expm1(-2.0 * tl.abs(x))
    t = -e / (2.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def tl_sech2(x):
    """sech² x = 4e/(1 + e)², e = e^(−2|x|): keeps its relative precision where 1 − tanh² x
    would cancel (|x| ≳ 4 in fp32)."""
    e = tl.exp(-2.0 * tl.abs(x))
    return 4.0 * e / ((1.0 + e) * (1.0 + e))


# ----------------------------------------------------------------------------- the twins


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


TWINS: dict[Divergence, tuple[triton.JITFunction, triton.JITFunction]] = {
    Divergence.KL: (_kl_pos, _kl_neg),
    Divergence.REVERSE_KL: (_reverse_kl_pos, _reverse_kl_neg),
    Divergence.PEARSON: (_pearson_pos, _pearson_neg),
    Divergence.HELLINGER: (_hellinger_pos, _hellinger_neg),
    Divergence.JS: (_js_pos, _js_neg),
    Divergence.TV: (_tv_pos, _tv_neg),
}


@triton.jit
def tl_phi(r, positive, DIVERGENCE: tl.constexpr):
    """(φ₊(r), dφ₊/dr) where `positive`, else (φ₋(r), dφ₋/dr); DIVERGENCE = int(Divergence)."""
    if DIVERGENCE == _KL:
        vp, sp = _kl_pos(r)
        vn, sn = _kl_neg(r)
    elif DIVERGENCE == _REVERSE_KL:
        vp, sp = _reverse_kl_pos(r)
        vn, sn = _reverse_kl_neg(r)
    elif DIVERGENCE == _PEARSON:
        vp, sp = _pearson_pos(r)
        vn, sn = _pearson_neg(r)
    elif DIVERGENCE == _HELLINGER:
        vp, sp = _hellinger_pos(r)
        vn, sn = _hellinger_neg(r)
    elif DIVERGENCE == _JS:
        vp, sp = _js_pos(r)
        vn, sn = _js_neg(r)
    elif DIVERGENCE == _TV:
        vp, sp = _tv_pos(r)
        vn, sn = _tv_neg(r)
    else:
        tl.static_assert(False, "tl_phi: no Triton twin for this Divergence (see TWINS)")
    return tl.where(positive, vp, vn), tl.where(positive, sp, sn)
