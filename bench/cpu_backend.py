"""CPU fused linear log-prob, fwd+bwd: the C++ backend against the chunked-PyTorch backend, the
eager reference (full [N, V] logits) and Liger's chunked selective log-prob.

    python bench/cpu_backend.py [--N 4096 --H 512 --V 32000 --repeats 5]

Times: one process, implementations interleaved round by round after one warm-up each, median
of `--repeats`. Peak extra memory: one fresh subprocess per implementation, the peak resident
set (VmHWM, reset after the inputs are allocated) minus the resident set before the call; it
includes the gradients dhidden and dweight.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import fgrpo_kernels
from fgrpo_kernels import fused_linear_logprobs, reference
from fgrpo_kernels.benchmarks.process_memory import PeakRSS

IMPLS = ("cpp", "chunked", "eager", "liger")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def logprob_fn(impl: str):
    os.environ.setdefault("FGRPO_BACKEND", "cpu")
    if impl in ("cpp", "chunked"):
        os.environ["FGRPO_CPU_BACKEND"] = "cpp" if impl == "cpp" else "torch"
        assert fgrpo_kernels.cpu_backend() == ("cpp" if impl == "cpp" else "torch")
        return fused_linear_logprobs
    if impl == "eager":
        return reference.logprobs
    from liger_kernel.chunked_loss.fused_linear_ppo import (
        _SELECTIVE_LOGPROB_VOCAB_CHUNK_SIZE,
        _ChunkedSelectiveLogProbFunction,
    )

    def liger(hidden, weight, targets):
        return _ChunkedSelectiveLogProbFunction.apply(
            hidden, weight, targets, None, 1.0, _SELECTIVE_LOGPROB_VOCAB_CHUNK_SIZE
        )

    return liger


def make_inputs(N, H, V, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) / H**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=gen)
    upstream = torch.randn(N, generator=gen)
    return hidden, weight, targets, upstream


def step(fn, hidden, weight, targets, upstream) -> tuple[float, float]:
    """One forward + backward of Σ g·logp; (forward s, backward s)."""
    hidden.grad = weight.grad = None
    t0 = time.perf_counter()
    logp = fn(hidden, weight, targets)
    t1 = time.perf_counter()
    (upstream * logp).sum().backward()
    return t1 - t0, time.perf_counter() - t1


def measure_memory(impl: str, N: int, H: int, V: int, dtype) -> dict:
    """Run in a fresh process: peak extra resident memory of one fwd+bwd, in MiB."""
    fn = logprob_fn(impl)
    step(fn, *make_inputs(64, H, 1000, dtype, seed=1))  # load libraries and kernels
    inputs = make_inputs(N, H, V, dtype)
    peak = PeakRSS()
    step(fn, *inputs)
    grads = sum(t.grad.numel() * t.grad.element_size() for t in inputs[:2])
    return {"peak_extra_mib": peak.extra() / 2**20, "grads_mib": grads / 2**20}


def memory_in_subprocess(impl: str, args) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--memory",
        impl,
        "--N",
        str(args.N),
        "--H",
        str(args.H),
        "--V",
        str(args.V),
        "--dtype",
        args.dtype,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--N", type=int, default=4096)
    parser.add_argument("--H", type=int, default=512)
    parser.add_argument("--V", type=int, default=32000)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--memory", choices=IMPLS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    if args.memory:
        print(json.dumps(measure_memory(args.memory, args.N, args.H, args.V, dtype)))
        return

    impls = args.impls.split(",")
    fns = {impl: logprob_fn(impl) for impl in impls}
    inputs = make_inputs(args.N, args.H, args.V, dtype)
    times: dict[str, list[tuple[float, float]]] = {impl: [] for impl in impls}
    for impl in impls:  # warm-up
        os.environ["FGRPO_CPU_BACKEND"] = "torch" if impl == "chunked" else "cpp"
        step(fns[impl], *inputs)
    for _ in range(args.repeats):
        for impl in impls:
            os.environ["FGRPO_CPU_BACKEND"] = "torch" if impl == "chunked" else "cpp"
            times[impl].append(step(fns[impl], *inputs))
    memory = {impl: memory_in_subprocess(impl, args) for impl in impls}

    total = {impl: statistics.median(f + b for f, b in times[impl]) for impl in impls}
    cpu_name = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    print(
        f"{datetime.date.today()} · {cpu_name}, {torch.get_num_threads()} threads · "
        f"torch {torch.__version__} · N {args.N}, H {args.H}, V {args.V}, {args.dtype}, "
        f"fwd+bwd, median of {args.repeats} after 1 warm-up\n"
    )
    print("| implementation | fwd (s) | bwd (s) | fwd+bwd (s) | × cpp time | peak extra (MiB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for impl in impls:
        fwd = statistics.median(f for f, _ in times[impl])
        bwd = statistics.median(b for _, b in times[impl])
        print(
            f"| {impl} | {fwd:.2f} | {bwd:.2f} | {total[impl]:.2f} | "
            f"{total[impl] / total[impls[0]]:.2f} | {memory[impl]['peak_extra_mib']:.0f} |"
        )
    grads = memory[impls[0]]["grads_mib"]
    print(f"\npeak extra includes the gradients dhidden + dweight ({grads:.0f} MiB)")
    if "cpp" in impls:
        for impl in impls:
            if impl != "cpp":
                print(f"cpp is {total[impl] / total['cpp']:.2f}x faster than {impl}")
    print(
        "raw fwd+bwd seconds: "
        + json.dumps({impl: [round(f + b, 3) for f, b in times[impl]] for impl in impls})
    )


if __name__ == "__main__":
    main()
