"""One-shot GPU check of the Triton log-prob kernels that always leaves its results on disk.

    python bench/gpu_check.py --out DIR [--budget-s 420]   # CUDA GPU, sized for an H200
    python bench/gpu_check.py --tiny --out DIR             # CPU dry run: interpreter, toy sizes

In order: the cuBLAS out_dtype probe (False is a failure: bf16 backwards would run their
fallback product); correctness against float64 on the same rounded inputs (`CASES`: the
realistic N 4096 × H 4096 × V 151936 bf16 batch with entropy, τ 0.7 and ignored rows; fp16
with g ≈ 1e-5; V·H and N·H past 2^31; N 1; all rows ignored; a non-contiguous 3-D input; fp32,
TF32, fp16, bf16 + fp32 weight, a frozen weight, several tiles in both loop orders, every bf16
autotune candidate, bitwise determinism); then timing (`bench/gpu_timing.py`): a plain cuBLAS
bf16 GEMM of the shape (the practical ceiling), ours (autotuned), eager PyTorch, Liger-Kernel,
Cut Cross-Entropy if it imports, torch.compile if time remains; forward and backward timed
separately, peak memory, and the ratio to the 8·N·H·V FLOP floor at the measured GEMM rate.

Tolerances: fp32 outputs (log-probs, entropy) 1e-5 relative and 1e-4 absolute per token; a
bf16/fp16 gradient 4×/2× its floor (the exact gradient rounded to that dtype); fp32 gradients
1e-5, or 1e-2 behind a bf16 dlogits strip; TF32 1e-2. Each case runs in its own try/except (a
row says what failed); a CUDA error that poisons the context skips the remaining GPU work; the
deadline (--budget-s, checked between cases, a SIGALRM watchdog inside one) turns what is left
into "skipped (time budget)" rows. DIR/correctness.csv and DIR/timing.csv are appended and
flushed row by row; DIR/meta.json and DIR/gpu_check.md are written at the start and the end.
Exit 1 if a correctness row is not ok. Installs nothing.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
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

import gpu_timing  # noqa: E402
import torch  # noqa: E402

import fgrpo_kernels  # noqa: E402
from fgrpo_kernels import reference  # noqa: E402
from fgrpo_kernels.kernels import autotune, configs, gemm  # noqa: E402

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DT = {F32: "fp32", BF16: "bf16", F16: "fp16"}
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
        try:
            with self.budget.watch():
                rows = fn()
        except OutOfTime:
            status = f"timeout (budget {self.budget.seconds:.0f} s)"
        except Exception as error:  # noqa: BLE001 - whatever failed, the row says so
            first = (str(error).strip().splitlines() or [""])[0][:200]
            oom = isinstance(error, torch.cuda.OutOfMemoryError)
            status = f"OOM: {first}" if oom else f"error: {type(error).__name__}: {first}"
            traceback.print_exc()
            if "CUDA error" in str(error) or "illegal memory access" in str(error):
                self.lost = first
        else:
            for row in rows:
                table.add(base | {"status": "ok"} | row)
            return
        finally:
            if self.dev.type == "cuda" and not self.lost:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        table.add(base | {"status": status})


# ------------------------------------------------------------------------------- correctness


@dataclass(frozen=True)
class Problem:
    N: int
    H: int
    V: int
    dtype: torch.dtype = BF16
    wdtype: torch.dtype | None = None
    bias: bool = False
    tau: float = 1.0
    entropy: bool = True
    ignore_frac: float = 0.1
    g_scale: float = 1.0  # upstream gradients: g_scale · N(0, 1), or exactly g_scale if < 1e-3
    grads: tuple[bool, bool, bool] = (True, True, True)
    fast_fp32: bool = False
    batch: int = 0  # > 0: hidden [batch, N // batch, H], a strided (non-contiguous) view
    rows: int = 0  # > 0: compare only the first and last `rows` rows (N·H past 2^31)
    forced: dict = field(default_factory=dict)

    def base(self, name: str) -> dict:
        wdt = self.wdtype or self.dtype
        return {"case": name, "dtype": DT[self.dtype], "weight_dtype": DT[wdt], "N": self.N,
                "H": self.H, "V": self.V, "bias": int(self.bias), "temperature": self.tau,
                "entropy": int(self.entropy)}  # fmt: skip


def make_inputs(p: Problem, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=dev)

    if p.batch:
        full = randn(p.batch, 2 * (p.N // p.batch), p.H).to(p.dtype)
        hidden = full[:, ::2]  # [B, T, H], every other position: not contiguous
    else:
        hidden = randn(p.N, p.H).to(p.dtype)
    weight = (randn(p.V, p.H) * (2.0 / p.H**0.5)).to(p.wdtype or p.dtype)
    bias = (randn(p.V) * 0.5).to(p.wdtype or p.dtype) if p.bias else None
    targets = torch.randint(0, p.V, hidden.shape[:-1], generator=g, device=dev)
    targets[torch.rand(targets.shape, generator=g, device=dev) < p.ignore_frac] = -100
    if p.g_scale < 1e-3:
        g_up = torch.full((2, *targets.shape), p.g_scale, device=dev)
    else:
        g_up = randn(2, *targets.shape) * p.g_scale
    return hidden, weight, bias, targets, g_up


def forward_backward(p: Problem, hidden, weight, bias, targets, g_up) -> dict:
    leaves = [None if t is None else t.detach().requires_grad_(r)
              for t, r in zip((hidden, weight, bias), p.grads, strict=True)]  # fmt: skip
    if hidden.dtype == torch.float64:
        fn, extra = reference.logprobs, {}
    else:
        fn, extra = fgrpo_kernels.fused_linear_logprobs, {"fast_fp32": p.fast_fp32}
    out = fn(leaves[0], leaves[1], targets, leaves[2], p.tau, return_entropy=p.entropy, **extra)
    logp, ent = out if p.entropy else (out, None)
    loss = (logp * g_up[0].to(logp.dtype)).sum()
    if p.entropy:
        loss = loss + (ent * g_up[1].to(ent.dtype)).sum()
    loss.backward()
    got = {"logp": logp, "entropy": ent}
    for name, t in zip(("d_hidden", "d_weight", "d_bias"), leaves, strict=True):
        got[name] = None if t is None or not t.requires_grad else t.grad
    return {k: v.detach() for k, v in got.items() if v is not None}


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def tolerance(p: Problem, quantity: str, dtype: torch.dtype, floor: float) -> float:
    if p.fast_fp32:
        return 1e-1 if quantity == "logp_max_abs" else 1e-2
    if quantity == "logp_max_abs":
        return 1e-4
    if dtype == F32:
        return 1e-5 if quantity in ("logp", "entropy") or p.dtype == F32 else 1e-2
    return (4.0 if dtype == BF16 else 2.0) * floor


def compare(p: Problem, got: dict, want: dict) -> list[dict]:
    rows = []
    for q, a in got.items():
        b = want[q]
        if not float(b.double().norm()):  # all rows ignored: exactly zero
            err = float(a.double().abs().max()) if a.numel() else 0.0
            rows.append({"quantity": q, "rel_err": err, "floor": 0.0, "tol": 0.0,
                         "ok": int(err == 0.0)})  # fmt: skip
            continue
        floor = 0.0 if a.dtype == F32 else rel_err(b.to(a.dtype), b)
        err, tol = rel_err(a, b), tolerance(p, q, a.dtype, floor)
        rows.append({"quantity": q, "rel_err": err, "floor": floor, "tol": tol,
                     "ok": int(err <= tol)})  # fmt: skip
        if q == "logp":
            err = float((a.double() - b.double()).abs().max())
            tol = tolerance(p, "logp_max_abs", a.dtype, 0.0)
            rows.append({"quantity": "logp_max_abs", "rel_err": err, "floor": 0.0, "tol": tol,
                         "ok": int(err <= tol)})  # fmt: skip
    return rows


def check(p: Problem, dev) -> list[dict]:
    x = make_inputs(p, dev)
    with configs.forced(**p.forced):
        got = forward_backward(p, *x)
    hidden, weight, bias, targets, g_up = x
    if p.rows:  # N·H past 2^31: the float64 reference on the first and last rows only
        rows = []
        for label, sl in (("first", slice(0, p.rows)), ("last", slice(p.N - p.rows, p.N))):
            sub = replace(p, N=p.rows, grads=(True, False, False))
            ref = (hidden[sl].double(), weight.double(), None if bias is None else bias.double())
            want = forward_backward(sub, *ref, targets[sl], g_up[:, sl])
            part = {q: got[q][sl] for q in ("logp", "entropy", "d_hidden") if q in got}
            rows += [r | {"quantity": f"{r['quantity']}_{label}_rows"}
                     for r in compare(sub, part, want)]  # fmt: skip
        return rows
    ref = [hidden.double(), as_multiplied(weight, hidden.dtype, dev), bias]
    want = forward_backward(p, *[None if t is None else t.double() for t in ref], targets, g_up)
    return compare(p, got, want)


def as_multiplied(weight, dtype: torch.dtype, dev):
    """The weight as the kernels multiply it: converted to hidden's dtype (as under autocast),
    rounding to nearest on a GPU. NB: the interpreter (Triton 3.9) truncates fp32 → bf16."""
    if weight.dtype == dtype or dtype == F32:
        return weight
    if dev.type == "cpu" and dtype == BF16:
        return (weight.float().view(torch.int32) & ~0xFFFF).view(torch.float32)
    return weight.to(dtype)


def determinism(p: Problem, dev) -> list[dict]:
    x = make_inputs(p, dev, seed=3)
    runs = [forward_backward(p, *x) for _ in range(2)]
    same = all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    return [{"quantity": "bitwise_equal", "rel_err": 0.0 if same else 1.0, "floor": 0.0,
             "tol": 0.0, "ok": int(same)}]  # fmt: skip


def cases(tiny: bool) -> dict:
    """name -> (Problem, check function). Full sizes on a GPU; toy sizes for the dry run."""
    mid = (37, 45, 301) if tiny else (333, 520, 5003)
    big = (24, 64, 300) if tiny else (4096, 4096, 151936)
    P = Problem
    out = {
        "realistic_bf16": P(*big, tau=0.7),
        "fp16_small_g": P(*((40, 33, 250) if tiny else (1024, 4096, 32000)), F16, g_scale=1e-5),
        "vh_past_2_31": P(*((3, 16, 290) if tiny else (64, 16384, 151936)), bias=True),
        "nh_past_2_31": P(*((40, 16, 64) if tiny else ((1 << 19) + 37, 4096, 8192)), bias=True,
                          grads=(True, False, False), rows=8 if tiny else 64),
        "single_token": P(1, *big[1:], bias=True),
        "all_ignored": P(*mid, bias=True, ignore_frac=1.0),
        "non_contiguous_3d": P(36 if tiny else 400, *mid[1:], tau=0.7, batch=4),
        "fp32": P(*mid, F32, bias=True, tau=0.7),
        "tf32": P(*mid, F32, bias=True, fast_fp32=True),
        "fp16": P(*mid, F16, tau=0.7),
        "bf16_fp32_weight": P(*mid, BF16, F32, bias=True),
        "bf16_frozen_weight": P(*mid, bias=True, grads=(True, False, True)),
    }  # fmt: skip
    tiles = {"chunk": 16 if tiny else 128, "wave": 64 if tiny else 1024}
    for order in (True, False):
        name = f"tiles_{'rows' if order else 'cols'}_outer"
        out[name] = P(*mid, bias=True, tau=1.3, forced=tiles | {"rows_outer": order})
    for c in configs.CANDIDATES[("fwd", "lowp")]:
        name = f"candidate_{c.block_n}x{c.block_v}x{c.block_k}_w{c.num_warps}_s{c.num_stages}"
        out[name] = P(*mid, bias=True, tau=0.9, forced={"config": c})
    checks = {name: (p, check) for name, p in out.items()}
    checks["determinism"] = (P(*mid, bias=True, tau=0.9), determinism)
    return checks


# ------------------------------------------------------------------------------------ timing

# (pass, FLOPs as a multiple of N·H·V, grads of (hidden, weight))
PASSES = {"fwd+bwd": (8, (True, True)), "fwd+bwd frozen_w": (6, (True, False)),
          "fwd no_grad": (2, None)}  # fmt: skip


def timing_plan(tiny: bool) -> list[tuple[str, str, int]]:
    """(impl, pass, N) in priority order: what matters most runs first."""
    sizes = (8, 16) if tiny else (8192, 32768, 65536)
    plan = [("gemm_ceiling", "gemm", n) for n in sizes[:1]]
    plan += [
        (impl, "fwd+bwd", sizes[0]) for impl in ("ours", "eager", "liger", "cut_cross_entropy")
    ]
    plan += [("ours", "fwd+bwd frozen_w", sizes[0]), ("ours", "fwd no_grad", sizes[0])]
    for n in sizes[1:]:
        plan += [("gemm_ceiling", "gemm", n), ("ours", "fwd+bwd", n)]
        plan += [(impl, "fwd+bwd", n) for impl in ("liger", "cut_cross_entropy", "eager")]
    plan += [("torch_compile", "fwd+bwd", sizes[0])]
    return plan


def time_row(impl: str, pass_: str, N: int, H: int, V: int, dev, iters: int, rates: dict,
             tiny: bool) -> list[dict]:  # fmt: skip
    if impl == "gemm_ceiling":
        row = gpu_timing.gemm_ceiling(N, H, V, dev, iters)
        rates[N] = row["tflops"] * 1e12
        return [row | {"total_ms": row["fwd_ms"]}]
    g = torch.Generator(device=dev).manual_seed(11)
    hidden = torch.randn(N, H, generator=g, device=dev).to(BF16)
    weight = (torch.randn(V, H, generator=g, device=dev) * (2.0 / H**0.5)).to(BF16)
    targets = torch.randint(0, V, (N,), generator=g, device=dev)
    g_up = torch.randn(N, generator=g, device=dev)
    factor, grads = PASSES[pass_]
    leaves = [
        hidden.requires_grad_(grads is not None),
        weight.requires_grad_(bool(grads and grads[1])),
    ]
    # the dry run compiles with the eager backend: its control flow, not inductor's C++ build
    extra = {"backend": "eager"} if impl == "torch_compile" and tiny else {}
    step = gpu_timing.IMPLS[impl](hidden, weight, targets, **extra)
    row = gpu_timing.measure(step, [t for t in leaves if t.requires_grad], g_up, dev, iters,
                             backward=grads is not None)  # fmt: skip
    total = row["fwd_ms"] + (row["bwd_ms"] or 0.0)
    row["total_ms"] = total
    row["tflops"] = factor * N * H * V / total / 1e9
    if N in rates:
        row["floor_ms"] = factor * N * H * V / rates[N] * 1e3
        row["ratio_to_floor"] = total / row["floor_ms"]
    if impl == "ours":
        row["config"] = gpu_timing.tuned_configs()
    return [row]


def unavailable(impl: str, dev) -> str | None:
    """Why a baseline cannot run here (a status), or None."""
    if impl in gpu_timing.IMPORTS and importlib.util.find_spec(gpu_timing.IMPORTS[impl]) is None:
        return "not installed"
    if impl in gpu_timing.NEEDS_CUDA and dev.type != "cuda":
        return "skipped (needs CUDA)"
    return None


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
        for name, (p, fn) in cases(args.tiny).items():
            if not only or name in only:
                runner.run(corr, p.base(name), lambda p=p, fn=fn: fn(p, dev))
    finally:
        if pinned is None:
            os.environ.pop(autotune.ENV)
        else:
            os.environ[autotune.ENV] = pinned
    rates: dict[int, float] = {}
    for impl, pass_, N in timing_plan(args.tiny):
        if only and impl not in only:
            continue
        base = {"impl": impl, "pass": pass_, "dtype": "bf16", "N": N, "H": H, "V": V}
        why = unavailable(impl, dev)
        if impl == "torch_compile" and budget.left() < (0 if args.tiny else COMPILE_RESERVE_S):
            why = f"skipped (< {COMPILE_RESERVE_S:.0f} s left)"
        if why:
            tim.add(base | {"status": why})
            continue
        runner.run(
            tim,
            base,
            lambda i=impl, s=pass_, n=N: time_row(i, s, n, H, V, dev, args.iters, rates, args.tiny),
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
