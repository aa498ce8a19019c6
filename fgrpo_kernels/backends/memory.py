"""The single pass's logits buffer sized from free device memory, within a cap.

Rule (docs/gpu-performance.md derives it from the traffic model): on a CUDA device with no
`max_chunk_bytes` and no $FGRPO_MAX_CHUNK_BYTES, the buffer (fp32 logits + low-precision
dlogits of a chunk of rows) gets

    min(cap, FLOOR · 2^k), the largest such power-of-two multiple ≤ FRACTION · (free − fixed),
    never below FLOOR (a cap under FLOOR wins);  cap = $FGRPO_CHUNK_CAP_BYTES or CAP

where `free` is what the device can still hand out: the driver's free memory
(`torch.cuda.mem_get_info`) plus what PyTorch's caching allocator holds unused (reserved −
allocated), and `fixed` what the caller knows it will still allocate beside the buffer (the
cuBLAS primitive path passes its fp32 dW; the single pass passes none and the FRACTION leaves
the room). Rounding down to a power of two keeps the chunking, and so the order in which dW is
summed, the same from step to step unless free memory crosses a threshold. FLOOR is the former
fixed default (1 GiB): the buffer never shrinks below it (a device that cannot hold it fails as
before). CAP (4 GiB) bounds the buffer: by the traffic model, past it a doubling saves about
2% of the loss in per-chunk dW read-and-write (an estimate). $FGRPO_CHUNK_BUFFER=fixed restores
the fixed 1 GiB (chunking that never depends on the free memory). A `max_chunk_bytes` given
by the user is taken as is. The CPU keeps its 32 MiB.
"""

from __future__ import annotations

import os

import torch

GiB = 1 << 30
FLOOR = 1 * GiB
CAP = 4 * GiB
FRACTION = 0.25
CAP_ENV = "FGRPO_CHUNK_CAP_BYTES"
MODE_ENV = "FGRPO_CHUNK_BUFFER"
MODES = ("auto", "fixed")


def _env_bytes(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    if not raw.isdigit():
        raise ValueError(f"{name}: expected a number of bytes >= 0; got {raw!r}")
    return int(raw)


def mode() -> str:
    """$FGRPO_CHUNK_BUFFER: "auto" (default) or "fixed"."""
    got = os.environ.get(MODE_ENV, "auto")
    if got not in MODES:
        raise ValueError(f"{MODE_ENV}: expected one of {MODES}; got {got!r}")
    return got


def auto_bytes(free: int, fixed: int, cap: int | None = None) -> int:
    """The rule above on given numbers (bytes)."""
    if free < 0 or fixed < 0:
        raise ValueError(f"free and fixed: expected bytes >= 0; got {free}, {fixed}")
    cap = CAP if cap is None else cap
    if cap < FLOOR:
        return cap
    share = int(FRACTION * max(free - fixed, 0))
    size = FLOOR
    while 2 * size <= share:
        size *= 2
    return min(size, cap)


def fixed_bytes(V: int, H: int, weight_dtype: torch.dtype) -> int:
    """The sweep's allocations besides the buffer: fp32 dW and its copy in the weight dtype."""
    return V * H * (4 + torch.empty((), dtype=weight_dtype).element_size())


def available(device: torch.device) -> int:
    """Bytes this process can still allocate on `device`: the driver's free memory plus the
    caching allocator's reserved-but-unallocated blocks."""
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + max(cached, 0)


def device_chunk_bytes(device: torch.device, fixed: int = 0) -> int:
    """The CUDA default buffer: the rule on this device's memory now (FLOOR when fixed)."""
    if mode() == "fixed":
        return FLOOR
    return auto_bytes(available(device), fixed, _env_bytes(CAP_ENV))


def buffer_bytes(device: torch.device, env: str = "FGRPO_MAX_CHUNK_BYTES", fixed: int = 0) -> int:
    """A chunked path's buffer budget when the caller gave none: $FGRPO_MAX_CHUNK_BYTES, else
    the rule on CUDA (`fixed` as there), else 32 MiB on the CPU (the single pass's defaults)."""
    given = _env_bytes(env)
    if given is not None:
        return given
    return device_chunk_bytes(device, fixed) if device.type == "cuda" else 32 << 20
