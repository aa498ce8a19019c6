"""A rough time estimate per case, for `--dry-run` (the plan) and for the budget of a CUDA run
(whose cases run in-process and cannot be stopped once started).

A case costs its setup, the oracle check, its warm-up and timed runs (`Policy`: one warm-up,
runs until `min_time_s`, at most `repeats`) and, for a peer that compiles, its first call. One
run takes `SLOWDOWN[impl] × k·N·H·V / rate`, with the GEMM rate and the slowdowns over the
floor from the H200 run of 2026-12-04 (bench/results/gpu-h200/2026-12-04/; peers it did not
time get a guess, marked below). On CPU the per-element work (`CPU_ELEMENT_S` per N·V element
per run) dominates. These are plans, not measurements: the report holds what was measured.
"""

from __future__ import annotations

import math

from .peers import PEERS

# FLOP/s of the matmul, by (device, dtype): CUDA from the H200 cuBLAS bf16 GEMM of 2026-12-04
# (697–779 TFLOP/s); fp32 and the CPU rates are rough guesses.
RATE = {
    ("cuda", "bfloat16"): 700e12, ("cuda", "float16"): 700e12, ("cuda", "float32"): 50e12,
    ("cpu", "float32"): 1.5e11, ("cpu", "bfloat16"): 3e10, ("cpu", "float16"): 1e10,
}  # fmt: skip
# time / floor on the H200 (2026-12-04: gpu_check_timing*.csv and bench_gpu_quick.md, at the
# floor with k as `Peer.floor_k` gives it); "guess": not timed in that run.
SLOWDOWN = {
    "gemm": 1.0,
    "eager": 1.45,  # bf16 eager fwd+bwd 58.1 ms at 8k: 1.44 × 6·NHV (40.4 ms)
    "compile": 1.25,  # 49.2 ms at 8k: 1.22 × 6·NHV
    "liger_flce": 1.6,  # 111.7 ms at 8k, 282 at 32k: 2.07× and 1.21× of 8·NHV
    "liger": 14.0,  # chunked GRPO loss 554 ms at 8k: 13.7 × 6·NHV
    "liger (eager)": 14.0,  # guess: as compiled
    "liger_triton": 1.15,  # 44.8 ms at 8k: 1.11 × 6·NHV
    "cce": 3.3,  # 186 ms at 8k: 3.45 × 8·NHV; 741.8 at 32k: 3.17×
    "trl": 3.0,  # guess
    "verl": 4.0,  # guess
    "verl_triton": 2.0,  # guess
    "ours": 1.4,  # 74.0 ms (log-probs, 8·NHV) and 55.9 ms (GRPO, 6·NHV) at 8k: 1.37×, 1.38×
    "ours_two_pass": 1.4,  # 74.9 ms at 8k: 1.39 × 8·NHV
}
# one-time cost of a case's first call on CUDA (compile, autotune), seconds, from first_call_s
# and compile_s of 2026-12-04 (5.5–7.8 s at 8k)
FIRST_CALL_S = {"compile": 8.0, "cce": 8.0, "liger": 4.0, "ours": 4.0, "ours_two_pass": 2.0}
# CPU, fp32, per N·V element and run (the elementwise work dominates at H ≤ 256): ours 5.6e-9 s
# on the 2-core machine of 2026-12-05 (`fgrpo bench --device cpu --quick`, H 128), the others
# as multiples of it from the same run (verl: a guess)
CPU_ELEMENT_S = 5.6e-9
CPU_ELEMENT_FACTOR = {"eager": 5.2, "compile": 2.1, "cce": 2.4, "liger": 7.7, "trl": 5.2,
                      "verl": 6.0, "liger (eager)": 7.7, "ours_two_pass": 1.2}  # fmt: skip
SETUP_S = {"cuda": 1.0, "cpu": 3.0}  # inputs, process start, oracle check
CPU_COMPILE_S = 12.0  # inductor on 2 cores, one compile-worker thread (same run: 7-15 s)
TRAIN_GPU_STEP = {"trl": 1.0, "trl_liger_kernel": 0.95, "ours": 0.9}  # relative, a guess


def run_seconds(case) -> float:
    """One timed run of `case`."""
    if case.workload == "train-gpu":
        from .train_gpu import step_flops

        return (
            step_flops(case)
            / (0.35 * RATE[(case.device, case.dtype)])
            * TRAIN_GPU_STEP.get(case.impl, 1.0)
        )
    if case.workload not in ("gemm", "logprobs", "grpo", "fgrpo"):
        return 1.0
    peer = PEERS.get(case.impl)
    k = 2 if case.workload == "gemm" else peer.floor_k(case.workload, case.pass_, case.device)
    nhv = case.tokens * case.hidden * case.vocab
    if case.device == "cpu" and case.workload == "gemm":  # timed on at most 4096 rows
        return 2 * min(case.tokens, 4096) * case.hidden * case.vocab / RATE[("cpu", case.dtype)]
    if case.device == "cpu":
        factor = CPU_ELEMENT_FACTOR.get(case.impl, 1.0) * (0.5 if case.pass_ == "fwd" else 1.0)
        elements = factor * CPU_ELEMENT_S * case.tokens * case.vocab
        return elements + k * nhv / RATE[("cpu", "float32")]
    return SLOWDOWN.get(case.impl, 3.0) * k * nhv / RATE[(case.device, case.dtype)]


def case_seconds(case) -> float:
    """Setup, check, warm-up, timed runs and first-call cost of `case`, in seconds."""
    policy, one = case.policy, run_seconds(case)
    timed = max(1, min(policy.repeats, math.ceil(policy.min_time_s / max(one, 1e-6))))
    warm = policy.warmup * (one / 8 if policy.warmup_small else one)
    first = 0.0
    peer = PEERS.get(case.impl)
    if peer is not None and peer.compiles:
        first = CPU_COMPILE_S if case.device == "cpu" else FIRST_CALL_S.get(case.impl, 6.0)
    elif case.device == "cuda":
        first = FIRST_CALL_S.get(case.impl, 0.5)
    if case.workload == "train-gpu":
        first = 6.0  # the model on the device, the trainer
    return SETUP_S[case.device] + first + warm + timed * one


PROCESS_START_S = {"cuda": 15.0, "cpu": 10.0}  # imports, CUDA context, the C++ library
REPORT_S = 0.5  # results.md and bench.png, rewritten after every case


def plan(cases) -> tuple[list[str], float]:
    """One line per case with its estimate, and the total (seconds) from process start,
    the report's rewrite after every case included."""
    device = cases[0].device if cases else "cpu"
    lines, total = [], PROCESS_START_S[device] + REPORT_S * len(cases)
    for case in cases:
        s = case_seconds(case)
        total += s
        lines.append(f"{case.label()}  ~{s:.1f} s")
    return lines, total
