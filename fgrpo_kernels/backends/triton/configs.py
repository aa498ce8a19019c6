"""Tile candidates (autotuned), forward vocab splits and the backward's tiling plan.

Keys are the operand precision of the tile product: "lowp" (bf16/fp16 operands, tensor cores),
"lowp_fp32w" (the same with an fp32 weight converted in-kernel, as under autocast), "tf32" (fp32
inputs with `fast_fp32`) and "fp32" (fp32 inputs, full-precision FMA products). Each key has a
few candidates, all spill-free on sm_90a (bench/compile_report.py compiles every one); on a GPU
`autotune.choose` times them once per shape bucket, and the first is the untuned default.
128×256 and 256×128 tiles spill with the fused softmax epilogue and are not candidates.
Under TRITON_INTERPRET=1 every kernel uses `INTERPRET`, small enough for the CPU. Tests force
tiles, splits and the backward's chunk, wave and loop order with `forced(...)`.
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


_KC = KernelConfig
_LOWP = (_KC(128, 128, 64, 8, 3), _KC(128, 128, 64, 8, 4), _KC(64, 256, 64, 8, 3),
         _KC(128, 128, 64, 16, 3))  # fmt: skip
_LOWP_FP32W = (_KC(128, 128, 32, 8, 3), _KC(128, 128, 64, 8, 3), _KC(128, 128, 64, 16, 3))
_TF32 = (_KC(128, 128, 32, 8, 3), _KC(128, 128, 32, 8, 4), _KC(128, 128, 32, 16, 3))
_FP32 = (_KC(64, 64, 16, 4, 2), _KC(64, 64, 32, 4, 2))
_BY_KEY = {"lowp": _LOWP, "lowp_fp32w": _LOWP_FP32W, "tf32": _TF32, "fp32": _FP32}
CANDIDATES: dict[tuple[str, str], tuple[KernelConfig, ...]] = {
    (kind, key): cands for kind in ("fwd", "bwd") for key, cands in _BY_KEY.items()
}
INTERPRET = KernelConfig(16, 32, 32, 1, 1)


@dataclass(frozen=True)
class RowConfig:
    """Tiles of the single pass's row kernels (`logits_rows`): BLOCK_N rows × BLOCK_V columns
    of the fp32 logits buffer, no products (memory-bound; fixed, not tuned)."""

    block_n: int
    block_v: int
    num_warps: int


ROW_CONFIG = RowConfig(1, 2048, 8)  # one row per program: 40 registers at most, no spills
ROW_INTERPRET = RowConfig(4, 64, 1)
# The row-kernel tiles bench/gpu_perf.py times against ROW_CONFIG (compiled for sm_90a by
# bench/compile_report.py); ROW_CONFIG stays the default until a device run picks another.
ROW_CANDIDATES = (ROW_CONFIG, RowConfig(1, 4096, 8), RowConfig(2, 1024, 8), RowConfig(4, 512, 4))

# Forward: at least MIN_SPLITS vocab splits, more while the grid has < TARGET_PROGRAMS_PER_SM
# programs per SM (small N), never more than there are vocab tiles.
MIN_SPLITS = 4
TARGET_PROGRAMS_PER_SM = 2
CPU_SM_COUNT = 4
# Backward: every scratch buffer (the dlogits strip [chunk, wave], the fp32 block accumulators
# [chunk, H] and [wave, H], the masked hidden chunk, the converted weight wave) holds at most
# SCRATCH elements (2^25: 64-128 MiB each), whatever N, V and H.
SCRATCH = 1 << 25

_forced: dict = {}


@contextmanager
def forced(
    config: KernelConfig | None = None,
    splits: int | None = None,
    wave: int | None = None,
    chunk: int | None = None,
    rows_outer: bool | None = None,
    scratch: int | None = None,
    rows: RowConfig | None = None,
) -> Iterator[None]:
    """Override the tiles (both kernels), the forward split count, the backward's wave
    width, chunk height, loop order or scratch size, and the single pass's row tiles."""
    saved = dict(_forced)
    given = {"config": config, "splits": splits, "wave": wave, "chunk": chunk,
             "rows_outer": rows_outer, "scratch": scratch, "rows": rows}  # fmt: skip
    _forced.update({k: v for k, v in given.items() if v is not None})
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)


def precision(hidden: torch.dtype, weight: torch.dtype, fast_fp32: bool) -> str:
    if hidden in LOWP:
        return "lowp" if weight in LOWP else "lowp_fp32w"
    return "tf32" if fast_fp32 else "fp32"


def candidates(
    kind: str, hidden: torch.dtype, weight: torch.dtype, fast_fp32: bool, interpret: bool
) -> tuple[KernelConfig, ...]:
    """The configs to choose from: the forced one, the interpreter's, or the tuning set."""
    if "config" in _forced:
        return (_forced["config"],)
    return (INTERPRET,) if interpret else CANDIDATES[(kind, precision(hidden, weight, fast_fp32))]


def row_config(interpret: bool) -> RowConfig:
    """The row kernels' tiles: the forced one (`forced(rows=...)`), the interpreter's, or the
    compiled default."""
    if "rows" in _forced:
        return _forced["rows"]
    return ROW_INTERPRET if interpret else ROW_CONFIG


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


@dataclass(frozen=True)
class BackwardPlan:
    """The backward walks the [N, V] dlogits in [chunk, wave] tiles, N-chunks outside vocab
    waves (`rows_outer`) or the other way round. A gradient whose blocks (N-chunks of dH,
    waves of dW) each receive all their contributions in a row accumulates in one fp32 block
    buffer; otherwise it needs a full fp32 copy (4·N·H or 4·V·H bytes), and the order is the
    one that needs the smaller copy, if any."""

    chunk: int
    wave: int
    rows_outer: bool

    def tiles(self, N: int, V: int) -> Iterator[tuple[int, int, int, int]]:
        """(n0, n1, v0, v1) in loop order."""
        rows = [(n0, min(n0 + self.chunk, N)) for n0 in range(0, N, self.chunk)]
        cols = [(v0, min(v0 + self.wave, V)) for v0 in range(0, V, self.wave)]
        if self.rows_outer:
            return ((*r, *c) for r in rows for c in cols)
        return ((*r, *c) for c in cols for r in rows)

    def full_dh(self, N: int, V: int) -> bool:
        """Whether an N-chunk's contributions (one per wave) interleave with other chunks'."""
        return not self.rows_outer and self.chunk < N and self.wave < V

    def full_dw(self, N: int, V: int) -> bool:
        """Whether a wave's contributions (one per N-chunk) interleave with other waves'."""
        return self.rows_outer and self.chunk < N and self.wave < V


def backward_plan(
    N: int, H: int, V: int, align_n: int, align_v: int, fp32_dh: bool, fp32_dw: bool
) -> BackwardPlan:
    """Chunk and wave (multiples of align_n / align_v) within SCRATCH elements per buffer.

    `fp32_dh` / `fp32_dw`: that gradient is wanted in bf16/fp16, so accumulating it needs fp32
    buffers (an fp32 gradient accumulates in place)."""
    scratch = _forced.get("scratch", SCRATCH)
    per_row = scratch // max(H, 1)
    chunk = _forced.get("chunk", max(align_n, per_row // align_n * align_n))
    chunk = max(1, min(chunk, N))
    wave = _forced.get("wave", max(align_v, min(scratch // chunk, per_row) // align_v * align_v))
    wave = max(1, min(wave, V))
    # the full fp32 copy each order would need, in elements (0: none)
    both = chunk < N and wave < V
    rows_cost = V * H if fp32_dw and both else 0
    cols_cost = N * H if fp32_dh and both else 0
    return BackwardPlan(chunk, wave, _forced.get("rows_outer", rows_cost <= cols_cost))
