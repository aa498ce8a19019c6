"""Benchmark presets: the sizes, the (workload, pass, impl) matrix and the measurement policy.

A case is one (impl, workload, pass, tokens N, vocab V, hidden H, dtype, generations B); the
workload is described in `workload.py` (`train-step`: `train_step.py`). A preset lists exactly
the cases it runs: `max_tokens` in the matrix caps where an impl is listed (a slow peer on a
2-core CPU), and every listed case ends as a row (ok, oom, timeout, error, unavailable; skipped
only when a preset's `budget_s` is spent). On CPU each case runs in a child process whose data
segment is capped at `max_mem_gib` above its inputs, so a materialising peer meets a real
out-of-memory at a chosen size instead of swapping the machine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .workload import PASSES, VARIANT_WORKLOADS


@dataclass(frozen=True)
class Policy:
    """Repeats stop once the timed runs add up to `min_time_s` (at least one).

    `warmup_small`: warm up on the first T/8 tokens of every completion (same code path, same B,
    same lm_head), which pays the one-time costs (imports; compiles, whose graphs have dynamic
    shapes) without doubling the cost of a long CPU case.
    """

    warmup: int = 1
    warmup_small: bool = False
    repeats: int = 5
    min_time_s: float = 1.0
    timeout_s: float = 900.0
    max_mem_gib: float | None = None


@dataclass(frozen=True)
class Case:
    impl: str
    workload: str
    pass_: str
    tokens: int
    vocab: int
    hidden: int
    dtype: str
    device: str
    generations: int = 8
    policy: Policy = Policy()
    seed: int = 0
    # train-step only: TRL's vLLM importance-sampling correction mode, and its bias-corrected KL
    vllm_is: str | None = None
    bias_correction_kl: bool = False

    @property
    def seq_len(self) -> int:
        return self.tokens // self.generations

    def label(self) -> str:
        extra = f" vLLM-IS={self.vllm_is}" if self.vllm_is else ""
        extra += " bias-corrected-KL" if self.bias_correction_kl else ""
        return (
            f"{self.impl} {self.workload} {self.pass_} N={self.tokens} B={self.generations} "
            f"V={self.vocab} H={self.hidden}{extra}"
        )

    @classmethod
    def from_dict(cls, d: dict) -> Case:
        return cls(**{**d, "policy": Policy(**d["policy"])})


# (workload, pass, impl, max_tokens or None, generations or None: the preset's)
Entry = tuple[str, str, str, "int | None", "tuple[int, ...] | None"]


@dataclass(frozen=True)
class Preset:
    name: str
    device: str
    tokens: tuple[int, ...]
    vocab: tuple[int, ...]
    hidden: tuple[int, ...]
    dtype: tuple[str, ...]
    matrix: tuple[Entry, ...]
    generations: tuple[int, ...] = (8,)  # B, unless an entry of the matrix names its own
    policy: Policy = Policy()
    budget_s: float | None = None  # once a run has taken this long, the rest become skipped rows
    note: str = ""  # what the README should say about the choice of sizes

    def cases(self) -> list[Case]:
        """Every listed case, all impls of a size together (a drifting load hits them alike)."""
        return [
            Case(impl, workload, pass_, n, v, h, dtype, self.device, b, self.policy)
            for dtype in self.dtype
            for v in self.vocab
            for h in self.hidden
            for n in self.tokens
            for workload, pass_, impl, cap, gens in self.matrix
            for b in gens or self.generations
            if (cap is None or n <= cap) and n % b == 0
        ]


def matrix(
    workload: str, pass_: str, impls: tuple[str, ...], generations=None, **caps: int
) -> tuple[Entry, ...]:
    """Entries of one (workload, pass) panel: every impl at every size, unless capped."""
    if pass_ not in PASSES:
        raise ValueError(f"pass_: expected one of {PASSES}; got {pass_!r}")
    return tuple((workload, pass_, impl, caps.get(impl), generations) for impl in impls)


GEMM = (("gemm", "fwd", "gemm", None, None),)  # first at every size: the floor's rate
LOGPROB_PEERS = ("eager", "compile", "liger_flce", "cce", "trl", "verl", "verl_triton", "ours")
GRPO_PEERS = ("eager", "compile", "liger", "ours_two_pass", "ours")  # with a GRPO loss of their own
FORWARD_PEERS = ("eager", "compile", "cce", "trl", "ours")
CHUNKED_TORCH = ("liger", "trl", "verl")  # flat memory, but slow on a CPU
CPU_LOGPROB_PEERS = tuple(p for p in LOGPROB_PEERS if p not in ("liger_flce", "verl_triton"))


# 2-core CPU, fp32, V 32,768 (V 151,936 costs 4.6× the time per case), H 128: on a CPU the
# N·V elementwise work dominates and the memory story does not depend on H. Every peer is listed
# at N 4,096 and 16,384; ours goes on to 65,536. The 5 GiB cap makes the [N, V]-materialising
# peers (eager, compile, cce's torch_compile) out-of-memory at 16,384 (a 2 GiB fp32 logits
# tensor and its gradient) instead of running for minutes; the chunked peers fit. Liger's
# compiled GRPO loss pays an inductor compile per case (each case is a fresh process), so it
# runs at 4,096 only. The CUDA-only peers are not listed (`--impls` can name them: a row that
# says why).
CPU_QUICK = Preset(
    name="cpu-quick",
    device="cpu",
    tokens=(4096, 16384, 65536),
    vocab=(32768,),
    hidden=(128,),
    dtype=("float32",),
    matrix=(
        *GEMM,
        *matrix(
            "logprobs",
            "fwd+bwd",
            CPU_LOGPROB_PEERS,
            **dict.fromkeys(CPU_LOGPROB_PEERS[:-1], 16384),
        ),
        *matrix(
            "grpo",
            "fwd+bwd",
            ("eager", "liger", "ours_two_pass", "ours"),
            eager=16384,
            liger=4096,
            ours_two_pass=16384,
        ),
        # every policy variant beside our GRPO loss (report.md: variant / grpo ratios)
        *(e for v in VARIANT_WORKLOADS for e in matrix(v, "fwd+bwd", ("ours",), ours=16384)),
    ),  # fmt: skip
    policy=Policy(warmup_small=True, repeats=3, min_time_s=2.0, timeout_s=240.0, max_mem_gib=5.0),
    note="V 32,768 (V 151,936 would cost 4.6x the time per case on 2 cores)",
)

# Long sequences: single sequences (B 1) up to N 131,072, and the GRPO loss also on groups of 8
# (Liger chunks per completion; the log-prob peers flatten B × T, so B does not change their
# work), V 32,768 for the same reason as above. The materialising peers go to the end as oom
# rows; the chunked-PyTorch peers (liger, trl, verl: several times our CPU time) stop at 32,768.
CPU_LONG = Preset(
    name="cpu-long",
    device="cpu",
    tokens=(8192, 32768, 131072),
    vocab=(32768,),
    hidden=(64,),
    dtype=("float32",),
    generations=(1,),
    matrix=(
        *GEMM,
        *matrix("logprobs", "fwd+bwd", CPU_LOGPROB_PEERS, **dict.fromkeys(CHUNKED_TORCH, 32768)),
        *matrix("grpo", "fwd+bwd", ("eager", "liger", "ours"), (1, 8), liger=32768),
    ),
    policy=Policy(warmup_small=True, repeats=1, min_time_s=0.0, timeout_s=900.0, max_mem_gib=6.0),
    note="V 32,768 (V 151,936 would cost 4.6x the time per case on 2 cores)",
)

CPU_FULL = Preset(
    name="cpu",
    device="cpu",
    tokens=(1024, 4096, 16384, 65536),
    vocab=(32768,),
    hidden=(256,),
    dtype=("float32",),
    matrix=(
        *GEMM,
        *matrix("logprobs", "fwd", FORWARD_PEERS),
        *matrix("logprobs", "fwd+bwd", CPU_LOGPROB_PEERS),
        *matrix("grpo", "fwd+bwd", GRPO_PEERS),
        *matrix("fgrpo", "fwd+bwd", ("eager", "compile", "ours_two_pass", "ours")),
        *matrix("grpo", "fwd+bwd-frozen", ("eager", "liger", "ours")),
    ),
    policy=Policy(max_mem_gib=8.0),
)

# H200, bf16, a Qwen-sized lm_head; the materialising peers meet the GPU's own out-of-memory.
GPU = dataclasses.replace(
    CPU_FULL,
    name="gpu",
    device="cuda",
    tokens=(8192, 16384, 32768, 65536, 131072),
    vocab=(151936,),
    hidden=(4096,),
    dtype=("bfloat16",),
    matrix=(
        *GEMM,
        *matrix("logprobs", "fwd", FORWARD_PEERS),
        *matrix("logprobs", "fwd+bwd", LOGPROB_PEERS),
        *matrix("grpo", "fwd+bwd", (*GRPO_PEERS, "liger_triton")),
        *matrix("grpo", "fwd+bwd-frozen", ("eager", "liger", "ours")),
    ),
    policy=Policy(repeats=5, min_time_s=0.5, timeout_s=120.0),
    budget_s=480.0,  # from process start; compile and autotune are the unknowns
)

# The quick GPU run: log-probs and GRPO, fwd+bwd, N 8k / 32k / 64k, bf16, H 4096, V 151,936,
# every peer, in 240 s on an H200 from process start (`fgrpo bench --device cuda --quick
# --dry-run` prints the plan; estimate.py). Liger's chunked GRPO loss (~14× the floor) and CCE
# (~3.3×, linear in N) stop at 32k; the materialising peers run to 64k (111 GiB of bf16 logits
# and gradient for eager: an H200 fits it, an H100 gives an oom row).
GPU_QUICK = dataclasses.replace(
    GPU,
    name="gpu-quick",
    tokens=(8192, 32768, 65536),
    matrix=(
        *GEMM,
        *matrix("logprobs", "fwd+bwd", LOGPROB_PEERS, cce=32768),
        *matrix("grpo", "fwd+bwd", (*GRPO_PEERS, "liger_triton"), liger=32768),
    ),
    policy=Policy(repeats=3, min_time_s=0.3, timeout_s=120.0),
    budget_s=240.0,
)

# One GRPO training step (loss + backward) of a Qwen2-shaped model (`train_step.py`): stock TRL,
# TRL with Liger's fused GRPO loss, our TRL drop-in, and the backbone alone (the floor they share).
# B 2 completions of T tokens: N = 2T, T from 4k to 32k.
TRAIN_MEMORY = Preset(
    name="train-memory",
    device="cpu",
    tokens=(8192, 32768, 65536),
    vocab=(151936,),
    hidden=(64,),
    dtype=("float32",),
    generations=(2,),
    matrix=matrix("train-step", "fwd+bwd", ("backbone", "trl", "trl_liger", "ours")),
    policy=Policy(warmup_small=True, repeats=1, min_time_s=0.0, timeout_s=1800.0, max_mem_gib=12.0),
)

# One GRPO optimizer step (forward, loss, backward, AdamW) of a Qwen2.5-1.5B-shaped model
# (random init, bf16, gradient checkpointing; `train_gpu.py`) at 2 × 8k and 2 × 32k tokens:
# stock TRL 1.16, TRL with `use_liger_kernel`, TRL with our drop-in. 120 s from process start;
# a row that would not fit the GPU's free memory is skipped with the estimate in its note.
TRAIN_GPU = Preset(
    name="train-gpu",
    device="cuda",
    tokens=(16384, 65536),
    vocab=(151936,),
    hidden=(1536,),
    dtype=("bfloat16",),
    generations=(2,),
    matrix=matrix("train-gpu", "fwd+bwd", ("trl", "trl_liger_kernel", "ours")),
    policy=Policy(warmup=1, repeats=2, min_time_s=0.0, timeout_s=120.0),
    budget_s=120.0,
)


def tiny_train_gpu() -> Preset:
    """`--preset train-gpu --tiny`: the same step of a 2-layer toy of the model on the CPU,
    fp32, 2 × 32 tokens, V 512 (seconds; the test suite runs it)."""
    return dataclasses.replace(
        TRAIN_GPU, name="train-gpu-tiny", device="cpu", tokens=(64,), vocab=(512,),
        hidden=(64,), dtype=("float32",), policy=Policy(warmup=1, repeats=1, min_time_s=0.0,
        timeout_s=300.0), budget_s=None,
    )  # fmt: skip


# The fused GRPO loss with the vocabulary over 2 CPU ranks (gloo) against 1 rank: per-rank peak
# memory and time, one thread per rank (`vocab_parallel.py`).
CPU_DISTRIBUTED = Preset(
    name="cpu-distributed",
    device="cpu",
    tokens=(4096, 16384, 65536),
    vocab=(32768,),
    hidden=(128,),
    dtype=("float32",),
    matrix=matrix("vocab-parallel", "fwd+bwd", ("ours_1rank", "ours_2ranks")),
    policy=Policy(repeats=3, min_time_s=0.0, timeout_s=1800.0),
)

# Seconds, for tests and for dry-running a preset's logic at toy size.
TINY = Preset(
    name="tiny",
    device="cpu",
    tokens=(64, 128),
    vocab=(512,),
    hidden=(32,),
    dtype=("float32",),
    matrix=(
        *GEMM,
        *matrix("logprobs", "fwd", ("ours",)),
        *matrix("grpo", "fwd+bwd", ("eager", "liger (eager)", "ours_two_pass", "ours")),
        *matrix("fgrpo", "fwd+bwd", ("ours",), ours=64),
    ),
    policy=Policy(repeats=2, min_time_s=0.0, timeout_s=120.0),
)

PRESETS = {
    p.name: p
    for p in (
        CPU_QUICK, CPU_LONG, CPU_FULL, GPU, GPU_QUICK, TRAIN_MEMORY, TRAIN_GPU, CPU_DISTRIBUTED,
        TINY,
    )
}  # fmt: skip


def default_preset(device: str, quick: bool) -> Preset:
    if device == "cuda":
        return GPU_QUICK if quick else GPU
    return CPU_QUICK if quick else CPU_FULL
