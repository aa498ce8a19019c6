"""Benchmark presets: the sizes, the (pass, impl) matrix and the measurement policy.

A case is one (impl, pass, tokens N, vocab V, hidden H, dtype). Every case of a run sees the same
workload for its size: B = `generations` completions of one prompt (one GRPO group), T = N / B
tokens each (N is the long-sequence axis), reference log-probs given, all tokens unmasked.
`max_tokens` in the matrix caps an impl in a preset; larger sizes become `skipped` rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

PASSES = ("fwd", "fwd+bwd", "fwd+bwd-frozen")  # frozen: the lm_head weight takes no gradient


@dataclass(frozen=True)
class Case:
    impl: str
    pass_: str
    tokens: int
    vocab: int
    hidden: int
    dtype: str
    device: str
    generations: int = 8
    warmup: int = 1
    warmup_small: bool = False
    repeats: int = 5
    min_time_s: float = 1.0
    timeout_s: float = 900.0
    max_mem_gib: float | None = None
    seed: int = 0

    @property
    def seq_len(self) -> int:
        return self.tokens // self.generations

    def label(self) -> str:
        return f"{self.impl} {self.pass_} N={self.tokens} V={self.vocab} H={self.hidden}"


@dataclass(frozen=True)
class Preset:
    """Sizes × matrix. Repeats stop once the timed runs add up to `min_time_s` (at least one).

    `warmup_small`: warm up on the first completion only (N/B tokens, same code path, same lm_head),
    which pays the one-time costs without doubling the cost of a long CPU case; torch.compile
    impls still warm up at full size (a new shape recompiles).
    """

    name: str
    device: str
    tokens: tuple[int, ...]
    vocab: tuple[int, ...]
    hidden: tuple[int, ...]
    dtype: tuple[str, ...]
    matrix: tuple[tuple[str, str, int | None], ...]  # (pass, impl, max_tokens or None)
    generations: int = 8
    warmup: int = 1
    warmup_small: bool = False
    repeats: int = 5
    min_time_s: float = 1.0
    timeout_s: float = 900.0
    budget_s: float | None = None  # once a run has taken this long, the rest become skipped rows

    def cases(self) -> list[tuple[Case, bool]]:
        """(case, runnable) for every size × matrix entry, all impls of a size together (so a
        drifting machine load hits them alike); runnable False means skipped by the preset."""
        policy = {f: getattr(self, f) for f in ("device", "generations", "warmup", "warmup_small",
                                                 "repeats", "min_time_s", "timeout_s")}  # fmt: skip
        return [
            (Case(impl, p, tokens, vocab, hidden, dtype, **policy), cap is None or tokens <= cap)
            for dtype in self.dtype
            for vocab in self.vocab
            for hidden in self.hidden
            for tokens in self.tokens
            for p, impl, cap in self.matrix
        ]


def _matrix(**passes: dict[str, int | None]) -> tuple[tuple[str, str, int | None], ...]:
    names = {"fwd": "fwd", "fwd_bwd": "fwd+bwd", "frozen": "fwd+bwd-frozen"}
    return tuple((names[p], i, cap) for p, impls in passes.items() for i, cap in impls.items())


LOSSES = ("eager_grpo", "compile_grpo", "liger_grpo", "ours_grpo", "ours_fgrpo")

# On a 2-core CPU N·V elementwise work dominates, so H is small. The memory story does not
# depend on H: eager holds O(N·V) logits; Liger 0.8.5 tiles one completion at a time in
# min(T, 2048) × 4096 logits; ours (CPU path) in 1024 × 4096 tiles. The quick preset keeps only
# eager, Liger and ours GRPO at the largest N, to stay within ~5 minutes on a shared 2-core box.
CPU_QUICK = Preset(
    name="cpu-quick",
    device="cpu",
    tokens=(1024, 4096, 16384),
    vocab=(32768,),
    hidden=(128,),
    dtype=("float32",),
    matrix=_matrix(
        fwd_bwd={
            "eager_grpo": None,
            "compile_grpo": 4096,
            "liger_grpo": None,
            "ours_grpo": None,
            "ours_fgrpo": 4096,
        },
        fwd={"eager_logprobs": 4096, "ours_logprobs": 4096},
        frozen={"eager_grpo": 1024, "liger_grpo": 1024, "ours_grpo": 1024},
    ),
    warmup_small=True,
    repeats=3,
    min_time_s=2.0,
    timeout_s=280.0,
)

CPU_FULL = Preset(
    name="cpu",
    device="cpu",
    tokens=(1024, 2048, 4096, 8192, 16384, 32768),
    vocab=(32768,),
    hidden=(256,),
    dtype=("float32",),
    matrix=_matrix(
        fwd_bwd={impl: None for impl in (*LOSSES, "eager_fgrpo")},
        fwd={"eager_logprobs": None, "compile_logprobs": None, "ours_logprobs": None},
        frozen={"eager_grpo": None, "liger_grpo": None, "ours_grpo": None, "ours_fgrpo": None},
    ),
)

# H200, bf16, a Qwen-sized lm_head. The fp32-materialising baselines stop where their logits
# (N·V·4 bytes, plus log-softmax and gradients) no longer fit or take too long.
GPU = Preset(
    name="gpu",
    device="cuda",
    tokens=(8192, 16384, 32768, 65536, 131072),
    vocab=(151936,),
    hidden=(4096,),
    dtype=("bfloat16",),
    matrix=_matrix(
        fwd_bwd={
            "eager_grpo": 32768,
            "compile_grpo": 32768,
            "liger_triton_grpo": 65536,
            "liger_grpo": None,
            "ours_grpo": None,
            "ours_fgrpo": None,
        },
        fwd={"eager_logprobs": 32768, "cce_logprobs": None, "ours_logprobs": None},
        frozen={"eager_grpo": 32768, "liger_grpo": None, "ours_grpo": None},
    ),
    repeats=5,
    min_time_s=0.5,
    timeout_s=120.0,
    budget_s=420.0,  # compile and autotune are the unknowns: stay under 8 minutes whatever
)

GPU_QUICK = dataclasses.replace(GPU, name="gpu-quick", tokens=(8192, 32768), repeats=3)

# Seconds, for tests and for dry-running a preset's logic at toy size.
TINY = Preset(
    name="tiny",
    device="cpu",
    tokens=(64, 128),
    vocab=(512,),
    hidden=(32,),
    dtype=("float32",),
    matrix=_matrix(
        fwd_bwd={"eager_grpo": None, "liger_grpo": None, "ours_grpo": None, "ours_fgrpo": 64},
        fwd={"ours_logprobs": None},
    ),
    repeats=2,
    min_time_s=0.0,
    timeout_s=120.0,
)

PRESETS = {p.name: p for p in (CPU_QUICK, CPU_FULL, GPU, GPU_QUICK, TINY)}


def default_preset(device: str, quick: bool) -> Preset:
    if device == "cuda":
        return GPU_QUICK if quick else GPU
    return CPU_QUICK if quick else CPU_FULL
