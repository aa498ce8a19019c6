"""One-call GPU check of the Triton log-prob kernels: correctness vs float64, then speed and memory.

    python bench/gpu_check.py --out DIR            # CUDA GPU (sized for an H200, < 8 minutes)
    python bench/gpu_check.py --tiny --out DIR     # CPU, TRITON_INTERPRET=1, tiny sizes

(a) logp, entropy and the grads of hidden/weight/bias against `fgrpo_kernels.reference.logprobs`
in float64 (fp32, bf16, fp16, bf16 hidden + fp32 weight, TF32; bias, τ ≠ 1, ignored rows; forced
multi-split / multi-wave tiling; bitwise determinism; N·H and N·Vw past 2^31 on the GPU).
(b) median time (CUDA events, after warm-up) and peak memory of fwd and fwd+bwd at
N ∈ {8192, 32768, 65536}, H 4096, V 151936, bf16, also with a frozen lm_head, with the ratio to
the FLOP floor at 790 TFLOP/s. An OOM is a row, not a crash. Installs nothing.
Writes DIR/correctness.csv, DIR/timing.csv and DIR/gpu_check.md; exit 1 if a check fails.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from pathlib import Path

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--out", type=Path, default=Path("gpu_check_out"))
ARGS.add_argument("--tiny", action="store_true", help="CPU + Triton interpreter, tiny sizes")
ARGS.add_argument("--budget-s", type=float, default=420.0, help="skip timing rows after this")
ARGS.add_argument("--iters", type=int, default=5)

if __name__ == "__main__":
    _tiny = "--tiny" in sys.argv[1:]
    # the interpreter is chosen when the kernels are decorated: before any fgrpo_kernels import
    os.environ["TRITON_INTERPRET"] = "1" if _tiny else "0"
    os.environ["FGRPO_BACKEND"] = "triton"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package

import torch  # noqa: E402

import fgrpo_kernels  # noqa: E402
from fgrpo_kernels import reference  # noqa: E402
from fgrpo_kernels.kernels import configs  # noqa: E402

PEAK_FLOPS = 790e12
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DT = {F32: "fp32", BF16: "bf16", F16: "fp16"}
CORRECTNESS_COLUMNS = ("case", "dtype", "weight_dtype", "N", "H", "V", "bias", "temperature",
                       "entropy", "quantity", "rel_err", "tol", "ok")  # fmt: skip
TIMING_COLUMNS = ("case", "mode", "dtype", "N", "H", "V", "status", "ms_median", "ms_min", "iters",
                  "peak_gib", "input_gib", "extra_gib", "flops", "floor_ms",
                  "ratio_to_floor")  # fmt: skip
# name: (hidden dtype, weight dtype, bias, τ, entropy, forced (splits, wave in BLOCK_V), options)
CASES = {
    "fp32": (F32, F32, True, 0.7, True, None, {}),
    "fp32_split_waves": (F32, F32, False, 1.0, True, (3, 5), {}),
    "bf16": (BF16, BF16, True, 0.7, True, None, {}),
    "bf16_split_waves": (BF16, BF16, True, 1.3, False, (2, 3), {}),
    "bf16_fp32_weight": (BF16, F32, True, 1.0, True, None, {}),
    "fp16": (F16, F16, False, 0.7, True, None, {}),
    "fp32_tf32": (F32, F32, True, 1.0, False, None, {"fast_fp32": True}),
    "bf16_frozen_weight": (BF16, BF16, True, 1.0, True, None, {"frozen_weight": True}),
}
TOL = {F32: 1e-5, BF16: 2e-2, F16: 2e-2, "tf32": 1e-2}


def rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def inputs(N, H, V, dtype, wdtype, bias, dev, seed=0, ignore_frac=0.1):
    g = torch.Generator(device=dev).manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, device=dev).to(dtype)
    weight = (torch.randn(V, H, generator=g, device=dev) * (2.0 / H**0.5)).to(wdtype)
    b = (torch.randn(V, generator=g, device=dev) * 0.5).to(wdtype) if bias else None
    targets = torch.randint(0, V, (N,), generator=g, device=dev)
    targets[torch.rand(N, generator=g, device=dev) < ignore_frac] = -100
    return hidden, weight, b, targets


def forward_backward(hidden, weight, bias, targets, tau, entropy, grads, g_up, fast_fp32=False):
    leaves = [None if t is None else t.detach().requires_grad_(r)
              for t, r in zip((hidden, weight, bias), grads, strict=True)]  # fmt: skip
    if leaves[0].dtype == torch.float64:
        out = reference.logprobs(leaves[0], leaves[1], targets, leaves[2], tau,
                                 return_entropy=entropy)  # fmt: skip
    else:
        out = fgrpo_kernels.fused_linear_logprobs(
            leaves[0],
            leaves[1],
            targets,
            leaves[2],
            tau,
            return_entropy=entropy,
            fast_fp32=fast_fp32,
        )
    logp, ent = out if entropy else (out, None)
    loss = (logp * g_up[0].to(logp.dtype)).sum()
    if entropy:
        loss = loss + (ent * g_up[1].to(ent.dtype)).sum()
    loss.backward()
    return [logp, ent] + [None if t is None else t.grad for t in leaves]


def correctness(sizes, dev) -> list[dict]:
    N, H, V = sizes
    rows = []
    for name, (dt, wdt, bias, tau, ent, forced, opt) in CASES.items():
        x = inputs(N, H, V, dt, wdt, bias, dev)
        grads = (True, not opt.get("frozen_weight", False), True)
        g_up = torch.randn(2, N, device=dev, generator=torch.Generator(dev).manual_seed(1))
        fast = opt.get("fast_fp32", False)
        split_wave = {}
        if forced:
            bv = configs.kernel_config("bwd", dt, wdt, fast, dev.type != "cuda").block_v
            split_wave = {"splits": forced[0], "wave": forced[1] * bv}
        with configs.forced(**split_wave):
            got = forward_backward(*x, tau, ent, grads, g_up, fast)
        ref = [t.double() if t is not None and t.is_floating_point() else t for t in x]
        want = forward_backward(*ref, tau, ent, grads, g_up)
        tol = TOL["tf32" if fast else dt]
        base = {"case": name, "dtype": DT[dt], "weight_dtype": DT[wdt], "N": N, "H": H, "V": V,
                "bias": int(bias), "temperature": tau, "entropy": int(ent), "tol": tol}  # fmt: skip
        names = ("logp", "entropy", "d_hidden", "d_weight", "d_bias")
        for q, a, b in zip(names, got, want, strict=True):
            if a is None and b is None:
                continue
            err = float("nan") if a is None or b is None else rel_err(a, b)
            rows.append(base | {"quantity": q, "rel_err": err, "ok": int(err <= tol)})
    return rows + [determinism(sizes, dev)]


def determinism(sizes, dev) -> dict:
    N, H, V = sizes
    x = inputs(N, H, V, BF16, BF16, True, dev, seed=3)
    g_up = torch.randn(2, N, device=dev)
    runs = [forward_backward(*x, 0.9, True, (True, True, True), g_up)[2:] for _ in range(2)]
    same = all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    return {"case": "determinism", "dtype": "bf16", "weight_dtype": "bf16", "N": N, "H": H, "V": V,
            "bias": 1, "temperature": 0.9, "entropy": 1, "quantity": "bitwise_equal_grads",
            "rel_err": 0.0 if same else 1.0, "tol": 0.0, "ok": int(same)}  # fmt: skip


def big_offsets(dev) -> list[dict]:
    """N·H and N·Vw (the dlogits strip) past 2^31: check rows at both ends against float64."""
    N, H, V = (1 << 19) + 37, 4096, 8192
    x = inputs(N, H, V, BF16, BF16, True, dev, seed=5)
    g_up = torch.randn(2, N, device=dev)
    got = forward_backward(*x, 1.0, True, (True, False, False), g_up)
    rows, base = (
        [],
        {
            "case": "big_offsets",
            "dtype": "bf16",
            "weight_dtype": "bf16",
            "N": N,
            "H": H,
            "V": V,
            "bias": 1,
            "temperature": 1.0,
            "entropy": 1,
            "tol": 2e-2,
        },
    )
    for label, sl in (("first", slice(0, 64)), ("last", slice(N - 64, N))):
        sub = [x[0][sl].double(), x[1].double(), x[2].double(), x[3][sl]]
        want = forward_backward(*sub, 1.0, True, (True, False, False), g_up[:, sl])
        for q, a, b in (("logp", got[0][sl], want[0]), ("entropy", got[1][sl], want[1]),
                        ("d_hidden", got[2][sl], want[2])):  # fmt: skip
            err = rel_err(a, b)
            rows.append(base | {"quantity": f"{q}_{label}_rows", "rel_err": err,
                                "ok": int(err <= 2e-2)})  # fmt: skip
    return rows


def timed(fn, dev, iters) -> tuple[float, float]:
    times = []
    for _ in range(iters):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def timing(sizes_n, H, V, dev, iters, deadline) -> list[dict]:
    rows = []
    gib = 2.0**30
    weight = (torch.randn(V, H, device=dev) * 0.02).to(BF16)
    modes = (("fwd", None, 2), ("fwd+bwd", (True, True), 8), ("fwd+bwd frozen_w", (True, False), 6))
    for N in sizes_n:
        for mode, grads, flop_factor in modes:
            row = {"case": "lm_head", "mode": mode, "dtype": "bf16", "N": N, "H": H, "V": V,
                   "iters": iters, "flops": f"{flop_factor}NHV"}  # fmt: skip
            flops = flop_factor * N * H * V
            row |= {"floor_ms": flops / PEAK_FLOPS * 1e3}
            if time.monotonic() > deadline:
                rows.append(row | {"status": "skipped (time budget)"})
                continue
            hidden = targets = None
            try:
                hidden = torch.randn(N, H, device=dev).to(BF16)
                targets = torch.randint(0, V, (N,), device=dev)
                g_up = torch.randn(N, device=dev)
                h_leaf = hidden.requires_grad_(grads is not None)
                w_leaf = weight.requires_grad_(grads is not None and grads[1])

                def step(h_leaf=h_leaf, w_leaf=w_leaf, targets=targets, g_up=g_up, grads=grads):
                    h_leaf.grad = w_leaf.grad = None
                    if grads is None:
                        with torch.no_grad():
                            fgrpo_kernels.fused_linear_logprobs(h_leaf, w_leaf, targets)
                    else:
                        logp = fgrpo_kernels.fused_linear_logprobs(h_leaf, w_leaf, targets)
                        (logp * g_up).sum().backward()

                step()  # compile + warm-up
                step()
                if dev.type == "cuda":
                    h_leaf.grad = w_leaf.grad = None
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    step()
                    torch.cuda.synchronize()
                    peak = torch.cuda.max_memory_allocated()
                    row |= {"peak_gib": peak / gib, "input_gib": base / gib,
                            "extra_gib": (peak - base) / gib}  # fmt: skip
                med, best = timed(step, dev, iters)
                row |= {"status": "ok", "ms_median": med, "ms_min": best,
                        "ratio_to_floor": med / row["floor_ms"]}  # fmt: skip
            except torch.cuda.OutOfMemoryError as exc:
                row |= {"status": f"OOM: {str(exc).splitlines()[0][:120]}"}
            finally:
                weight.grad = None
                del hidden, targets
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
    return rows


def write(out: Path, corr: list[dict], tim: list[dict], env: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, rows, cols in (("correctness", corr, CORRECTNESS_COLUMNS),
                             ("timing", tim, TIMING_COLUMNS)):  # fmt: skip
        with open(out / f"{name}.csv", "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=cols, restval="")
            wr.writeheader()
            wr.writerows(rows)

    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["# gpu_check", ""] + [f"- {k}: {v}" for k, v in env.items()]
    for title, rows, cols in (("Correctness", corr, CORRECTNESS_COLUMNS),
                              ("Timing", tim, TIMING_COLUMNS)):  # fmt: skip
        lines += ["", f"## {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    args = ARGS.parse_args(argv)
    t0 = time.monotonic()
    if args.tiny:
        dev = torch.device("cpu")
        corr_sizes, time_n, H, V = (19, 33, 211), (8, 16), 33, 211
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device; use --tiny on a CPU", file=sys.stderr)
            return 2
        dev = torch.device("cuda")
        corr_sizes, time_n, H, V = (333, 520, 5003), (8192, 32768, 65536), 4096, 151936
    env = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)",
           "torch": torch.__version__, "triton": __import__("triton").__version__,
           "mode": "tiny" if args.tiny else "full"}  # fmt: skip
    corr = correctness(corr_sizes, dev)
    if not args.tiny:
        corr += big_offsets(dev)
        from fgrpo_kernels.kernels.logprob_bwd import _has_out_dtype_mm

        env["cublas_out_dtype_mm"] = _has_out_dtype_mm(dev)
    print(f"correctness done in {time.monotonic() - t0:.1f}s", flush=True)
    tim = timing(time_n, H, V, dev, args.iters, t0 + args.budget_s)
    env["wall_s"] = f"{time.monotonic() - t0:.1f}"
    write(args.out, corr, tim, env)
    print((args.out / "gpu_check.md").read_text())
    bad = [r for r in corr if not r["ok"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
