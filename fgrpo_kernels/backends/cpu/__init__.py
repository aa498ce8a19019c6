"""CPU backends of the fused linear log-prob: `cpp` (the C++ ops of `csrc/`, built on first use)
and `chunked` (PyTorch tiles, always available: the fallback).

`FGRPO_CPU_BACKEND` (read per call): `cpp` or `torch` forces one; unset or `auto` uses `cpp`
when it builds, else `torch` after one warning.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from types import ModuleType

from . import chunked

ENV = "FGRPO_CPU_BACKEND"
CHOICES = ("auto", "cpp", "torch")
_fallback_warned = False


def _requested() -> str:
    value = os.environ.get(ENV) or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV}: expected one of {', '.join(map(repr, CHOICES))}; got {value!r}")
    return value


def _summary(error: Exception) -> str:
    """One line of a build failure: the compiler's complaint, not the command line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if re.search(r"error:|not found|No such file|cannot", line):
            return line[:200]
    return (lines[-1] if lines else type(error).__name__)[:200]


def cpp_build_seconds() -> float | None:
    """Seconds this process spent building the C++ backend (None: no build)."""
    if "fgrpo_kernels.backends.cpu.cpp" not in sys.modules:
        return None
    from . import cpp

    return cpp.build_seconds()


def backend_module() -> ModuleType:
    """The module (`cpp` or `chunked`) whose `logprob_fwd` / `logprob_bwd` CPU calls use."""
    global _fallback_warned
    requested = _requested()
    if requested == "torch":
        return chunked
    from . import cpp

    if cpp.available():
        return cpp
    error = cpp.build_error()
    if requested == "cpp":
        raise RuntimeError(
            f"{ENV}=cpp but the C++ CPU backend could not be built: {error}"
        ) from error
    if not _fallback_warned:
        _fallback_warned = True
        summary = _summary(error)
        warnings.warn(
            f"fgrpo_kernels: the C++ CPU backend could not be built ({summary}); using "
            f"the chunked-PyTorch path (set {ENV}=torch to skip the build)",
            RuntimeWarning,
            stacklevel=2,
        )
    return chunked


def cpu_backend() -> str:
    """The name of the backend that CPU calls of the fused log-prob use: "cpp" or "torch"."""
    return "torch" if backend_module() is chunked else "cpp"
