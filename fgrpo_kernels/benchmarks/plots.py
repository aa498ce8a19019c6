"""`bench.png`: peak memory (top row) and time (bottom row) against tokens N, one column per
(workload, pass, B, V, H, dtype) panel, log–log, lower is better.

Each implementation keeps one colour and marker in every panel and every run. Cases that did not
finish (oom, timeout, error, skipped) are marked with a cross in the implementation's colour at
the top of their panel, with the status written beside it. A dashed line is the memory floor
(per-token outputs + gradients, which every implementation must allocate). At the largest N where
a peer and ours both ran, the peer's point carries the ratio peer ÷ ours.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from .report import IMPL_ORDER, _sort_key, largest_common, panel_key
from .workload import WORKLOADS, memory_floor

# impl: (colour, marker, legend label) — fixed, so that a colour means one thing in every plot.
STYLE = {
    "eager": ("#7f7f7f", "o", "eager PyTorch"),
    "compile": ("#8c564b", "s", "torch.compile"),
    "gemm": ("#525252", "_", "GEMM of the shape (floor)"),
    "liger_flce": ("#08519c", ">", "Liger FLCE (Triton)"),
    "liger": ("#1f77b4", "^", "Liger chunked GRPO, compiled"),
    "liger (eager)": ("#9ecae1", "1", "Liger chunked GRPO, eager"),
    "liger_triton": ("#6baed6", "v", "Liger Triton (logits)"),
    "cce": ("#2ca02c", "D", "Cut Cross-Entropy"),
    "trl": ("#9467bd", "P", "TRL"),
    "verl": ("#ff7f0e", "X", "verl"),
    "verl_triton": ("#fdae6b", "2", "verl Triton"),
    "ours_two_pass": ("#f4a582", "*", "ours, two pass"),
    "ours": ("#d62728", "*", "fgrpo_kernels (ours)"),
    "trl_liger_kernel": ("#c5b0d5", "3", "TRL use_liger_kernel"),
    "backbone": ("#000000", "h", "backbone alone"),
    "trl_liger": ("#17becf", "<", "TRL + Liger GRPO loss"),
    "ours_1rank": ("#e377c2", "p", "ours, whole vocabulary on 1 rank"),
    "ours_2ranks": ("#ff9896", "8", "ours, vocabulary over 2 ranks (per rank)"),
}
OTHER = ("#bcbd22", "d", None)
METRICS = (
    ("peak_mem_mib", "peak memory beyond the inputs, MiB\n(lower is better)", 1.0),
    ("time_ms", "time per step, s (median)\n(lower is better)", 1e-3),
)
FAILED = ("oom", "timeout", "error", "skipped", "wrong")


def style(impl: str) -> tuple[str, str, str]:
    colour, marker, label = STYLE.get(impl, OTHER)
    return colour, marker, label or impl


def _tokens_label(n: float) -> str:
    return f"{n / 1024:g}k" if n >= 1024 else f"{n:g}"


def _value_label(v: float) -> str:
    return f"{v:g}" if v >= 0.01 else f"{v:.0e}"


def _panels(rows: list[dict]) -> list[tuple[tuple, list[dict]]]:
    panels: dict[tuple, list[dict]] = {}
    for r in sorted(rows, key=_sort_key):
        # the policy variants are one line each in report.md's variant table, not panels
        if r["status"] != "unavailable" and not r["workload"].startswith("policy:"):
            panels.setdefault(panel_key(r), []).append(r)
    return list(panels.items())


def _title(key: tuple) -> str:
    workload, pass_, V, H, dtype, B = key
    return f"{workload}, {pass_}\nB={B} × T, V={V}, H={H}, {dtype}"


def _annotate_ratios(ax, rows: list[dict], impls: list[str], metric: str, scale: float) -> None:
    """Write peer ÷ ours beside each peer's point at the largest N both ran (on a white ground,
    readable over the lines); `separate_ratio_labels` moves them apart once the layout is set."""
    for impl in impls:
        pair = largest_common(rows, impl) if impl != "ours" else None
        if pair is None or not pair[0][metric] or not pair[1][metric]:
            continue
        ours, peer = pair
        ax.annotate(f"{peer[metric] / ours[metric]:.2g}×", (peer["tokens"], peer[metric] * scale),
                    xytext=(7, -3), textcoords="offset points", fontsize=8, va="center",
                    color=style(impl)[0], fontweight="bold", gid=f"{impl}:ratio",
                    bbox={"boxstyle": "square,pad=0.05", "fc": "white", "ec": "none",
                          "alpha": 0.8})  # fmt: skip


LABEL_GAP_PX = 1.0


def ratio_labels(ax) -> list:
    return [t for t in ax.texts if (t.get_gid() or "").endswith(":ratio")]


def separate_ratio_labels(fig) -> None:
    """Move the ratio labels at one N down, top first, until none overlaps the one above it:
    in display units, after the layout (a gap in data units fails on a panel spanning many
    decades, where 30 % apart is less than a line of text)."""
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        at_n: dict[float, list] = {}
        for label in ratio_labels(ax):
            at_n.setdefault(label.xy[0], []).append(label)
        for labels in at_n.values():
            labels.sort(key=lambda t: -t.get_window_extent(renderer).y1)
            bottom = None
            for label in labels:
                box = label.get_window_extent(renderer)
                if bottom is not None and box.y1 > bottom - LABEL_GAP_PX:
                    shift = (box.y1 - bottom + LABEL_GAP_PX) * 72.0 / fig.dpi  # px → points
                    x, y = label.xyann
                    label.xyann = (x, y - shift)
                    box = label.get_window_extent(renderer)
                bottom = box.y0


def _mark_failed(ax, n: int, y: float, impl: str, status: str) -> None:
    """A cross in the impl's colour at height `y` (axes fraction) over N, the status beside it."""
    colour, to_axes = style(impl)[0], ax.get_xaxis_transform()
    ax.plot([n], [y], "x", color=colour, ms=9, mew=2.5, transform=to_axes, gid=f"{impl}:{status}")
    ax.text(n * 1.08, y, status, color=colour, fontsize=7, va="center", transform=to_axes)


def _draw_panel(ax, rows: list[dict], key: tuple, metric: str, scale: float) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

    impls = sorted(
        {r["impl"] for r in rows}, key=lambda i: IMPL_ORDER.index(i) if i in IMPL_ORDER else 99
    )
    ns = sorted({r["tokens"] for r in rows})
    values = []
    failed_at: dict[int, int] = {}
    for impl in impls:
        colour, marker, _ = style(impl)
        pts = sorted((r for r in rows if r["impl"] == impl), key=lambda r: r["tokens"])
        good = [r for r in pts if r["status"] == "ok" and (r[metric] or 0) > 0]
        if good:
            xs, ys = [r["tokens"] for r in good], [r[metric] * scale for r in good]
            values += ys
            big = 12 if marker == "*" else 7
            ax.plot(xs, ys, "-", marker=marker, color=colour, ms=big, lw=1.6, gid=f"{impl}:ok")
        for r in pts:
            if r["status"] in FAILED:
                k = failed_at.get(r["tokens"], 0)
                failed_at[r["tokens"]] = k + 1
                _mark_failed(ax, r["tokens"], 0.95 - 0.075 * k, impl, r["status"])
    workload, pass_, V, H, dtype, B = key
    if metric == "peak_mem_mib" and workload in WORKLOADS:
        floor = [memory_floor(pass_, n, H, V, dtype) / 2**20 for n in ns]
        values += floor
        ax.plot(ns, floor, "--", color="black", lw=1, gid="floor")
    _annotate_ratios(ax, rows, impls, metric, scale)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlim(ns[0] / 1.5, ns[-1] * 1.9)
    ax.xaxis.set_major_locator(FixedLocator(ns))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _tokens_label(v)))
    ax.xaxis.set_minor_formatter(NullFormatter())
    lo, hi = (min(values), max(values)) if values else (1.0, 10.0)  # nothing finished
    ax.set_ylim(lo / 1.6, hi * 4.0)  # headroom for the failure marks at the top
    subs = (1.0, 2.0, 5.0) if hi / lo > 8 else (1.0, 2.0, 3.0, 5.0, 7.0) if hi / lo > 2 else None
    subs = subs or tuple(float(s) for s in range(1, 10))  # a narrow range: every integer
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _value_label(v)))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("tokens N")
    ax.grid(True, which="major", alpha=0.3)


def _legend(rows: list[dict]) -> list:
    from matplotlib.lines import Line2D

    shown = {r["impl"] for r in rows if r["status"] != "unavailable"}
    impls = sorted(shown, key=lambda i: IMPL_ORDER.index(i) if i in IMPL_ORDER else 99)
    handles = []
    for impl in impls:
        colour, marker, label = style(impl)
        handles.append(Line2D([], [], color=colour, marker=marker, ms=8, label=label))
    if any(r["workload"] in WORKLOADS for r in rows):
        handles.append(
            Line2D([], [], color="black", ls="--", label="memory floor: outputs + grads")
        )
    handles.append(Line2D([], [], color="black", marker="x", ls="", mew=2, label="did not finish"))
    return handles


def figure(rows: list[dict], title: str = ""):
    """The matplotlib Figure of `rows` (records as in results.csv)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(rows)
    cols = max(len(panels), 1)
    width = 4.6 * max(cols, 2)  # room for the legend and the title under one panel
    fig, axes = plt.subplots(2, cols, figsize=(width, 8.4), squeeze=False)
    for col, (key, prows) in enumerate(panels):
        for row_i, (metric, ylabel, scale) in enumerate(METRICS):
            ax = axes[row_i][col]
            _draw_panel(ax, prows, key, metric, scale)
            if row_i == 0:
                ax.set_title(_title(key), fontsize=9)
            if col == 0:
                on_cpu = metric == "time_ms" and any(r["device"] == "cpu" for r in prows)
                ax.set_ylabel(ylabel.replace("time", "wall time", 1) if on_cpu else ylabel)
    fig.legend(handles=_legend(rows), loc="lower center", ncol=5, fontsize=8, frameon=False)
    missing = sorted({r["impl"] for r in rows if r["status"] == "unavailable"})
    note = "k×: peer ÷ ours at the largest N both ran; ×: did not finish (status beside it)."
    note += "  Not installed: " + ", ".join(missing) + "." if missing else ""
    head = textwrap.wrap(title, int(12 * fig.get_figwidth())) + [note]
    fig.suptitle("\n".join(head), fontsize=9)
    lines = 1 + (len(_legend(rows)) - 1) // 5
    fig.tight_layout(rect=(0, 0.01 + 0.03 * lines, 1, 1 - 0.022 * len(head)))
    separate_ratio_labels(fig)
    return fig


def plot(rows: list[dict], out_dir: Path, title: str = "") -> list[Path]:
    """Write `bench.png` into `out_dir`; returns its path (none without matplotlib)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("fgrpo bench: matplotlib is not installed, no plots", file=sys.stderr)
        return []
    import matplotlib.pyplot as plt

    fig = figure(rows, title)
    path = out_dir / "bench.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]
