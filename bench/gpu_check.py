"""One-shot GPU check of the Triton log-prob kernels that always leaves its results on disk.

    python bench/gpu_check.py --out DIR [--budget-s 420]   # CUDA GPU, sized for an H200
    python bench/gpu_check.py --tiny --out DIR             # CPU dry run: interpreter, toy sizes

In order: the cuBLAS out_dtype probe (False is a failure: bf16 backwards would run their
fallback product); correctness against float64 (`bench/gpu_correctness.py`: the realistic
N 4096 × H 4096 × V 151936 bf16 batch with entropy, τ 0.7 and ignored rows; fp16 with
g ≈ 1e-5; V·H and N·H past 2^31; N 1; all rows ignored; a non-contiguous 3-D input; fp32, TF32,
fp16, bf16 + fp32 weight, a frozen weight, several tiles in both loop orders, every bf16
autotune candidate, bitwise determinism, the single-pass GRPO loss in bf16 / fp32 / fp16 over
several chunks; tolerances tied to each dtype's rounding floor); then timing
(`bench/gpu_timing.py`): a plain cuBLAS bf16 GEMM of the shape (the practical ceiling), ours
(autotuned), eager PyTorch, Liger-Kernel, Cut Cross-Entropy if it imports, the GRPO loss on the
single pass, the two-pass path and Liger's chunked GRPO loss, torch.compile if time remains;
forward and backward timed separately, peak memory, and the ratio to the 8·N·H·V FLOP floor
(6·N·H·V for the losses) at the measured GEMM rate.

Each case runs in its own try/except (a row says what failed); a CUDA error that poisons the
context skips the remaining GPU work; the deadline (--budget-s, checked between cases, a
SIGALRM watchdog inside one) turns what is left into "skipped (time budget)" rows.
DIR/correctness.csv and DIR/timing.csv are appended and flushed row by row; DIR/meta.json and
DIR/gpu_check.md are written at the start and the end. Exit 1 if a correctness row is not ok.
--only NAME,... runs a subset (case or impl names). Installs nothing.
"""

from __future__ import annotations

import argparse
import csv
import gc
import importlib.util
import json
import os
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--out", type=Path, default=Path("gpu_check_out"))
ARGS.add_argument("--tiny", action="store_true", help="CPU + Triton interpreter, toy sizes")
ARGS.add_argument("--budget-s", type=float, default=420.0, help="deadline for the whole run")
ARGS.add_argument("--iters", type=int, default=5, help="timed rounds per timing row")
ARGS.add_argument("--only", default="", help="comma-separated case / impl names to run")

if __name__ == "__main__":
    _tiny = "--tiny" in sys.argv[1:]
    # the interpreter is chosen when the kernels are decorated: before any fgrpo_kernels import
    os.environ["TRITON_INTERPRET"] = "1" if _tiny else "0"
    os.environ["FGRPO_BACKEND"] = "triton"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_correctness  # noqa: E402
import gpu_timing  # noqa: E402
import torch  # noqa: E402

from fgrpo_kernels.backends.triton import autotune, gemm  # noqa: E402

CORRECTNESS_COLUMNS = ("case", "dtype", "weight_dtype", "N", "H", "V", "bias", "temperature",
                       "entropy", "quantity", "rel_err", "floor", "tol", "ok",
                       "status")  # fmt: skip
TIMING_COLUMNS = ("impl", "pass", "dtype", "N", "H", "V", "status", "fwd_ms", "bwd_ms",
                  "total_ms", "first_call_s", "peak_extra_gib", "tflops", "floor_ms",
                  "ratio_to_floor", "config")  # fmt: skip
SKIPPED = "skipped (time budget)"
COMPILE_RESERVE_S = 90.0  # torch.compile runs only with this much time left


class OutOfTime(Exception):
    pass


class Budget:
    def __init__(self, seconds: float):
        self.seconds, self.end = seconds, time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    @contextmanager
    def watch(self):
        """Raise OutOfTime inside the block at the deadline (SIGALRM, main thread only)."""
        if self.left() <= 0:
            raise OutOfTime
        if not hasattr(signal, "setitimer"):
            yield
            return

        def alarm(signum, frame):
            raise OutOfTime

        old = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, self.left())
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


class Table:
    """One CSV file, each row appended, flushed and fsynced as soon as it exists."""

    def __init__(self, path: Path, columns: tuple[str, ...]):
        self.path, self.columns, self.rows = path, columns, []
        with open(path, "w", newline="") as f:
            csv.DictWriter(f, fieldnames=columns).writeheader()

    def add(self, row: dict) -> None:
        row = {k: f"{v:.4g}" if isinstance(v, float) else v for k, v in row.items()}
        self.rows.append(row)
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns, restval="").writerow(row)
            f.flush()
            os.fsync(f.fileno())
        keys = ("case", "impl", "pass", "N", "quantity", "rel_err", "tol", "total_ms", "status")
        shown = {k: row[k] for k in keys if row.get(k) not in (None, "")}
        print(" ".join(f"{k}={v}" for k, v in shown.items()), flush=True)


class Runner:
    """Runs one case at a time: a failure, an OOM, a time-out is a row, never the end."""

    def __init__(self, budget: Budget, dev: torch.device):
        self.budget, self.dev, self.lost = budget, dev, None

    def run(self, table: Table, base: dict, fn) -> None:
        if self.lost:
            table.add(base | {"status": f"skipped (CUDA context lost: {self.lost})"})
            return
        if self.budget.left() <= 0:
            table.add(base | {"status": SKIPPED})
            return
        status = None
        try:
            with self.budget.watch():
                rows = fn()
        except OutOfTime:
            status = f"timeout (budget {self.budget.seconds:.0f} s)"
        except Exception as error:  # noqa: BLE001 - whatever failed, the row says so
            if isinstance(error, torch.cuda.OutOfMemoryError):
                status = f"OOM: {first_line(error)}"
            else:
                status = f"error: {type(error).__name__}: {first_line(error)}"
            traceback.print_exc()
            if "CUDA error" in str(error) or "illegal memory access" in str(error):
                self.lost = first_line(error)
        self.release(synchronize=status is None or not status.startswith("timeout"))
        if status is not None:
            table.add(base | {"status": status})
            return
        for row in rows:
            table.add(base | {"status": "ok"} | row)

    def release(self, synchronize: bool) -> None:
        """Free what the case held; a CUDA error surfacing here loses the context. No sync after
        a time-out (the work may never finish)."""
        gc.collect()
        if self.dev.type != "cuda" or self.lost:
            return
        try:
            if synchronize:
                torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception as error:  # noqa: BLE001
            self.lost = first_line(error)


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:200]


# -------------------------------------------------------------------------------------- main


ON_CPU = "skipped (CPU: no such kernel)"


def probe(table: Table, dev, available: bool) -> None:
    """The out_dtype probe as a correctness row; on a GPU, False fails the run, loudly."""
    if dev.type == "cuda" and not available:
        print("=" * 78 + "\ngpu_check: FAILED: torch.mm/addmm have no out_dtype=float32 for bf16"
              " here;\nthe bf16 backward runs its fallback product. Use a newer torch.\n"
              + "=" * 78, file=sys.stderr, flush=True)  # fmt: skip
    table.add({"case": "out_dtype_mm_probe", "quantity": "available", "ok": int(available),
               "status": "ok" if dev.type == "cuda" else ON_CPU})  # fmt: skip


def failures(rows: list[dict]) -> list[dict]:
    """Correctness rows that are not ok (skipped and failed ones included)."""
    return [r for r in rows if str(r.get("ok")) != "1" and r["status"] != ON_CPU]


def environment(dev, tiny: bool) -> dict:
    import triton

    env = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)",
           "torch": torch.__version__, "triton": triton.__version__,
           "mode": "tiny" if tiny else "full", "cuda": torch.version.cuda}  # fmt: skip
    for name, module in (("liger", "liger_kernel"), ("cut_cross_entropy", "cut_cross_entropy")):
        env[name] = "installed" if importlib.util.find_spec(module) else "not installed"
    return env


def summary(out: Path, env: dict, tables: dict[str, Table]) -> None:
    (out / "meta.json").write_text(json.dumps(env, indent=1, default=str) + "\n")
    lines = ["# gpu_check", ""] + [f"- {k}: {v}" for k, v in env.items()]
    for title, table in tables.items():
        lines += ["", f"## {title}", "", "| " + " | ".join(table.columns) + " |",
                  "|" + "---|" * len(table.columns)]  # fmt: skip
        lines += ["| " + " | ".join(str(r.get(c, "")) for c in table.columns) + " |"
                  for r in table.rows]  # fmt: skip
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    args = ARGS.parse_args(argv)
    budget = Budget(args.budget_s)
    only = {s for s in args.only.split(",") if s}
    if args.tiny:
        dev, (H, V) = torch.device("cpu"), (33, 211)
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device; use --tiny on a CPU", file=sys.stderr)
            return 2
        dev, (H, V) = torch.device("cuda"), (4096, 151936)
    args.out.mkdir(parents=True, exist_ok=True)
    tables = {"Correctness": Table(args.out / "correctness.csv", CORRECTNESS_COLUMNS),
              "Timing": Table(args.out / "timing.csv", TIMING_COLUMNS)}  # fmt: skip
    env = environment(dev, args.tiny)
    summary(args.out, env, tables)
    runner = Runner(budget, dev)
    corr, tim = tables["Correctness"], tables["Timing"]

    env["cublas_out_dtype_mm"] = gemm.has_out_dtype_mm(dev)
    probe(corr, dev, env["cublas_out_dtype_mm"])

    pinned = os.environ.get(autotune.ENV)
    os.environ[autotune.ENV] = "0"  # correctness on the default tiles; each candidate below
    try:
        for name, (p, fn) in gpu_correctness.cases(args.tiny).items():
            if not only or name in only:
                runner.run(corr, p.base(name), lambda p=p, fn=fn: fn(p, dev))
    finally:
        if pinned is None:
            os.environ.pop(autotune.ENV)
        else:
            os.environ[autotune.ENV] = pinned
    rates: dict[int, float] = {}
    for impl, pass_, N in gpu_timing.timing_plan(args.tiny):
        if only and impl not in only:
            continue
        base = {"impl": impl, "pass": pass_, "dtype": "bf16", "N": N, "H": H, "V": V}
        why = gpu_timing.unavailable(impl, dev)
        if impl == "torch_compile" and budget.left() < (0 if args.tiny else COMPILE_RESERVE_S):
            why = f"skipped (< {COMPILE_RESERVE_S:.0f} s left)"
        if why:
            tim.add(base | {"status": why})
            continue
        runner.run(
            tim,
            base,
            lambda i=impl, s=pass_, n=N: gpu_timing.time_row(
                i, s, n, H, V, dev, args.iters, rates, args.tiny
            ),
        )
    env["autotune"] = gpu_timing.tuned_configs()
    env["wall_s"] = round(args.budget_s - budget.left(), 1)
    summary(args.out, env, tables)
    bad = failures(corr.rows)
    print(
        f"gpu_check: {len(corr.rows) - len(bad)}/{len(corr.rows)} correctness rows ok, "
        f"{len(tim.rows)} timing rows, {env['wall_s']} s; files in {args.out}",
        flush=True,
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
