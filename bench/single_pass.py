"""Single pass vs two-pass fused GRPO loss on the CPU, with eager PyTorch and Liger in the run.

    python bench/single_pass.py [--N 16384 --V 32768 --H 128 --threads 1 --rounds 3]
                                [--impls two_pass,single,eager,liger] [--out results.json]

GRPO "dapo" (β 0.04, ε 0.2, reference log-probs given), fp32, forward + backward, the
workload of `fgrpo bench` (`fgrpo_kernels.benchmarks.peers`). Every measurement is a fresh process
(`--child`) with the same thread count (OMP/MKL and torch); rounds interleave the
implementations so that a drifting machine load hits them alike. In the child: the inputs are
built and the backend loaded (the C++ library is a one-time ~150 MiB of the process, not of a
call), one warm-up on the first T/8 tokens of every completion (same code path), then the high-water
mark of the resident set is reset and one full-size call is timed: wall time, process CPU
time and the peak extra resident memory (VmHWM − VmRSS, `process_memory.PeakRSS`). "two_pass"
is our module with FGRPO_MAX_CHUNK_BYTES=0 (the path before the single pass), "single" the
default. The 1-minute load average is recorded before every child. Prints a table of medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

IMPLS = {  # name -> (`fgrpo bench` peer, extra environment)
    "two_pass": ("ours", {"FGRPO_MAX_CHUNK_BYTES": "0"}),
    "single": ("ours", {}),
    "eager": ("eager", {}),
    "liger": ("liger (eager)", {}),  # as on the CPU before: Liger's compiled=False
}


def child(impl: str, N: int, V: int, H: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    import fgrpo_kernels
    from fgrpo_kernels.benchmarks.peers import PEERS
    from fgrpo_kernels.benchmarks.presets import Case
    from fgrpo_kernels.benchmarks.process_memory import PeakRSS
    from fgrpo_kernels.benchmarks.workload import Workload, run_step

    peer = PEERS[IMPLS[impl][0]]
    case = Case(IMPLS[impl][0], "grpo", "fwd+bwd", N, V, H, "float32", "cpu")
    step = peer.step("grpo", "cpu")
    w = Workload.make(case)
    fgrpo_kernels.cpu_backend()  # loads the C++ library (a one-time cost of the process)
    run_step(step, w.prefix(), "fwd+bwd")  # warm-up: the same code path on N/8 tokens
    w.zero_grad()
    peak = PeakRSS()
    c0, t0 = time.process_time(), time.perf_counter()
    loss = run_step(step, w, "fwd+bwd")
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"impl": impl, "backend": peer.backend("cpu"), "wall_s": wall, "cpu_s": cpu,
            "peak_mib": peak.extra() / 2**20, "threads": torch.get_num_threads(),
            "loss": float(loss.detach())}  # fmt: skip


def load() -> float:
    return os.getloadavg()[0]


def measure(impl: str, args) -> dict:
    env = dict(os.environ, **IMPLS[impl][1])
    env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    cmd = [sys.executable, __file__, "--child", impl, "--N", str(args.N), "--V", str(args.V),
           "--H", str(args.H), "--threads", str(args.threads)]  # fmt: skip
    before = load()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        return {"impl": impl, "error": done.stderr.strip()[-400:], "load": before}
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "load": before}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--N", type=int, default=16384)
    ap.add_argument("--V", type=int, default=32768)
    ap.add_argument("--H", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", choices=tuple(IMPLS))
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.N, args.V, args.H, args.threads)), flush=True)
        return 0
    impls = args.impls.split(",")
    rows = []
    for r in range(args.rounds):
        for impl in impls:
            row = measure(impl, args)
            rows.append({"round": r, **row})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\nN {args.N} × V {args.V} × H {args.H}, fp32, GRPO dapo fwd+bwd, "
          f"{args.threads} thread(s), {args.rounds} rounds (medians)\n")  # fmt: skip
    print("| impl | backend | wall s | CPU s | peak extra MiB | load (1 min) | vs two_pass |")
    print("|---|---|---|---|---|---|---|")
    ok = {i: [x for x in rows if x["impl"] == i and "error" not in x] for i in impls}
    base = statistics.median(x["wall_s"] for x in ok["two_pass"]) if ok.get("two_pass") else None
    for impl in impls:
        xs = ok[impl]
        if not xs:
            print(f"| {impl} | error | | | | | |")
            continue
        wall = statistics.median(x["wall_s"] for x in xs)
        cpu = statistics.median(x["cpu_s"] for x in xs)
        peak = statistics.median(x["peak_mib"] for x in xs)
        loads = ", ".join(f"{x['load']:.1f}" for x in xs)
        ratio = f"{wall / base:.2f}×" if base else ""
        print(f"| {impl} | {xs[0]['backend']} | {wall:.2f} | {cpu:.2f} | {peak:.1f} | {loads} | "
              f"{ratio} |")  # fmt: skip
    if args.out:
        report = {"args": vars(args), "rows": rows}
        args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
