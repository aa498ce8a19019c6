"""Result rows → `results.csv`, the markdown table, and the ours/peer ratios."""

from __future__ import annotations

import csv
import math
from pathlib import Path

from .peers import ORDER
from .train_gpu import IMPLS as TRAIN_GPU_IMPLS
from .train_step import IMPLS as TRAIN_IMPLS
from .vocab_parallel import IMPLS as RANK_IMPLS
from .workload import PASSES, WORKLOADS, flops

COLUMNS = (
    "impl", "workload", "tokens", "vocab", "hidden", "dtype", "pass", "time_ms", "peak_mem_mib",
    "status", "backend", "device", "flop_floor_ratio", "batch", "seq_len", "repeats",
    "cpu_time_ms", "compile_s", "case_s", "process_cpu_s", "checksum", "note", "floor_k",
    "gemm_tflops", "check", "tokens_per_s", "grpo_paired_ms", "vs_grpo_paired",
)  # fmt: skip
INTS = ("tokens", "vocab", "hidden", "batch", "seq_len", "repeats", "floor_k")
FLOATS = ("time_ms", "peak_mem_mib", "flop_floor_ratio", "cpu_time_ms", "compile_s", "case_s",
          "process_cpu_s", "checksum", "gemm_tflops", "tokens_per_s", "grpo_paired_ms",
          "vs_grpo_paired")  # fmt: skip
# the floor first, ours last, the peers in between
_MIDDLE = [i for i in dict.fromkeys(ORDER + TRAIN_IMPLS + TRAIN_GPU_IMPLS)
           if i not in ("backbone", "ours")]  # fmt: skip
_MIDDLE = [i for i in _MIDDLE if i != "ours_two_pass"]
IMPL_ORDER = ("gemm", "backbone", *_MIDDLE, "ours_two_pass", "ours", *RANK_IMPLS)
WORKLOAD_ORDER = ("gemm", *WORKLOADS, "train-step", "train-gpu", "vocab-parallel")


def shape_key(r: dict) -> tuple:
    """Rows of one matmul shape (the `gemm` row of the shape gives their floor's rate)."""
    return (r["device"], r["tokens"], r["hidden"], r["vocab"], r["dtype"])


def gemm_rate(r: dict) -> float | None:
    """FLOP/s of an ok `gemm` row (2·N·H·V per call), else None."""
    if r["workload"] != "gemm" or r["status"] != "ok" or not r["time_ms"]:
        return None
    return 2 * r["tokens"] * r["hidden"] * r["vocab"] / (r["time_ms"] / 1e3)


FLOOR_NOTE = (
    "× floor (k): time / (k·N·H·V at the GEMM rate of the shape measured in this run); k = 6 "
    "where the gradient is taken in the forward or the logits are kept, 8 where the backward "
    "recomputes them (frozen head: 4 / 6; forward only: 2)."
)


def flatten(result: dict, rate: float | None) -> dict:
    """A measured row (see `measure.row`) as a CSV record with COLUMNS; `rate` (FLOP/s, the
    shape's GEMM measured in the run, or a given peak) sets its floor k·N·H·V / rate."""
    case = result["case"]
    out = {k: case[k] for k in ("impl", "workload", "tokens", "vocab", "hidden", "dtype", "device")}
    out.update(
        {"pass": case["pass_"], "batch": case["generations"],
         "seq_len": case["tokens"] // case["generations"]}
    )  # fmt: skip
    for key in ("status", "backend", "note", "time_ms", "peak_mem_mib", "repeats", "cpu_time_ms",
                "compile_s", "case_s", "process_cpu_s", "checksum", "floor_k",
                "check", "grpo_paired_ms", "vs_grpo_paired"):  # fmt: skip
        out[key] = result.get(key)
    ratio = None
    if rate and out["time_ms"] is not None and out["workload"] in (*WORKLOADS, "gemm"):
        k = out["floor_k"]
        floor_s = flops(out["pass"], out["tokens"], out["hidden"], out["vocab"], k) / rate
        ratio = out["time_ms"] / 1e3 / floor_s
    out["flop_floor_ratio"] = ratio
    out["gemm_tflops"] = rate / 1e12 if rate and ratio is not None else None
    if out["time_ms"] and out["status"] == "ok":
        out["tokens_per_s"] = out["tokens"] / (out["time_ms"] / 1e3)
    return {k: _clean(out.get(k)) for k in COLUMNS}


def _clean(v):
    if isinstance(v, float):
        return None if math.isnan(v) else float(f"{v:.6g}") if abs(v) < 1e6 else round(v, 1)
    return v


class CsvWriter:
    """Appends rows as they come, so an interrupted run keeps what it measured."""

    def __init__(self, path: Path):
        self.path = path
        with path.open("w", newline="") as f:
            csv.DictWriter(f, COLUMNS).writeheader()

    def add(self, rec: dict) -> None:
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, COLUMNS).writerow({k: "" if v is None else v for k, v in rec.items()})


def read_csv(path: Path) -> list[dict]:
    """results.csv back as records, numbers as numbers and blanks as None."""
    rows = []
    with path.open(newline="") as f:
        for r in csv.DictReader(f):
            # a column added since the file was written reads as blank
            rec = {k: (None if r.get(k, "") in ("", None) else r[k]) for k in COLUMNS}
            for k in INTS:
                rec[k] = None if rec[k] is None else int(rec[k])
            for k in FLOATS:
                rec[k] = None if rec[k] is None else float(rec[k])
            rows.append(rec)
    return rows


def _index(order: tuple, value) -> int:
    return order.index(value) if value in order else len(order)


def panel_key(r: dict) -> tuple:
    """Rows of one plot panel and one ratio block share this key."""
    return (r["workload"], r["pass"], r["vocab"], r["hidden"], r["dtype"], r["batch"])


def _sort_key(r: dict):
    return (
        _index(WORKLOAD_ORDER, r["workload"]), _index(PASSES, r["pass"]), r["dtype"], r["vocab"],
        r["hidden"], r["batch"], r["tokens"], _index(IMPL_ORDER, r["impl"]),
    )  # fmt: skip


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _num(v, fmt: str) -> str:
    return "" if v is None else format(v, fmt)


def markdown(rows: list[dict]) -> str:
    """The table (one line per case) followed by the ratios at the largest N both ran."""
    floor = any(r["flop_floor_ratio"] is not None for r in rows)
    cpu = any(r["cpu_time_ms"] is not None for r in rows)
    train = any(r["workload"] == "train-gpu" for r in rows)
    wall = "wall time ms" if cpu else "time ms"
    head = ["workload", "pass", "N", "B", "V", "H", "dtype", "impl", "status", wall]
    head += ["CPU time ms"] * cpu + ["peak MiB"] + ["tokens/s"] * train
    head += ["× floor (k)"] * floor + ["backend", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=_sort_key):
        cells = [r["workload"], r["pass"], str(r["tokens"]), str(r["batch"]), str(r["vocab"])]
        cells += [str(r["hidden"]), r["dtype"], f"`{r['impl']}`", r["status"]]
        cells += [_num(r["time_ms"], ".1f")] + [_num(r["cpu_time_ms"], ".1f")] * cpu
        cells += [_num(r["peak_mem_mib"], ".1f")] + [_num(r["tokens_per_s"], ".0f")] * train
        ratio = _num(r["flop_floor_ratio"], ".2f")
        cells += [f"{ratio} (k {r['floor_k']})" if ratio else ""] * floor
        note = _cut(r["note"] or "", 120 if r["status"] != "ok" else 60).replace("|", "/")
        cells += [r["backend"] or "", note]
        lines.append("| " + " | ".join(cells) + " |")
    rates = [
        f"{r['tokens']}×{r['hidden']}×{r['vocab']} {r['dtype']}: {r['gemm_tflops']:.4g} TFLOP/s"
        for r in sorted(rows, key=_sort_key)
        if r["workload"] == "gemm" and r["gemm_tflops"]
    ]
    if floor:
        lines += ["", FLOOR_NOTE]
        if rates:
            lines += ["GEMM rates: " + "; ".join(rates) + "."]
    wrong = [r for r in rows if r["status"] == "wrong"]
    if wrong:
        lines += ["", f"{len(wrong)} row(s) `wrong`: they failed the float64 oracle check and "
                  "were not timed."]  # fmt: skip
    variants = variant_ratios(rows)
    if variants:
        lines += ["", "Policy variants / our GRPO dapo loss at the same size (time, peak "
                  "memory; > 1: the variant costs more):", ""]  # fmt: skip
        lines += [f"- {s}" for s in variants]
    summary = ratios([r for r in rows if r["workload"] != "gemm"])
    if summary:
        lines += ["", "Ratios ours / peer at the largest N where both ran (< 1: ours is less; on "
                  "CPU, wall time = median perf_counter time per step, CPU time = median process "
                  "CPU time per step):", ""]  # fmt: skip
        lines += [f"- {s}" for s in summary]
    return "\n".join(lines) + "\n"


def largest_common(rows: list[dict], impl: str, base: str = "ours") -> tuple[dict, dict] | None:
    """(base row, impl row) at the largest N where both are ok within one panel, or None."""
    ok = {(r["impl"], r["tokens"]): r for r in rows if r["status"] == "ok"}
    both = [n for (i, n) in ok if i == impl and (base, n) in ok]
    return (ok[(base, max(both))], ok[(impl, max(both))]) if both else None


def variant_ratios(rows: list[dict]) -> list[str]:
    """'policy:MODE / grpo (pass, N, B, V, H, dtype): time x, memory y' for every variant row
    that has an ok `ours` GRPO row of the same size beside it."""
    ok = [r for r in rows if r["status"] == "ok" and r["impl"] == "ours"]
    size = lambda r: (r["pass"], r["tokens"], r["batch"], r["vocab"], r["hidden"], r["dtype"])  # noqa: E731
    grpo = {size(r): r for r in ok if r["workload"] == "grpo"}
    out = []
    for r in ok:
        base = grpo.get(size(r))
        if r["workload"].startswith("policy:") and base is not None:
            p, n, b, v, h, dtype = size(r)
            paired = r.get("vs_grpo_paired")
            out.append(
                f"`{r['workload']}` / `grpo` ({p}, N={n}, B={b}, V={v}, H={h}, {dtype}): "
                f"time {_ratio(r['time_ms'], base['time_ms'])}"
                + ("" if paired is None else f" (paired, by turns: {paired:.3g}×)")
                + f", memory {_ratio(r['peak_mem_mib'], base['peak_mem_mib'])}"
            )
    return out


def ratios(rows: list[dict]) -> list[str]:
    """'ours/peer (workload, pass, N, B, V, H, dtype): memory x, time y' for every peer."""
    panels: dict[tuple, list[dict]] = {}
    for r in rows:
        panels.setdefault(panel_key(r), []).append(r)
    out = []
    for key in sorted(panels, key=lambda k: _sort_key(panels[k][0])):
        present = {r["impl"] for r in panels[key]}
        # the vocab-parallel panel compares ours on 2 ranks with ours on 1
        base = "ours" if "ours" in present else "ours_2ranks"
        impls = sorted(present - {base}, key=lambda i: _index(IMPL_ORDER, i))
        for impl in impls:
            pair = largest_common(panels[key], impl, base)
            if pair is None:
                continue
            a, b = pair
            workload, pass_, V, H, dtype, B = key
            out.append(
                f"`{base}` / `{impl}` ({workload} {pass_}, N={a['tokens']}, B={B}, V={V}, H={H}, "
                f"{dtype}): memory {_ratio(a['peak_mem_mib'], b['peak_mem_mib'])}, {_times(a, b)}"
            )
    return out


def _times(a: dict, b: dict) -> str:
    """The time ratios, labelled: on CPU the wall time and the process CPU time per step (the
    second is steadier on a shared machine), on CUDA the time of the CUDA events."""
    if a["device"] != "cpu":
        return f"time {_ratio(a['time_ms'], b['time_ms'])}"
    text = f"wall time {_ratio(a['time_ms'], b['time_ms'])}"
    if a["cpu_time_ms"] is not None and b["cpu_time_ms"] is not None:
        text += f", CPU time {_ratio(a['cpu_time_ms'], b['cpu_time_ms'])}"
    return text


def _ratio(a, b) -> str:
    if a is None or b is None or b <= 0:
        return "n/a"
    return f"{a / b:.3g}×"
