"""A timing hook on the single pass's phases, off unless a `Recorder` is installed.

The pipeline marks its phases with `with phase(name):` (logits_gemm, stats_kernel, grad_kernel,
dh_gemm, dw_gemm, bias, epilogue, an open row's token parts, fold or rerun and a batch-wide loss's
correction in losses/single_pass.py); with no recorder that is one global read.
bench/gpu_perf.py installs one with `recording(recorder)`: CUDA events around each phase on a
GPU (summed after one synchronisation), perf_counter on the CPU.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

PHASES = ("logits_gemm", "stats_kernel", "grad_kernel", "dh_gemm", "dw_gemm", "bias", "epilogue",
          "open_row_part", "open_row_fold", "open_row_rerun", "batch_correction")  # fmt: skip
_recorder = None


class Recorder:
    """Per-phase wall time: CUDA events when `cuda`, else perf_counter (the interpreter)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.marks: list[tuple[str, object, object]] = []
        self.calls: dict[str, int] = defaultdict(int)

    def start(self, name: str):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, name: str, token) -> None:
        self.calls[name] += 1
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.marks.append((name, token, end))
        else:
            self.marks.append((name, token, time.perf_counter()))

    def totals_ms(self) -> dict[str, float]:
        """name -> summed milliseconds (synchronises once on a GPU)."""
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, float] = defaultdict(float)
        for name, a, b in self.marks:
            out[name] += a.elapsed_time(b) if self.cuda else (b - a) * 1e3
        return dict(out)


@contextmanager
def phase(name: str):
    rec = _recorder
    if rec is None:
        yield
        return
    token = rec.start(name)
    try:
        yield
    finally:
        rec.stop(name, token)


@contextmanager
def recording(rec: Recorder):
    """Install `rec` for the block (one at a time)."""
    global _recorder
    if _recorder is not None:
        raise RuntimeError("phases.recording: a recorder is already installed")
    _recorder = rec
    try:
        yield rec
    finally:
        _recorder = None
