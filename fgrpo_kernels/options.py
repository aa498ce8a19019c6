"""Non-tensor options of the fused log-prob kernels, in one frozen dataclass (one ctx slot)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LogProbOptions:
    """temperature τ divides the logits; rows whose target is `ignore_index` give logp 0,
    entropy 0 and no gradient; `fast_fp32` lets fp32 inputs use TF32 tensor cores on CUDA
    (off by default: fp32 products are full fp32)."""

    temperature: float = 1.0
    ignore_index: int = -100
    fast_fp32: bool = False
