"""Measuring one case: median time over repeats after warm-up, and peak memory beyond the inputs.

- CUDA: in-process, CUDA events; `reset_peak_memory_stats` per case, peak = max_memory_allocated
  − memory_allocated after the inputs were built.
- CPU: every case in a fresh process (forked from a server that has only imported torch, this
  package and the peers, so no case pays the imports, or `python -m fgrpo_kernels.benchmarks.measure
  CASE` with JSON on stdout for `isolation="exec"`). Peak = VmHWM − VmRSS, with the high-water
  mark reset (`process_memory.PeakRSS`) after the inputs were built. Wall time (perf_counter)
  and the process CPU time per run are both kept: on a shared machine the second is steadier.

Out-of-memory (an allocator error, or the child killed by SIGKILL), a timeout or any error is
a result row with that status, never an exception; a peer whose package is missing is an
`unavailable` row. In a child process, `policy.max_mem_gib` caps the data segment (RLIMIT_DATA)
above what the inputs use, which makes a real CPU out-of-memory at a chosen size.
FGRPO_BENCH_FAKE="oom:IMPL" (or "kill:IMPL", "error:IMPL", "wrong:IMPL"; IMPL may be "*") fakes
a failure ("wrong": the peer's output is scaled by 1.01 in the oracle check).

Before a peer's case is timed, `oracle.check` compares its values and gradients with a float64
computation on the case's first tokens; a peer that fails is a `wrong` row and is not timed. The
`gemm` case is the matmul of the shape alone (cuBLAS on CUDA), the rate of every row's floor. A
peer with a `fallback` (Liger's compiled loss) whose compile fails in dynamo or inductor is
measured as its fallback, in a row named after it whose note gives the error.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import multiprocessing
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import time

import torch

from . import oracle
from .peers import PEERS
from .presets import Case
from .process_memory import PeakRSS, status_bytes
from .workload import VARIANT_WORKLOADS, Workload, run_step

PRELOAD = ["torch", "fgrpo_kernels", "fgrpo_kernels.benchmarks.peers", "liger_kernel.chunked_loss",
           "trl.kernels", "cut_cross_entropy"]  # fmt: skip


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(exc).lower()
    return any(s in text for s in ("out of memory", "can't allocate memory", "not enough memory"))


_ALLOCATION = re.compile(r"tried to allocate (\d+(?:\.\d+)?) ?(bytes|[KMGT]iB)", re.IGNORECASE)


def oom_note(exc: BaseException) -> str:
    """An out-of-memory error as a note whose first words say it all ("out of memory: tried to
    allocate 4.00 GiB; RuntimeError: [enforce fail ...] DefaultCPUAllocator: ..."): the table
    cuts notes short, and the CPU allocator's message only names the size after 100 characters."""
    first = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    found = _ALLOCATION.search(str(exc))
    if found is None:
        return first if "memory" in first.lower() else f"out of memory; {first}"
    amount, unit = found.groups()
    size = f"{float(amount) / 2**30:.2f} GiB" if unit.lower() == "bytes" else f"{amount} {unit}"
    return f"out of memory: tried to allocate {size}; {first}"


def _fake_failure(case: Case) -> None:
    kind, _, impl = os.environ.get("FGRPO_BENCH_FAKE", "").partition(":")
    if not kind or impl not in (case.impl, "*"):
        return
    if kind == "oom":
        raise torch.OutOfMemoryError(f"FGRPO_BENCH_FAKE: simulated out of memory in {case.impl}")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "wrong":
        return
    raise RuntimeError(f"FGRPO_BENCH_FAKE: simulated error in {case.impl}")


class _CpuMemory:
    def __init__(self, max_mem_gib: float | None):
        gc.collect()
        if max_mem_gib is not None:
            cap = status_bytes("VmData") + int(max_mem_gib * 2**30)
            hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
            resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
        self._rss = PeakRSS()

    def peak(self) -> int:
        return self._rss.extra()


class _CudaMemory:
    def __init__(self, max_mem_gib: float | None):
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.base = torch.cuda.memory_allocated()

    def peak(self) -> int:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - self.base


class KernelJob:
    """One peer's step on the case's `Workload` (or `w`, the tensors of a case of the same seed
    and sizes); `run(small)` is one unit of work."""

    def __init__(self, case: Case, w: Workload | None = None):
        self.step = PEERS[case.impl].step(case.workload, case.device)
        self.w = Workload.make(case) if w is None else w
        self.pass_ = case.pass_
        self.case = case

    def check(self) -> tuple[bool, dict, str]:
        """The oracle check of this peer on the case's first tokens (`oracle.check`)."""
        step = self.step
        if os.environ.get("FGRPO_BENCH_FAKE", "") in (f"wrong:{self.case.impl}", "wrong:*"):
            step = lambda w: self.step(w) * 1.01  # noqa: E731 — a peer 1 % off
        c = self.case
        return oracle.check(step, self.w, c.workload, c.pass_, c.dtype)

    def run(self, small: bool = False) -> torch.Tensor:
        return run_step(self.step, self.w.prefix() if small else self.w, self.pass_)

    def reset(self) -> None:
        self.w.zero_grad()


class GemmJob:
    """The matmul of the shape, hidden [N, H] @ weight.T into a kept [N, V] buffer in the
    input dtype (cuBLAS on CUDA): the rate of the FLOP floor. On CPU, `CPU_GEMM_ROWS` rows of
    it, the time scaled to N (`scale`)."""

    def __init__(self, case: Case):
        dev, dtype = torch.device(case.device), getattr(torch, case.dtype)
        rows = case.tokens if case.device == "cuda" else min(case.tokens, CPU_GEMM_ROWS)
        gen = torch.Generator(device=dev).manual_seed(case.seed)
        self.h = torch.randn(rows, case.hidden, generator=gen, device=dev).to(dtype)
        self.w = (torch.randn(case.vocab, case.hidden, generator=gen, device=dev) * 0.05).to(dtype)
        self.out = torch.empty(rows, case.vocab, device=dev, dtype=dtype)
        self.scale = case.tokens / rows

    def run(self, small: bool = False) -> float:
        torch.mm(self.h, self.w.T, out=self.out)
        return float("nan")

    def reset(self) -> None:
        pass


CPU_GEMM_ROWS = 4096


def _job(case: Case):
    if case.workload == "train-step":
        from .train_step import TrainStepJob

        return TrainStepJob(case)
    if case.workload == "train-gpu":
        from .train_gpu import TrainGpuJob

        return TrainGpuJob(case)
    if case.workload == "gemm":
        return GemmJob(case)
    return KernelJob(case)


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _time_one(job, case: Case, small: bool) -> tuple[float, float, object]:
    """(wall seconds, process CPU seconds, output) of one run; CUDA times with events."""
    _fake_failure(case)
    if case.device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = job.run(small)
        end.record()
        end.synchronize()
        job.reset()
        return start.elapsed_time(end) / 1e3, float("nan"), out
    c0, t0 = _cpu_seconds(), time.perf_counter()
    out = job.run(small)
    t, c = time.perf_counter() - t0, _cpu_seconds() - c0
    job.reset()
    return t, c, out


def _checksum(out) -> float:
    """The sum of a step's output (the loss, or Σ log-probs): equal across peers doing the same
    work, up to their rounding."""
    return float(out.detach().double().sum()) if isinstance(out, torch.Tensor) else float(out)


def row(case: Case, status: str, note: str = "", **values) -> dict:
    """A result row: the case, its status, and whatever was measured."""
    peer = PEERS.get(case.impl)
    own = case.workload in OWN_WORKLOADS
    backend = peer.backend(case.device) if peer and not own else ""
    if case.workload == "gemm":
        backend = "cuBLAS" if case.device == "cuda" else "torch.mm"
    k = peer.floor_k(case.workload, case.pass_, case.device) if peer and not own else None
    k = 2 if case.workload == "gemm" else k
    return {"case": dataclasses.asdict(case), "status": status, "note": note[:300],
            "backend": backend, "floor_k": k, **values}  # fmt: skip


OWN_WORKLOADS = ("train-step", "train-gpu", "vocab-parallel", "gemm")


def interpreting() -> bool:
    """Triton kernels run on CPU tensors (TRITON_INTERPRET=1, as in the test suite)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _unavailable(case: Case) -> str | None:
    if case.workload in ("train-step", "gemm"):
        return None
    if case.workload == "train-gpu":
        from .train_gpu import unavailable

        return unavailable(case)
    if case.workload == "vocab-parallel":
        return None if case.device == "cpu" else "vocab-parallel runs on CPU ranks (gloo) only"
    peer = PEERS.get(case.impl)
    if peer is None:
        return f"no impl named {case.impl!r}"
    if case.device not in peer.devices and not (peer.interpreted and interpreting()):
        return f"{case.impl} runs on {'/'.join(peer.devices)} only (Triton kernels)"
    if not peer.runs(case.workload):
        return f"{case.impl} has no {case.workload} of its own"
    return None


def _failure(exc: BaseException) -> tuple[str, str]:
    """(status, note) of a case that raised."""
    if is_oom(exc):
        return "oom", oom_note(exc)
    return "error", f"{type(exc).__name__}: {exc}"


def is_compile_error(exc: BaseException) -> bool:
    """An error raised by dynamo or inductor (or one they caused)."""
    while exc is not None:
        if any(c.__module__.startswith(("torch._dynamo", "torch._inductor"))
               for c in type(exc).__mro__):  # fmt: skip
            return True
        exc = exc.__cause__
    return False


def measure_here(case: Case, cap_memory: bool = False) -> dict:
    """Measure `case` in this process; every failure becomes a row. `cap_memory` applies the
    policy's memory cap (to a child process only: the limit stays for the process's life). A
    peer with a fallback whose compile fails is measured as its fallback."""
    result = _measure_here(case, cap_memory)
    peer = PEERS.get(case.impl)
    if peer and peer.fallback and result.get("compile_failed"):
        error = result["note"]
        result = _measure_here(dataclasses.replace(case, impl=peer.fallback), cap_memory)
        result["note"] = f"{case.impl} failed to compile ({error})"[:300] + (
            f"; {result['note']}" if result["note"] else ""
        )
    result.pop("compile_failed", None)
    return result


def _scale_note(job, case: Case) -> tuple[float, str]:
    """(the factor from the rows timed to N, the row's note)."""
    scale = getattr(job, "scale", 1.0)
    if scale != 1.0:
        return scale, f"timed on {case.tokens / scale:.0f} rows, scaled to N"
    return scale, getattr(job, "note", "")


def _repeat(job, case: Case) -> tuple[list[float], list[float], float | None, object]:
    """(wall times, CPU times, the first run's time, the last output): the policy's warm-ups,
    then timed runs until `min_time_s` is reached or `repeats` are done."""
    policy = case.policy
    times, cpus, first, out = [], [], None, None
    for i in range(policy.warmup + policy.repeats):
        if i > policy.warmup and sum(times) >= policy.min_time_s:
            break
        warm = i < policy.warmup
        t, c, out = _time_one(job, case, warm and policy.warmup_small)
        first = t if first is None else first
        if not warm:
            times.append(t)
            cpus.append(c)
    return times, cpus, first, out


def _paired_with_grpo(job, case: Case) -> dict:
    """Our policy variant against our GRPO loss on the same tensors in the same process, run by
    turns (variant, GRPO) `repeats` times: the GRPO loss's median time and the median of the
    per-turn ratios (a drifting machine load hits both alike). Other rows: {}."""
    if not (isinstance(job, KernelJob) and case.impl == "ours"
            and case.workload in VARIANT_WORKLOADS):  # fmt: skip
        return {}
    grpo = KernelJob(dataclasses.replace(case, workload="grpo"), job.w)
    base, ratios = [], []
    for _ in range(max(case.policy.repeats, 1)):
        t_variant = _time_one(job, case, False)[0]
        t_grpo = _time_one(grpo, case, False)[0]
        base.append(t_grpo)
        ratios.append(t_variant / t_grpo)
    return {"grpo_paired_ms": 1e3 * statistics.median(base),
            "vs_grpo_paired": statistics.median(ratios)}  # fmt: skip


def _measure_here(case: Case, cap_memory: bool) -> dict:
    why = _unavailable(case)
    if why is not None:
        skipped = why.startswith("skipped: ")
        return row(case, "skipped" if skipped else "unavailable", why.removeprefix("skipped: "))
    policy = case.policy
    job = mem = None
    if case.workload == "vocab-parallel":  # its ranks measure themselves
        from . import vocab_parallel

        try:
            return row(case, "ok", **vocab_parallel.measure(case), process_cpu_s=_cpu_seconds())
        except Exception as e:  # noqa: BLE001 — every failure is a data point
            return row(case, *_failure(e))
    try:
        if case.device == "cuda":
            torch._dynamo.reset()  # in-process: no graph or recompile count leaks between cases
        try:
            job = _job(case)
        except ImportError as e:
            peer = PEERS.get(case.impl)
            note = peer.missing(e) if peer and peer.package else f"{type(e).__name__}: {e}"
            return row(case, "unavailable", note)
        checked = None
        if isinstance(job, KernelJob):
            ok, errors, checked = job.check()
            if not ok:
                return row(case, "wrong", checked, check=checked, process_cpu_s=_cpu_seconds())
        cap = policy.max_mem_gib if cap_memory and case.device == "cpu" else None
        mem = (_CudaMemory if case.device == "cuda" else _CpuMemory)(cap)
        compiles = PEERS[case.impl].compiles if case.impl in PEERS else False
        times, cpus, first, out = _repeat(job, case)
        scale, note = _scale_note(job, case)
        peak = mem.peak() / 2**20  # before the paired runs below
        return row(
            case,
            "ok",
            note,
            time_ms=1e3 * statistics.median(times) * scale,
            cpu_time_ms=1e3 * statistics.median(cpus) * scale,
            check=checked,
            peak_mem_mib=peak,
            repeats=len(times),
            compile_s=first if compiles else None,
            checksum=_checksum(out),
            process_cpu_s=_cpu_seconds(),
            **_paired_with_grpo(job, case),
        )
    except Exception as e:  # noqa: BLE001 — every failure is a data point
        peak = None if mem is None else mem.peak() / 2**20
        status, note = _failure(e)
        out = row(case, status, note, peak_mem_mib=peak, process_cpu_s=_cpu_seconds())
        if status == "error" and is_compile_error(e):
            out["compile_failed"] = True
        return out
    finally:
        del job
        gc.collect()
        if case.device == "cuda":
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- CPU isolation

_SERVER = None


def _server() -> multiprocessing.context.BaseContext:
    global _SERVER
    if _SERVER is None:
        _SERVER = multiprocessing.get_context("forkserver")
        _SERVER.set_forkserver_preload(PRELOAD)
    return _SERVER


def _child(case: Case, env: dict, conn) -> None:
    os.environ.clear()
    os.environ.update(env)  # the forkserver's environment is the one it started with
    if "MALLOC_MMAP_THRESHOLD_" in env:  # glibc read its environment at the server's start
        ctypes.CDLL(None).mallopt(-3, int(env["MALLOC_MMAP_THRESHOLD_"]))  # -3: M_MMAP_THRESHOLD
    conn.send(measure_here(case, cap_memory=True))
    conn.close()


def _died(case: Case, code: int | None, stderr: str = "") -> dict:
    if code is not None and code in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return row(case, "oom", "killed by SIGKILL (the OOM killer?)")
    return row(case, "error", f"worker exited with {code}: {stderr.strip()[-250:]}")


def measure_forked(case: Case) -> dict:
    sent, code = run_forked(_child, (case, dict(os.environ)), case.policy.timeout_s)
    if sent is not None:
        return sent
    if code is None:
        return row(case, "timeout", f"no result after {case.policy.timeout_s:.0f} s")
    return _died(case, code)


# A child that has sent its row gets this long to exit by itself before it is killed.
EXIT_GRACE_S = 30.0


def run_forked(target, args: tuple, timeout_s: float):
    """Run `target(*args, conn)` in a process forked from the preloaded server; it sends one
    object through `conn`. Returns (that object, exit code), (None, exit code) when it died
    without sending, or (None, None) when nothing came within `timeout_s` (it is killed).

    NB: a child that sent its result is joined, not killed: its exit runs the finalizers that
    unlink its semaphores (tqdm's lock, created in the child by torch.compile); killed at
    once, it left them to the resource tracker, which reported them leaked at exit."""
    ctx = _server()
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args, send), daemon=True)
    proc.start()
    send.close()
    sent = None
    try:
        if recv.poll(timeout_s):
            sent = recv.recv()
            proc.join(EXIT_GRACE_S)
        elif proc.is_alive():
            return None, None
    except EOFError:
        pass
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        recv.close()
    return sent, proc.exitcode


def measure_exec(case: Case) -> dict:
    cmd = [sys.executable, "-m", __spec__.name, json.dumps(dataclasses.asdict(case))]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=case.policy.timeout_s)
    except subprocess.TimeoutExpired:
        return row(case, "timeout", f"no result after {case.policy.timeout_s:.0f} s")
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return _died(case, done.returncode, done.stderr)
    return json.loads(lines[-1])


def measure(case: Case, isolation: str = "fork") -> dict:
    """One case → one row. CUDA runs in this process; CPU in a fresh process."""
    if case.device == "cuda" or case.workload == "vocab-parallel":  # its ranks are fresh
        return measure_here(case)
    return {"fork": measure_forked, "exec": measure_exec, "none": measure_here}[isolation](case)


def main(argv: list[str] | None = None) -> None:
    case = Case.from_dict(json.loads((sys.argv[1:] if argv is None else argv)[0]))
    print(json.dumps(measure_here(case, cap_memory=True)), flush=True)


if __name__ == "__main__":
    main()
