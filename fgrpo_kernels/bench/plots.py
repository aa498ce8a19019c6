"""`memory.png` and `time.png`: log–log against tokens N, one panel per pass, one line per impl.

Out-of-memory points are drawn as crosses along the top edge of their panel.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .impls import ORDER
from .presets import PASSES

METRICS = (
    ("peak_mem_mib", "memory.png", "peak memory beyond the inputs (MiB)"),
    ("time_ms", "time.png", "time per step (ms, median)"),
)


def _series(rows: list[dict]) -> dict[tuple, list[dict]]:
    configs = {(r["vocab"], r["hidden"], r["dtype"]) for r in rows}
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        cfg = (r["vocab"], r["hidden"], r["dtype"])
        label = r["impl"] if len(configs) == 1 else f"{r['impl']} V={cfg[0]} H={cfg[1]} {cfg[2]}"
        out.setdefault((r["pass"], label, r["impl"]), []).append(r)
    return out


def plot(rows: list[dict], out_dir: Path, title: str = "") -> list[Path]:
    """Write the two figures into `out_dir`; returns their paths (none without matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        print("fgrpo bench: matplotlib is not installed, no plots", file=sys.stderr)
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")

    passes = [p for p in PASSES if any(r["pass"] == p for r in rows)]
    series = _series(rows)
    colors = {impl: f"C{i % 10}" for i, impl in enumerate(ORDER)}
    paths = []
    for key, name, ylabel in METRICS:
        fig, axes = plt.subplots(1, max(len(passes), 1), figsize=(5.2 * max(len(passes), 1), 4.4))
        axes = [axes] if len(passes) <= 1 else list(axes)
        for ax, pass_ in zip(axes, passes):
            for (p, label, impl), pts in sorted(series.items(), key=lambda s: ORDER.index(s[0][2])):
                if p != pass_:
                    continue
                pts = sorted(pts, key=lambda r: r["tokens"])
                good = [r for r in pts if r["status"] == "ok" and r[key] is not None and r[key] > 0]
                if good:
                    xs, ys = [r["tokens"] for r in good], [r[key] for r in good]
                    ax.plot(xs, ys, "o-", color=colors[impl], label=label, ms=4)
                oom = [r["tokens"] for r in pts if r["status"] == "oom"]
                if oom:
                    ax.plot(oom, [0.97] * len(oom), "x", color=colors[impl], ms=9, mew=2,
                            transform=ax.get_xaxis_transform(), label=f"{label} (oom)")  # fmt: skip
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(sorted({r["tokens"] for r in rows if r["pass"] == pass_}))
            ax.xaxis.set_major_formatter(plain)
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.yaxis.set_major_formatter(plain)
            lo, hi = ax.get_ylim()
            ax.yaxis.set_minor_formatter(plain if hi < 10 * lo else NullFormatter())
            ax.set_xlabel("tokens N")
            ax.set_ylabel(ylabel)
            ax.set_title(pass_)
            ax.grid(True, which="both", alpha=0.3)
            if ax.has_data():
                ax.legend(fontsize=7)
        if title:
            fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
