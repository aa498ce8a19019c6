"""Block sizes, warps, stages, vocab splits and backward wave widths: the one tuning table.

Keys are the operand precision of the tile product: "lowp" (bf16/fp16 operands, tensor cores),
"lowp_fp32w" (the same with an fp32 weight converted in-kernel, as under autocast), "tf32" (fp32
inputs with `fast_fp32`) and "fp32" (fp32 inputs, full-precision FMA products). Each entry was
chosen so that ptxas reports no spills on sm_90a and sm_80 (bench/compile_report.py); none is
tuned on a GPU yet.
Under TRITON_INTERPRET=1 every kernel uses `INTERPRET`, small enough for the CPU. Tests force
smaller tiles, splits and waves with `forced(...)` so that several of each are exercised.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

LOWP = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class KernelConfig:
    block_n: int
    block_v: int
    block_k: int
    num_warps: int
    num_stages: int


TABLE: dict[tuple[str, str], KernelConfig] = {
    ("fwd", "lowp"): KernelConfig(128, 128, 64, 8, 3),
    ("fwd", "lowp_fp32w"): KernelConfig(128, 128, 32, 8, 3),
    ("fwd", "tf32"): KernelConfig(128, 128, 32, 8, 3),
    ("fwd", "fp32"): KernelConfig(64, 64, 16, 4, 2),
    ("bwd", "lowp"): KernelConfig(128, 128, 64, 8, 3),
    ("bwd", "lowp_fp32w"): KernelConfig(128, 128, 32, 8, 3),
    ("bwd", "tf32"): KernelConfig(128, 128, 32, 8, 3),
    ("bwd", "fp32"): KernelConfig(64, 64, 16, 4, 2),
}
INTERPRET = KernelConfig(16, 32, 32, 1, 1)

# Forward: at least MIN_SPLITS vocab splits, more while the grid has < TARGET_PROGRAMS_PER_SM
# programs per SM (small N), never more than there are vocab tiles.
MIN_SPLITS = 4
TARGET_PROGRAMS_PER_SM = 2
CPU_SM_COUNT = 4
# Backward: the dlogits strip [N, Vw] (and, for mixed dtypes, the converted weight wave
# [Vw, H]) holds at most max(N·H, SCRATCH_FLOOR) elements.
SCRATCH_FLOOR = 1 << 22

_forced: dict = {}


@contextmanager
def forced(
    config: KernelConfig | None = None, splits: int | None = None, wave: int | None = None
) -> Iterator[None]:
    """Override the tiles (both kernels), the forward split count and the backward wave width."""
    saved = dict(_forced)
    _forced.update(
        {k: v for k, v in (("config", config), ("splits", splits), ("wave", wave)) if v is not None}
    )
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)


def precision(hidden: torch.dtype, weight: torch.dtype, fast_fp32: bool) -> str:
    if hidden in LOWP:
        return "lowp" if weight in LOWP else "lowp_fp32w"
    return "tf32" if fast_fp32 else "fp32"


def kernel_config(
    kind: str, hidden: torch.dtype, weight: torch.dtype, fast_fp32: bool, interpret: bool
) -> KernelConfig:
    if "config" in _forced:
        return _forced["config"]
    return INTERPRET if interpret else TABLE[(kind, precision(hidden, weight, fast_fp32))]


def vocab_splits(N: int, V: int, cfg: KernelConfig, device: torch.device) -> tuple[int, int]:
    """(S, tiles per split) with every split non-empty: S·tiles_per_split ≥ cdiv(V, BLOCK_V)."""
    n_tiles = -(-V // cfg.block_v)
    if "splits" in _forced:
        want = _forced["splits"]
    else:
        sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else CPU_SM_COUNT
        )
        token_blocks = -(-N // cfg.block_n)
        want = max(MIN_SPLITS, -(-TARGET_PROGRAMS_PER_SM * sms // token_blocks))
    per_split = -(-n_tiles // max(1, min(want, n_tiles)))
    return -(-n_tiles // per_split), per_split


def wave_width(N: int, H: int, V: int, cfg: KernelConfig, mixed: bool) -> int:
    """Vocab columns per backward wave: a multiple of BLOCK_V within the scratch bound, ≤ V."""
    if "wave" in _forced:
        return min(_forced["wave"], V)
    budget = max(N * H, SCRATCH_FLOOR)
    width = budget // max(N, 1)
    if mixed:
        width = min(width, budget // H)
    return min(max(cfg.block_v, width // cfg.block_v * cfg.block_v), V)
