"""The single pass's ablation, prepared so that one short device window decides the defaults.

    python bench/gpu_perf.py --out DIR [--budget-s 240] [--iters 3]   # CUDA GPU (H200-sized)
    python bench/gpu_perf.py --tiny --out DIR                          # CPU, interpreter, toy

First a correctness row set (the single-pass GRPO loss in bf16 over several chunks against
float64, `gpu_correctness.single_pass`); then per N (8k, 16k, 64k; tiny: 40), in priority
order: the plain cuBLAS bf16 GEMM of the shape (2·N·H·V: the rate every row's floor uses), the
GRPO loss (dapo, β 0.04, B 8) on the single pass with the logits buffer auto
(`backends.memory`), 1, 4, 2, 8, 0.5 GiB, each row-kernel candidate (`configs.ROW_CANDIDATES`,
auto buffer), and the log-prob primitive fwd+bwd through the Triton tiles and through the
cuBLAS chunk path ($FGRPO_PRIMITIVE=cublas); last, at the first N, policy-loss variants on the
same batch (`POLICY`: gmpo and gspo with old log-probs, where rows longer than a chunk need
open rows, and on-policy, where they chunk as token-local; vanilla; kl_cov), and gmpo off- and
on-policy at the last N, each with the path it took (`path`; the floor 6·N·H·V on the single
pass, else 8), beside the GRPO loss's buffer_auto row of that N. Every row: the median total
and each phase (logits GEMM, stats kernel, grad kernel, dh GEMM, dW GEMM, bias, epilogue;
summed over chunks, CUDA events through the `backends.phases` hook; perf_counter under --tiny),
chunks, the cuBLAS rate, the floor (6·N·H·V loss, 8·N·H·V primitive) at that rate and the ratio
to it, peak memory beyond the inputs. Before each case its cost is estimated from the measured
GEMM time ((1 + iters) rounds of ~5 GEMMs, plus a first call); a case that does not fit the
time left is a "skipped (time budget)" row. DIR/gpu_perf.csv is appended and flushed row by
row; DIR/meta.json at the start and end. Installs nothing. Exit 1 if a correctness row fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--out", type=Path, default=Path("gpu_perf_out"))
ARGS.add_argument("--tiny", action="store_true", help="CPU + Triton interpreter, toy sizes")
ARGS.add_argument("--budget-s", type=float, default=240.0, help="deadline for the whole run")
ARGS.add_argument("--iters", type=int, default=3, help="timed rounds per row")

if __name__ == "__main__":
    _tiny = "--tiny" in sys.argv[1:]
    os.environ["TRITON_INTERPRET"] = "1" if _tiny else "0"  # before any fgrpo_kernels import
    os.environ["FGRPO_BACKEND"] = "triton"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_check  # noqa: E402
import gpu_correctness  # noqa: E402
import gpu_timing  # noqa: E402
import torch  # noqa: E402

import fgrpo_kernels  # noqa: E402
from fgrpo_kernels.backends import memory, phases  # noqa: E402
from fgrpo_kernels.backends.triton import bytes_per_row, configs, cublas_chunks  # noqa: E402

COLUMNS = ("variant", "N", "H", "V", "status", "buffer_bytes", "chunks", "row_config",
           "total_ms", *(f"{p}_ms" for p in phases.PHASES), "other_ms", "first_call_s",
           "peak_extra_gib", "cublas_ms", "cublas_tflops", "floor", "floor_ms",
           "ratio_to_floor", "agree_with", "agree_rel", "quantity", "rel_err", "tol",
           "path")  # fmt: skip
BUFFERS = ("auto", 1.0, 4.0, 2.0, 8.0, 0.5)  # GiB, in priority order
GEMMS_PER_ROUND = 5.0  # a loss round ≈ 3 GEMMs + the memory-bound passes; primitive 4 + …
# A variant's (output, dh, dW) against the first variant of its kind at that N, relative norm:
# chunking and tiles change only the summation order (bf16 gradients: ~1e-3); a broken config
# is O(1) off. Above AGREE_TOL the row is "mismatch" and the run exits 1.
AGREE_TOL = 2e-2
# policy variants (`fgrpo bench` workload names without "policy:"), at the first N, and those
# of LONG_POLICY at the last (sequences of N / 8 tokens: longer than a chunk there)
POLICY = ("gmpo", "gmpo@on-policy", "gspo", "gspo@on-policy", "vanilla", "kl_cov")
LONG_POLICY = ("gmpo", "gmpo@on-policy")


@contextmanager
def env(name: str, value: str | None):
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def inputs(N: int, H: int, V: int, dev):
    g = torch.Generator(device=dev).manual_seed(11)
    h = torch.randn(N, H, generator=g, device=dev).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(V, H, generator=g, device=dev) * (2 / H**0.5)).to(torch.bfloat16)
    y = torch.randint(0, V, (N,), generator=g, device=dev)
    return h, w.requires_grad_(), y


def timed(step, leaves, dev, iters: int) -> tuple[dict, list]:
    """First call alone; then `iters` rounds of step() (forward + backward) with the phase
    recorder on: (median total ms, per-phase ms averaged over rounds, peak memory; the last
    round's [output, *leaf grads] for the agreement check)."""
    cuda = dev.type == "cuda"
    start, stop = gpu_timing._clock(dev)
    last = []

    def one():
        for t in leaves:
            t.grad = None
        t0 = start()
        out = step()
        ms = stop(t0)
        last[:] = [out.detach().reshape(-1)] + [t.grad for t in leaves]
        return ms

    t0 = time.perf_counter()
    one()
    first = time.perf_counter() - t0
    if cuda:
        for t in leaves:
            t.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    rec = phases.Recorder(cuda)
    with phases.recording(rec):
        totals = [one() for _ in range(iters)]
    spent = rec.totals_ms()
    row = {"total_ms": statistics.median(totals), "first_call_s": first}
    for p in phases.PHASES:
        row[f"{p}_ms"] = spent.get(p, 0.0) / iters
    row["other_ms"] = max(row["total_ms"] - sum(spent.values()) / iters, 0.0)
    if cuda:
        row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return row, last


def disagreement(got: list, want: list) -> float:
    """max over (output, dh, dW) of |got − want| / |want| (Frobenius, fp32)."""
    out = 0.0
    for a, b in zip(got, want, strict=True):
        ref = float(b.float().norm())
        out = max(out, float((a.float() - b.float()).norm()) / max(ref, 1e-30))
    return out


def loss_step(h, w, y, max_chunk_bytes):
    module = fgrpo_kernels.FusedLinearGRPOLoss("dapo", 0.04, max_chunk_bytes=max_chunk_bytes)
    hb, ids, mask, adv, ref = gpu_timing._grpo_batch(h, y)

    def step():
        loss = module(hb, w, ids, mask, adv, ref_per_token_logps=ref)[0]
        loss.backward()
        if module.last_pass != "single":
            raise RuntimeError(f"the single pass did not run: {module.last_pass}")
        return loss

    return step


def policy_step(h, w, y, workload: str, max_chunk_bytes):
    """(step, module): a policy variant on the GRPO row's batch, old log-probs = its reference
    ones (`@on-policy`: none), the variant's source defaults (`VARIANT_OPTIONS`)."""
    from fgrpo_kernels.benchmarks.workload import VARIANT_OPTIONS, variant_of
    from fgrpo_kernels.losses.policy import FusedLinearPolicyLoss

    mode, on_policy = variant_of(f"policy:{workload}")
    module = FusedLinearPolicyLoss(mode, max_chunk_bytes=max_chunk_bytes, **VARIANT_OPTIONS[mode])
    hb, ids, mask, adv, ref = gpu_timing._grpo_batch(h, y)

    def step():
        loss = module(hb, w, ids, mask, adv, old_per_token_logps=None if on_policy else ref)[0]
        loss.backward()
        return loss

    return step, module


def primitive_step(h, w, y):
    g_up = torch.randn(len(y), device=h.device, generator=torch.Generator(h.device).manual_seed(3))

    def step():
        logp = fgrpo_kernels.fused_linear_logprobs(h, w, y)
        (logp * g_up).sum().backward()
        return logp

    return step


def plan(tiny: bool):
    """(variant, N, how) in priority order; how = (kind, buffer GiB | None, row config)."""
    Ns = (40,) if tiny else (8192, 16384, 65536)
    out = []
    for N in Ns:
        out.append(("cublas_gemm", N, ("gemm", None, None)))
        for b in BUFFERS:
            name = "auto" if b == "auto" else f"{b:g}GiB"
            out.append((f"buffer_{name}", N, ("loss", b, None)))
        for cfg in configs.ROW_CANDIDATES[1:]:
            out.append(
                (f"rows_{cfg.block_n}x{cfg.block_v}_w{cfg.num_warps}", N, ("loss", "auto", cfg))
            )
        out.append(("primitive_tiles", N, ("tiles", None, None)))
        out.append(("primitive_cublas", N, ("cublas", None, None)))
    out += [(f"policy_{v}", Ns[0], ("policy", "auto", v)) for v in POLICY]
    if Ns[-1] != Ns[0]:
        out += [(f"policy_{v}", Ns[-1], ("policy", "auto", v)) for v in LONG_POLICY]
    return out


def buffer_of(b, h, V: int, dev, tiny: bool) -> int:
    """Bytes for a buffer choice; under --tiny a "GiB" is 8 rows (so that there are chunks) and
    "auto" 16 rows. On a GPU "auto" is what the single pass's default takes now."""
    if b == "auto":
        return memory.buffer_bytes(dev) if not tiny else 16 * bytes_per_row(h, V)
    unit = 8 * bytes_per_row(h, V) if tiny else memory.GiB
    return int(b * unit)


def main(argv=None) -> int:
    args = ARGS.parse_args(argv)
    budget = gpu_check.Budget(args.budget_s)
    if args.tiny:
        dev, (H, V) = torch.device("cpu"), (33, 211)
    else:
        if not torch.cuda.is_available():
            print("gpu_perf: no CUDA device; use --tiny on a CPU", file=sys.stderr)
            return 2
        dev, (H, V) = torch.device("cuda"), (4096, 151936)
    args.out.mkdir(parents=True, exist_ok=True)
    table = gpu_check.Table(args.out / "gpu_perf.csv", COLUMNS)
    meta = gpu_check.environment(dev, args.tiny) | {"budget_s": args.budget_s, "iters": args.iters}
    (args.out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    runner = gpu_check.Runner(budget, dev)

    name = "single_pass_bf16"
    p, fn = gpu_correctness.cases(args.tiny)[name]
    if not args.tiny:
        p = dataclasses.replace(p, N=1024, chunk_rows=300)  # 4 chunks, seconds not minutes

    def correctness():
        return [{"quantity": r["quantity"], "rel_err": r["rel_err"], "tol": r["tol"]}
                for r in fn(p, dev)]  # fmt: skip

    base = {"variant": "correctness", "N": p.N, "H": p.H, "V": p.V}
    runner.run(table, base, correctness)
    bad = [r for r in table.rows if r.get("status") != "ok"
           or float(r.get("rel_err", 0)) > float(r.get("tol", 0))]  # fmt: skip

    gemm_ms: dict[int, float] = {}
    agree: dict[tuple[str, int], tuple[str, list]] = {}  # (group, N) -> first variant's output
    for variant, N, (kind, buf, cfg) in plan(args.tiny):
        base = {"variant": variant, "N": N, "H": H, "V": V}
        if kind != "gemm" and N not in gemm_ms:
            table.add(base | {"status": "skipped (no GEMM rate for this N)"})
            continue
        if kind != "gemm":
            est_s = (1 + args.iters) * GEMMS_PER_ROUND * gemm_ms[N] / 1e3 + (0 if args.tiny else 2)
            if not args.tiny and budget.left() < est_s:
                table.add(base | {"status": f"skipped (time budget: needs ~{est_s:.0f} s)"})
                continue

        def case(variant=variant, N=N, kind=kind, buf=buf, cfg=cfg):
            if kind == "gemm":
                r = gpu_timing.gemm_ceiling(N, H, V, dev, max(args.iters, 3))
                gemm_ms[N] = r["fwd_ms"]
                return [{"total_ms": r["fwd_ms"], "cublas_ms": r["fwd_ms"],
                         "cublas_tflops": r["tflops"]}]  # fmt: skip
            h, w, y = inputs(N, H, V, dev)
            row = {}
            forced = configs.forced(rows=cfg) if kind == "loss" and cfg else nullcontext()
            if kind == "policy":
                nbytes = buffer_of(buf, h, V, dev, args.tiny)
                step, module = policy_step(h, w, y, cfg, None if not args.tiny else nbytes)
                got, out = timed(step, (h, w), dev, args.iters)
                row |= {"buffer_bytes": nbytes, "path": module.last_pass}
                floor, flops = ("6NHV", 6) if module.last_pass == "single" else ("8NHV", 8)
            elif kind == "loss":
                nbytes = buffer_of(buf, h, V, dev, args.tiny)
                rows = max(nbytes // bytes_per_row(h, V), 1)
                row |= {"buffer_bytes": nbytes, "chunks": -(-N // rows)}
                given = None if buf == "auto" and not args.tiny else nbytes  # auto: the default
                step, flops, floor = loss_step(h, w, y, given), 6, "6NHV"
                with forced:
                    got, out = timed(step, (h, w), dev, args.iters)
            else:
                floor, flops = "8NHV", 8
                # the cuBLAS chunks take the default buffer (tiny: 16 rows, so several chunks)
                tiny_buf = str(16 * bytes_per_row(h, V)) if args.tiny else None
                with env(cublas_chunks.ENV, kind), env("FGRPO_MAX_CHUNK_BYTES", tiny_buf):
                    if kind == "cublas":
                        rows = cublas_chunks.rows_per_chunk(h, w)
                        row |= {"buffer_bytes": rows * bytes_per_row(h, V),
                                "chunks": -(-N // rows)}  # fmt: skip
                    got, out = timed(primitive_step(h, w, y), (h, w), dev, args.iters)
            row |= got
            group = {"loss": "loss", "policy": variant}.get(kind, "primitive")
            if (group, N) not in agree:
                agree[(group, N)] = (variant, out)
            else:
                first, want = agree[(group, N)]
                row |= {"agree_with": first, "agree_rel": disagreement(out, want)}
                if row["agree_rel"] > AGREE_TOL:
                    row["status"] = f"mismatch (> {AGREE_TOL:g} against {first})"
            c = cfg if kind == "loss" and cfg else configs.row_config(args.tiny)
            rate = 2 * N * H * V / gemm_ms[N]  # FLOP per ms
            floor_ms = flops * N * H * V / rate
            row |= {"row_config": f"{c.block_n}x{c.block_v}/w{c.num_warps}",
                    "cublas_ms": gemm_ms[N], "cublas_tflops": rate / 1e9, "floor": floor,
                    "floor_ms": floor_ms, "ratio_to_floor": row["total_ms"] / floor_ms}  # fmt: skip
            return [row]

        runner.run(table, base, case)
        if kind == "gemm":  # a new N: free the previous one's reference outputs
            for key in [k for k in agree if k[1] != N]:
                del agree[key]
    bad += [r for r in table.rows if r.get("status", "").startswith("mismatch")]
    meta["wall_s"] = round(args.budget_s - budget.left(), 1)
    meta["buffer_auto_bytes"] = memory.buffer_bytes(dev) if dev.type == "cuda" else None
    (args.out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"gpu_perf: {len(table.rows)} rows, {meta['wall_s']} s; {args.out}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
