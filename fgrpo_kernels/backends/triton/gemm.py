"""The backward's vendor GEMMs: products accumulated in fp32, and the TF32 state around them.

`gemm` writes (or adds) a @ b into an fp32 output: cuBLAS's out_dtype overloads for bf16/fp16
operands where they exist (recent torch on CUDA); without them a bf16 product (fp32
accumulation inside cuBLAS, one bf16 rounding per tile) added in fp32; fp16, and CPU tensors
(the interpreter), upcast exactly and multiply in fp32.

`fp32_precision` pins cuBLAS's fp32 GEMMs to full IEEE fp32 (TF32 with `fast_fp32`) and puts
the user's setting back through the API it came from: the legacy one (`allow_tf32`,
`set_float32_matmul_precision`) keeps PyTorch's legacy and per-backend flags in agreement, the
per-backend one (`torch.backends.cuda.matmul.fp32_precision`) is used only by callers whose
state already came from it. Nothing is touched when the setting is already the wanted one.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager, nullcontext

import torch

ROUTES = ("fp32", "out_dtype", "bf16", "upcast")


@functools.cache
def has_out_dtype_mm(device: torch.device) -> bool:
    """Whether torch.mm/addmm take out_dtype=float32 for bf16 operands here (recent torch, CUDA)."""
    a = torch.zeros(16, 16, dtype=torch.bfloat16, device=device)
    try:
        torch.addmm(torch.zeros(16, 16, device=device), a, a, torch.float32)
        torch.mm(a, a, torch.float32)
        return True
    except (TypeError, RuntimeError):
        return False


def route(a: torch.Tensor) -> str:
    """How `gemm` multiplies operands like `a` (one of ROUTES)."""
    if a.dtype == torch.float32:
        return "fp32"
    if not a.is_cuda:
        return "upcast"
    if has_out_dtype_mm(a.device):
        return "out_dtype"
    return "bf16" if a.dtype == torch.bfloat16 else "upcast"


def gemm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool, how=None,
         alpha: float = 1.0):  # fmt: skip
    """out (+)= alpha·(a @ b) with out fp32 and a, b of one dtype; `how` overrides `route(a)`."""
    how = how or route(a)
    if how in ("fp32", "out_dtype"):
        dtype = (torch.float32,) if how == "out_dtype" else ()
        if accumulate or alpha != 1.0:
            torch.addmm(out, a, b, *dtype, beta=1.0 if accumulate else 0.0, alpha=alpha, out=out)
        else:
            torch.mm(a, b, *dtype, out=out)
    else:
        # bf16: a bf16 [rows, H] product, bounded like the tiles; upcast: fp32 copies of the tile
        # operands (exact; fp16 products could leave fp16's range at the strip's scale)
        prod = torch.mm(a, b) if how == "bf16" else torch.mm(a.float(), b.float())
        if accumulate:
            out.add_(prod, alpha=alpha)
        else:
            torch.mul(prod, alpha, out=out)


def _resolved(raw: str) -> str:
    """The cuda-matmul precision a per-backend value stands for ("none" defers to the global)."""
    if raw != "none":
        return raw
    overall = torch.backends.fp32_precision
    return overall if overall != "none" else "ieee"


def _state() -> tuple[str | None, str | None, str | None]:
    """(legacy precision or None if reading it raises, cuda-matmul raw value, mkldnn-matmul raw
    value); the last two are None on torch without per-backend flags."""
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:  # the caller mixed the APIs already; the legacy value is not readable
        legacy = None
    try:
        cuda_raw = torch.backends.cuda.matmul.fp32_precision
        mkldnn_raw = torch.backends.mkldnn.matmul.fp32_precision
    except AttributeError:
        cuda_raw = mkldnn_raw = None
    return legacy, cuda_raw, mkldnn_raw


@contextmanager
def tf32_matmul(allow: bool):
    """cuBLAS fp32 GEMMs with TF32 on or off inside; the caller's setting restored after."""
    legacy, cuda_raw, mkldnn_raw = _state()
    current = legacy != "highest" if cuda_raw is None else _resolved(cuda_raw) == "tf32"
    if current == allow:
        yield
        return
    flags = torch.backends.cuda.matmul
    if legacy is not None and (cuda_raw is None or (legacy != "highest") == current):
        # a legacy (or untouched) state: change and restore it through the legacy API
        flags.allow_tf32 = allow
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(legacy)
            if cuda_raw is not None and flags.fp32_precision != cuda_raw:
                flags.fp32_precision = cuda_raw  # e.g. back to "none" after a default state
            if mkldnn_raw is not None and torch.backends.mkldnn.matmul.fp32_precision != mkldnn_raw:
                torch.backends.mkldnn.matmul.fp32_precision = mkldnn_raw
    else:
        flags.fp32_precision = "tf32" if allow else "ieee"
        try:
            yield
        finally:
            flags.fp32_precision = cuda_raw


def fp32_precision(device: torch.device, dtype: torch.dtype, fast_fp32: bool):
    """The TF32 context the backward's GEMMs need: only fp32 operands on CUDA have one."""
    if device.type != "cuda" or dtype != torch.float32:
        return nullcontext()
    return tf32_matmul(fast_fp32)
