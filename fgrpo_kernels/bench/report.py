"""Result rows → `results.csv`, the markdown table, and the ours/baseline ratios."""

from __future__ import annotations

import csv
import math
from pathlib import Path

from .impls import ORDER, flops
from .presets import PASSES

COLUMNS = (
    "impl", "tokens", "vocab", "hidden", "dtype", "pass", "time_ms", "peak_mem_mib", "status",
    "backend", "device", "flop_floor_ratio", "batch", "seq_len", "repeats", "cpu_time_ms",
    "compile_s", "note",
)  # fmt: skip

# (ours, baseline) pairs reported as ratios; the first baseline present is used.
RATIOS = (
    ("ours_grpo", ("eager_grpo",)),
    ("ours_grpo", ("liger_grpo",)),
    ("ours_grpo", ("liger_triton_grpo",)),
    ("ours_grpo", ("compile_grpo",)),
    ("ours_fgrpo", ("eager_fgrpo", "eager_grpo")),
    ("ours_logprobs", ("eager_logprobs",)),
    ("ours_logprobs", ("cce_logprobs",)),
)


def flatten(result: dict, peak_flops: float | None) -> dict:
    """A measured row (see `measure.row`) as a CSV record with COLUMNS."""
    case = result["case"]
    out = {k: case[k] for k in ("impl", "tokens", "vocab", "hidden", "dtype", "device")}
    out.update(
        {"pass": case["pass_"], "batch": case["generations"],
         "seq_len": case["tokens"] // case["generations"]}
    )  # fmt: skip
    for key in ("status", "backend", "note", "time_ms", "peak_mem_mib", "repeats"):
        out[key] = result.get(key)
    out["cpu_time_ms"] = result.get("cpu_time_ms")
    out["compile_s"] = result.get("compile_s")
    ratio = None
    if peak_flops and out["time_ms"] is not None:
        floor_s = flops(out["pass"], out["tokens"], out["hidden"], out["vocab"]) / peak_flops
        ratio = out["time_ms"] / 1e3 / floor_s
    out["flop_floor_ratio"] = ratio
    return {k: _clean(out.get(k)) for k in COLUMNS}


def _clean(v):
    if isinstance(v, float):
        return None if math.isnan(v) else round(v, 4)
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
    ints, floats = ("tokens", "vocab", "hidden", "batch", "seq_len", "repeats"), (
        "time_ms", "peak_mem_mib", "flop_floor_ratio", "cpu_time_ms", "compile_s",
    )  # fmt: skip
    rows = []
    with path.open(newline="") as f:
        for r in csv.DictReader(f):
            rec = {k: (None if r[k] == "" else r[k]) for k in COLUMNS}
            for k in ints:
                rec[k] = None if rec[k] is None else int(rec[k])
            for k in floats:
                rec[k] = None if rec[k] is None else float(rec[k])
            rows.append(rec)
    return rows


def _sort_key(r: dict):
    impl = ORDER.index(r["impl"]) if r["impl"] in ORDER else len(ORDER)
    p = PASSES.index(r["pass"]) if r["pass"] in PASSES else len(PASSES)
    return (r["dtype"], r["vocab"], r["hidden"], p, r["tokens"], impl)


def _num(v, fmt: str) -> str:
    return "" if v is None else format(v, fmt)


def markdown(rows: list[dict]) -> str:
    """The table (one line per case) followed by the ratios at the largest N both ran."""
    floor = any(r["flop_floor_ratio"] is not None for r in rows)
    cpu = any(r["cpu_time_ms"] is not None for r in rows)
    head = ["pass", "N", "V", "H", "dtype", "impl", "status", "time ms"]
    head += ["CPU time ms"] * cpu + ["peak MiB"] + ["× FLOP floor"] * floor + ["backend"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=_sort_key):
        cells = [r["pass"], str(r["tokens"]), str(r["vocab"]), str(r["hidden"]), r["dtype"]]
        cells += [f"`{r['impl']}`", r["status"], _num(r["time_ms"], ".1f")]
        cells += [_num(r["cpu_time_ms"], ".1f")] * cpu + [_num(r["peak_mem_mib"], ".1f")]
        cells += [_num(r["flop_floor_ratio"], ".2f")] * floor + [r["backend"] or ""]
        lines.append("| " + " | ".join(cells) + " |")
    summary = ratios(rows)
    if summary:
        lines += ["", "Ratios ours / baseline at the largest N where both ran:", ""]
        lines += [f"- {s}" for s in summary]
    return "\n".join(lines) + "\n"


def ratios(rows: list[dict]) -> list[str]:
    """'ours/baseline (pass, N, V, H, dtype): memory x, time y' for every pair that both ran."""
    ok = {
        (r["impl"], r["pass"], r["vocab"], r["hidden"], r["dtype"], r["tokens"]): r
        for r in rows
        if r["status"] == "ok"
    }
    configs = sorted({k[1:5] for k in ok}, key=lambda c: (PASSES.index(c[0]), c[1:]))
    out = []
    for cfg in configs:
        for ours, bases in RATIOS:
            for base in bases:
                both = [k[5] for k in ok if k[:5] == (ours, *cfg) and (base, *cfg, k[5]) in ok]
                if not both:
                    continue
                n = max(both)
                a, b = ok[(ours, *cfg, n)], ok[(base, *cfg, n)]
                mem = _ratio(a["peak_mem_mib"], b["peak_mem_mib"])
                tim = _ratio(a["time_ms"], b["time_ms"])
                out.append(
                    f"`{ours}` / `{base}` ({cfg[0]}, N={n}, V={cfg[1]}, H={cfg[2]}, {cfg[3]}): "
                    f"memory {mem}, time {tim}"
                )
                break
    return out


def _ratio(a, b) -> str:
    if a is None or b is None or b <= 0:
        return "n/a"
    return f"{a / b:.3g}×"
