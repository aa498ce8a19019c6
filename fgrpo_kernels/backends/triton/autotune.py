"""Autotuning of the log-prob kernels' tiles over `configs.CANDIDATES`.

On a GPU, the first launch of a (kernel, dtypes, flags, shape bucket) times every candidate
(one warm-up launch that compiles it, then the best of three, CUDA events) and keeps the
fastest for the process; a candidate that fails to compile or launch is skipped. Shapes are
bucketed to powers of two, so token counts that change every batch re-tune O(log N) times.
`FGRPO_AUTOTUNE=0` pins the first candidate: the same tiles, hence bitwise the same results,
in every process (tuning may pick differently from run to run).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

import torch

from .configs import KernelConfig

ENV = "FGRPO_AUTOTUNE"
REPEATS = 3
_chosen: dict[tuple, KernelConfig] = {}


def bucket(n: int) -> int:
    """n rounded up to a power of two."""
    return 1 << max(0, n - 1).bit_length()


def enabled() -> bool:
    value = os.environ.get(ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}: expected '0' or '1'; got {value!r}")
    return value == "1"


def choose(
    key: tuple,
    candidates: Sequence[KernelConfig],
    run: Callable[[KernelConfig], object],
    tune: bool,
) -> KernelConfig:
    """The config for `key`: the only candidate, the first one (`tune` False or tuning
    disabled), or the fastest `run` measured on the first call with this key."""
    if len(candidates) == 1 or not tune or not enabled():
        return candidates[0]
    if key not in _chosen:
        _chosen[key] = fastest(candidates, run)
    return _chosen[key]


def chosen() -> dict[tuple, KernelConfig]:
    """What tuning picked so far in this process (for reports)."""
    return dict(_chosen)


def fastest(candidates: Sequence[KernelConfig], run: Callable[[KernelConfig], object]):
    best, best_ms, errors = None, math.inf, []
    for cfg in candidates:
        try:
            ms = time_ms(lambda cfg=cfg: run(cfg))
        except Exception as error:  # noqa: BLE001 - out of resources, compile error: skip it
            errors.append(error)
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is None:
        raise errors[0]
    return best


def time_ms(fn: Callable[[], object]) -> float:
    """Best of REPEATS launches after one warm-up, in ms (CUDA events)."""
    fn()
    times = []
    for _ in range(REPEATS):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return min(times)
