"""Stable elementary functions as `@triton.jit` helpers (shared by every kernel).

Only core `tl` operations are used (libdevice is not available under TRITON_INTERPRET=1):
expm1, log1p and tanh are written in their stable forms. Exponential arguments saturate at
EXP_CLAMP = 80 like the PyTorch table in `fgrpo_kernels.divergences`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...core.divergences import EXP_CLAMP

_CLAMP = tl.constexpr(EXP_CLAMP)


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
