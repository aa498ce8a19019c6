"""Plots of a run's metrics: one panel each for the reward (with its chance level and the
held-out evaluation), the KL to the reference, the entropy and the clip fraction; and the
reward curves of several runs side by side.

    python -m fgrpo_kernels.trainer.plots RUN_DIR [RUN_DIR ...] --out compare.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .run_dir import read_metrics

# the first key a loss reports for each panel (f-HAL prefixes its on-policy half with fgrpo/)
KL_KEYS = ("kl", "fgrpo/kl")
ENTROPY_KEYS = ("entropy", "fgrpo/entropy")
CLIP_KEYS = ("clip_ratio/region_mean",)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def moving_mean(values: list[float], k: int) -> list[float]:
    """Mean of the last k values at each point (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - k] if i >= k else 0.0)
        out.append(total / min(i + 1, k))
    return out


def _series(history: list[dict], keys: tuple[str, ...]):
    for key in keys:
        points = [(r["step"], r[key]) for r in history if r.get(key) is not None]
        if points:
            return [p[0] for p in points], [p[1] for p in points]
    return None


def _panel(ax, history, keys, title, ylabel, absent):
    found = _series(history, keys)
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    if found is None:
        ax.text(0.5, 0.5, absent, ha="center", va="center", transform=ax.transAxes, color="0.4")
        return
    steps, values = found
    if keys == CLIP_KEYS and not any(values):
        note = "0 at every step\n(one update per rollout: the ratio is 1;\nsee --num-updates)"
        ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, color="0.4")
        return
    k = max(len(values) // 20, 1)
    ax.plot(steps, values, alpha=0.3, color="C0")
    ax.plot(steps, moving_mean(values, k), color="C0", label=f"moving mean ({k} steps)")
    ax.legend(loc="best", fontsize=8)


def plot_training(history: list[dict], path: Path, title: str, chance: float | None = None):
    """A 2×2 figure of the run: reward, KL to the reference, entropy, clip fraction."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5))
    ax = axes[0, 0]
    steps = [r["step"] for r in history]
    rewards = [r["reward_mean"] for r in history]
    k = max(len(rewards) // 20, 1)
    ax.plot(steps, rewards, alpha=0.3, color="C0", label="rollout mean")
    ax.plot(steps, moving_mean(rewards, k), color="C0", label=f"moving mean ({k} steps)")
    evals = [r for r in history if "eval/reward_mean" in r]
    if evals:
        ax.plot(
            [r["step"] for r in evals], [r["eval/reward_mean"] for r in evals], "o-",
            color="C1", ms=3, label="held-out mean",
        )  # fmt: skip
        ax.plot(
            [r["step"] for r in evals], [r["eval/pass_rate"] for r in evals], "s--",
            color="C2", ms=3, label="held-out pass rate",
        )  # fmt: skip
    if chance is not None:
        ax.axhline(chance, color="0.3", ls=":", label=f"chance (random tokens) {chance:.3f}")
    ax.set(title="reward", xlabel="step", ylabel="reward")
    ax.legend(loc="best", fontsize=8)
    _panel(axes[0, 1], history, KL_KEYS, "KL to the reference", "KL", "not reported")
    _panel(axes[1, 0], history, ENTROPY_KEYS, "entropy", "nats / token", "not reported")
    _panel(
        axes[1, 1], history, CLIP_KEYS, "clip fraction", "fraction of tokens",
        "no ratio clipping in this loss",
    )  # fmt: skip
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_compare(runs: dict[str, list[list[dict]]], path: Path, title: str = "") -> None:
    """Reward (moving mean) against completions sampled and against wall time; the runs under
    one label (seeds) share a colour, thin, with their mean drawn thick."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for colour, (label, histories) in enumerate(runs.items()):
        curves = []
        for history in histories:
            rewards = [r["reward_mean"] for r in history]
            smooth = moving_mean(rewards, max(len(rewards) // 20, 1))
            sampled = [sum(r["rollouts"] for r in history[: i + 1]) for i in range(len(history))]
            curves.append((sampled, [r["time_s"] for r in history], smooth))
        thin = dict(color=f"C{colour}", lw=0.8, alpha=0.45) if len(curves) > 1 else {}
        for sampled, times, smooth in curves:
            ax1.plot(sampled, smooth, **(thin or dict(color=f"C{colour}", label=label)))
            ax2.plot(times, smooth, **(thin or dict(color=f"C{colour}", label=label)))
        if len(curves) > 1:
            n = min(len(c[0]) for c in curves)
            mean = [sum(c[2][i] for c in curves) / len(curves) for i in range(n)]
            times = [sum(c[1][i] for c in curves) / len(curves) for i in range(n)]
            label = f"{label} (mean of {len(curves)})"
            ax1.plot(curves[0][0][:n], mean, color=f"C{colour}", lw=2, label=label)
            ax2.plot(times, mean, color=f"C{colour}", lw=2, label=label)
    ax1.set(xlabel="completions sampled", ylabel="rollout reward (moving mean)")
    ax2.set(xlabel="wall time (s)")
    ax1.legend(loc="best", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="compare the reward curves of fgrpo train runs")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR")
    parser.add_argument(
        "--labels", nargs="+", help="one per run; runs with one label are seeds of one setting "
        "(default: the folder names)",
    )  # fmt: skip
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--title", default="", help="figure title (default: none)")
    args = parser.parse_args(argv)
    labels = args.labels or [Path(r).name for r in args.runs]
    if len(labels) != len(args.runs):
        parser.error(f"--labels: expected {len(args.runs)} labels; got {len(labels)}")
    runs: dict[str, list[list[dict]]] = {}
    for label, run in zip(labels, args.runs):
        runs.setdefault(label, []).append(read_metrics(Path(run)))
    plot_compare(runs, Path(args.out), args.title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
