"""`fgrpo bench`: memory and speed of ours against every peer, one adapter each (`peers.py`).

    fgrpo bench --device cpu --quick --out DIR        # 2-core CPU, under 5 minutes
    fgrpo bench --preset cpu-long --out DIR           # CPU, single sequences and groups to 131k
    fgrpo bench --preset train-memory --out DIR       # one TRL training step, Qwen2-shaped
    fgrpo bench --device cuda --quick --out DIR       # H200: N 8k-64k, fits 240 s (estimate)
    fgrpo bench --device cuda --dry-run --quick       # the plan and its estimated time, no GPU
    fgrpo bench --preset train-gpu --out DIR          # one GRPO optimizer step, Qwen2.5-1.5B shape
    fgrpo bench --preset train-gpu --tiny --out DIR   # the same on the CPU at toy size

Writes DIR/results.csv, DIR/results.md, DIR/bench.png and DIR/meta.json (the command, the
machine, its load average before and after, the peers' versions), and prints the markdown table.
The report is rewritten after every case, so a killed run keeps every finished row. A failed
case (oom, timeout, error, a peer not installed, `wrong` against the oracle) is a row, not a
crash. `--budget-s` counts from the start of the process (imports and plots included): a case
that would not fit is a `skipped` row. Each size's first case is `gemm`, the matmul of the shape,
whose rate sets every row's floor k·N·H·V.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from .peers import PEERS
from .presets import PRESETS, Case, Preset, default_preset, tiny_train_gpu
from .train_step import VLLM_IS_MODES
from .workload import PASSES

_IMPORTED = time.monotonic()
REPORT_GUESS_S = 5.0  # writing results.md and bench.png, before the first write is timed


def process_age_s() -> float:
    """Seconds since this process started (Linux: /proc), else since this module's import."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _strs(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.split(",") if x)


# The flags that change the preset's cases: its sizes (a comma list for a Preset field of the
# same name), the filters (flag: the Case field it keeps, help) and the fields of its policy
# (flag: type, the Policy field, help).
SIZE_FLAGS = {
    "tokens": (_ints, "comma list of N (overrides the preset)"),
    "vocab": (_ints, "comma list of V"),
    "hidden": (_ints, "comma list of H"),
    "dtype": (_strs, "comma list: float32, bfloat16, float16"),
    "generations": (_ints, "comma list of B (completions per group)"),
}
FILTER_FLAGS = {
    "impls": ("impl", "keep only these impls (comma list)"),
    "workloads": ("workload", "keep only these workloads (comma list)"),
    "passes": ("pass_", f"keep only these of {', '.join(PASSES)}"),
}
POLICY_FLAGS = {
    "warmup": (int, "warmup", "untimed runs per case"),
    "repeats": (int, "repeats", "at most this many timed runs per case"),
    "min-time": (float, "min_time_s", "stop repeating after this many timed s"),
    "timeout": (float, "timeout_s", "seconds per CPU case before a timeout row"),
    "max-mem-gib": (float, "max_mem_gib", "CPU: cap each case's extra memory (GiB)"),
}


def _flag(args, flag: str):
    return getattr(args, flag.replace("-", "_"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if available")
    p.add_argument("--quick", action="store_true", help="the device's quick preset")
    p.add_argument("--preset", choices=sorted(PRESETS), help="overrides --quick")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder")
    for flag, (parse, text) in SIZE_FLAGS.items():
        p.add_argument(f"--{flag}", type=parse, help=text)
    for flag, (_, text) in FILTER_FLAGS.items():
        p.add_argument(f"--{flag}", type=_strs, help=text)
    for flag, (parse, _, text) in POLICY_FLAGS.items():
        p.add_argument(f"--{flag}", type=parse, help=text)
    p.add_argument(
        "--budget-s",
        type=float,
        help="seconds from the start of the process (plots included); later cases are skipped",
    )
    p.add_argument("--tiny", action="store_true", help="train-gpu: a toy model on the CPU")
    p.add_argument(
        "--mmap-threshold-mib",
        type=float,
        help="CPU: fix glibc's mmap threshold in the workers, so that RSS follows the live "
        "tensors instead of the allocator's cache (tiled impls then pay page faults in time)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        help="the floor's rate for shapes without a gemm row (default: the run's GEMM only)",
    )
    p.add_argument(
        "--isolation",
        choices=("fork", "exec", "none"),
        default="fork",
        help="CPU: fork each case from a preloaded server, exec a fresh python, or run in-process",
    )
    p.add_argument(
        "--vllm-is",
        choices=VLLM_IS_MODES,
        help="train-step: TRL's vLLM importance-sampling correction in this mode",
    )
    p.add_argument(
        "--bias-correction-kl", action="store_true", help="train-step: TRL's bias-corrected KL"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="list the cases with an estimated time and exit"
    )
    p.add_argument(
        "--replot", action="store_true", help="redraw --out's bench.png and results.md from its CSV"
    )


def _cases(args) -> tuple[Preset, list[Case]]:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    preset = PRESETS[args.preset] if args.preset else default_preset(device, args.quick)
    if args.preset and not args.device:
        device = preset.device  # a preset names its device (gpu, gpu-quick, train-gpu: cuda)
    if args.tiny:
        if preset.name != "train-gpu":
            raise SystemExit("fgrpo bench: --tiny goes with --preset train-gpu")
        preset, device = tiny_train_gpu(), args.device or "cpu"
    changes = {"device": device, **{k: _flag(args, k) for k in SIZE_FLAGS if _flag(args, k)}}
    if args.budget_s is not None:
        changes["budget_s"] = args.budget_s
    policy = {
        field: _flag(args, flag)
        for flag, (_, field, _) in POLICY_FLAGS.items()
        if _flag(args, flag) is not None
    }
    changes["policy"] = dataclasses.replace(preset.policy, **policy)
    preset = dataclasses.replace(preset, **changes)
    cases = [
        c
        for c in preset.cases()
        if all(
            not _flag(args, flag) or getattr(c, field) in _flag(args, flag)
            for flag, (field, _) in FILTER_FLAGS.items()
        )
    ]
    trl = {"vllm_is": args.vllm_is, "bias_correction_kl": args.bias_correction_kl}
    cases = [dataclasses.replace(c, **trl) if c.workload == "train-step" else c for c in cases]
    return preset, cases


def command(args) -> str:
    """The `fgrpo bench` command line that `args` came from (defaults left out)."""
    parts = ["fgrpo", "bench"]
    for key, value in vars(args).items():
        # `is`, not `in (None, False)`: 0 == False, and `--warmup 0` must stay in the command
        if value is None or value is False or (key, value) == ("isolation", "fork"):
            continue
        parts.append("--" + key.replace("_", "-"))
        if value is not True:
            parts.append(",".join(map(str, value)) if isinstance(value, tuple) else str(value))
    return shlex.join(parts)


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    text = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"
    if torch.cuda.is_available():
        text += f", {torch.cuda.get_device_name()}"
    return text


def load_average() -> str:
    """The 1/5/15-minute load averages, as `uptime` prints them."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def versions(cases: list[Case]) -> dict[str, str]:
    """The installed version of every peer package the run uses."""
    names = {c.impl for c in cases if c.impl in PEERS} | {"eager"}  # eager: torch's version
    train = any(c.workload in ("train-step", "train-gpu") for c in cases)
    if train:
        names |= {"trl", "liger"}
    out = {PEERS[n].package or "torch": PEERS[n].version() for n in names}
    out["torch"] = PEERS["ours"].version()
    if train:
        out["transformers"] = importlib.metadata.version("transformers")
    return dict(sorted(out.items()))


def _progress(total: int):
    try:
        from tqdm import tqdm

        return tqdm(total=total, unit="case", file=sys.stderr, dynamic_ncols=True)
    except ImportError:
        return None


def run(args) -> int:
    import torch

    from . import report

    if args.replot:
        return _write_report(report.read_csv(args.out / "results.csv"), args.out)
    preset, cases = _cases(args)
    if args.dry_run:
        return _dry_run(preset, cases)
    if cases and cases[0].device == "cuda" and not torch.cuda.is_available():
        print("fgrpo bench: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    device = cases[0].device if cases else "cpu"
    peak = args.peak_tflops * 1e12 if args.peak_tflops else None
    args.out.mkdir(parents=True, exist_ok=True)
    meta = _meta(args, preset, cases, device, peak)
    (args.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")  # kept if interrupted
    writer = report.CsvWriter(args.out / "results.csv")
    records, bar, t0 = [], _progress(len(cases)), time.perf_counter()
    rates: dict[tuple, float] = {}
    report_s = REPORT_GUESS_S
    for i, case in enumerate(cases):
        if bar is not None:
            bar.set_description(case.label())
        case, result = _run_case(case, preset, args.isolation, report_s)
        shape = (case.device, case.tokens, case.hidden, case.vocab, case.dtype)
        record = report.flatten(result, rates.get(shape, peak))
        if report.gemm_rate(record):
            rates[shape] = report.gemm_rate(record)
            record = report.flatten(result, rates[shape])
        writer.add(record)
        records.append(record)
        written = time.perf_counter()
        meta["cases_done"] = len(records)
        (args.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        _write_report(records, args.out, echo=False)
        report_s = time.perf_counter() - written
        if bar is not None:
            bar.update()
        else:
            print(f"[{i + 1}/{len(cases)}] {case.label()}: {record['status']}", file=sys.stderr)
    if bar is not None:
        bar.close()
    meta["wall_s"] = round(time.perf_counter() - t0, 1)
    meta["process_s"] = round(process_age_s(), 1)
    meta["load_average_after"] = load_average()
    (args.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    _write_report(records, args.out)
    print(f"{len(records)} cases in {meta['wall_s']} s → {args.out}/", file=sys.stderr)
    return 0


def _dry_run(preset, cases) -> int:
    from . import estimate

    lines, total = estimate.plan(cases)
    print("\n".join(lines))
    budget = f" (budget {preset.budget_s:.0f} s)" if preset.budget_s is not None else ""
    print(f"{len(cases)} cases, estimated {total:.0f} s{budget} (a plan, not a measurement)")
    return 0


def _run_case(case, preset, isolation, report_s: float) -> tuple:
    """(the case as run, its result row): a skipped row once the budget from process start is
    spent (or, on CUDA, when the case's estimate does not fit what is left), else measured,
    a CPU worker's timeout cut to what is left."""
    from . import estimate
    from .measure import measure, row

    left = None if preset.budget_s is None else preset.budget_s - process_age_s() - report_s
    need = estimate.case_seconds(case)
    if left is not None and (left <= 0 or (case.device == "cuda" and need > left)):
        note = f"time budget of {preset.budget_s:.0f} s from process start spent"
        if left > 0:
            note += f": {left:.0f} s left, the case needs ~{need:.0f} s (estimate)"
        return case, row(case, "skipped", note)
    if left is not None and case.device == "cpu":  # its worker is killed at the limit
        policy = dataclasses.replace(
            case.policy, timeout_s=max(1.0, min(case.policy.timeout_s, left))
        )
        case = dataclasses.replace(case, policy=policy)
    started = time.perf_counter()
    result = measure(case, isolation)
    result["case_s"] = time.perf_counter() - started
    return case, result


def _meta(args, preset, cases, device: str, peak) -> dict:
    """meta.json: the command, the machine, the versions and the policy of the run."""
    import fgrpo_kernels

    start = datetime.datetime.now(datetime.timezone.utc)
    meta = {
        "command": command(args),
        "preset": preset.name,
        "date_utc": start.isoformat(timespec="seconds"),
        "machine": machine(),
        "load_average_before": load_average(),
        "cpu_backend": fgrpo_kernels.cpu_backend() if device == "cpu" else None,
        "fgrpo_kernels": fgrpo_kernels.__version__,
        "versions": versions(cases),
        "policy": dataclasses.asdict(preset.policy),
        "budget_s": preset.budget_s,
        "floor": "k·N·H·V at the GEMM rate of the shape measured in this run"
        + (f"; {args.peak_tflops} TFLOP/s where no gemm row ran" if peak else ""),
    }
    if preset.note:
        meta["note"] = preset.note
    if args.mmap_threshold_mib is not None:  # read by glibc at start: set before any worker
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(int(args.mmap_threshold_mib * 2**20))
        meta["malloc_mmap_threshold"] = os.environ["MALLOC_MMAP_THRESHOLD_"]
    return meta


def _write_report(records: list[dict], out: Path, echo: bool = True) -> int:
    """results.md and bench.png from the records and out/meta.json; prints the table."""
    from . import plots, report

    meta = json.loads((out / "meta.json").read_text())
    wall = f"{meta['wall_s']} s" if "wall_s" in meta else "interrupted"
    if "wall_s" not in meta and "cases_done" in meta:
        wall = f"interrupted or running ({meta['cases_done']} cases done)"
    header = (
        f"{meta['command']} — {meta['date_utc']} — {meta['machine']} — {wall}, load average "
        f"{meta['load_average_before']} before, {meta.get('load_average_after', '?')} after"
    )
    table = report.markdown(records)
    (out / "results.md").write_text(f"{header}\n\n{table}")
    plots.plot(records, out, title=header)
    if echo:
        print(table)
    return 0
