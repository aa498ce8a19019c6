"""Launcher helpers shared by the forward and backward log-prob kernels (no kernels here)."""

from __future__ import annotations

import torch
from triton.runtime.jit import JITFunction

from .configs import LOWP

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_dtypes(hidden, weight, bias) -> None:
    """The Triton path takes fp32/bf16/fp16 (no fp64): a TypeError naming the argument."""
    for name, t in (("hidden", hidden), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype not in TRITON_DTYPES:
            raise TypeError(
                f"{name}: expected float32, bfloat16 or float16 on the Triton path; got {t.dtype}"
            )


def interpreted(kernel) -> bool:
    """True when `kernel` was decorated under TRITON_INTERPRET=1 (it then runs on the CPU)."""
    return not isinstance(kernel, JITFunction)


def dot_flags(kernel, dtype: torch.dtype, fast_fp32: bool) -> tuple[bool, str]:
    """(UPCAST_DOT, DOT_PRECISION): upcast low-precision operands only under the interpreter;
    fp32 products are full IEEE fp32 unless `fast_fp32` asks for TF32."""
    upcast = interpreted(kernel) and dtype in LOWP
    return upcast, "tf32" if fast_fp32 and dtype == torch.float32 else "ieee"
