"""CPU backends of the fused linear log-prob: `chunked` (PyTorch tiles, always available)."""

from __future__ import annotations

from types import ModuleType

from . import chunked


def cpu_backend() -> str:
    """The name of the backend that CPU calls of the fused log-prob use."""
    return "torch"


def backend_module() -> ModuleType:
    return chunked
