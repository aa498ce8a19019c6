"""The end of `fgrpo train` (normal or interrupted): summary.json, training.png, one line."""

from __future__ import annotations

import sys
from pathlib import Path

from . import run_dir, writes


def fifths(history: list[dict]) -> tuple[float, float]:
    """Mean reward of the first and of the last fifth of the steps."""
    n = max(len(history) // 5, 1)
    rewards = [r["reward_mean"] for r in history]
    return sum(rewards[:n]) / n, sum(rewards[-n:]) / n


def summarize(
    trainer, history: list[dict], wall: float, name: str, signal: str | None, build_s=None
) -> dict:
    """`wall`: this session's seconds from the first step on; `build_s`: the C++ build's
    before it (None: none was needed)."""
    cfg = trainer.cfg
    summary = {
        "loss": name,
        "steps": trainer.step_count,
        "steps_planned": cfg.steps,
        "interrupted_by": signal,
        "wall_s": round(wall, 1),
        "cpp_build_s": None if build_s is None else round(build_s, 1),
        "total_time_s": round(history[-1]["time_s"], 1) if history else 0.0,
        "chance_reward": None if trainer.chance is None else round(trainer.chance, 4),
        "final_checkpoint": str(Path(cfg.out_dir) / run_dir.FINAL),
    }
    if history:
        first, last = fifths(history)
        summary |= {"reward_first_fifth": round(first, 4), "reward_last_fifth": round(last, 4)}
    evals = [r for r in history if "eval/reward_mean" in r]
    if evals:
        summary["eval"] = {"step": evals[-1]["step"]} | {
            k[len("eval/") :]: round(v, 4) for k, v in evals[-1].items() if k.startswith("eval/")
        }
    return summary


def write_plots(out: Path, history: list[dict], title: str, chance: float | None) -> str | None:
    """training.png, or a note when matplotlib is missing (it comes with the train extra)."""
    try:
        from .plots import plot_training

        with writes.writing(out / "training.png"):
            plot_training(history, out / "training.png", title, chance)
    except ImportError:
        print("fgrpo train: matplotlib is not installed; no training.png", file=sys.stderr)
        return None
    return str(out / "training.png")


def finish(
    trainer, history: list[dict], wall: float, name: str, signal: str | None, build_s=None
) -> dict:
    out = Path(trainer.cfg.out_dir)
    summary = summarize(trainer, history, wall, name, signal, build_s)
    run_dir.write_json(out / "summary.json", summary)
    plot = write_plots(out, history, f"fgrpo train: {name}", trainer.chance) if history else None
    done = trainer.step_count - trainer.start_step
    line = f"{name}: {done} steps in {wall:.0f} s"
    if build_s is not None:
        line += f" (after {build_s:.0f} s building the C++ CPU backend)"
    if trainer.start_step:
        line += f" (steps {trainer.start_step + 1}-{trainer.step_count}, resumed)"
    if signal:
        line += f" (stopped by {signal} at step {trainer.step_count} of {trainer.cfg.steps})"
    if history:
        first, last = summary["reward_first_fifth"], summary["reward_last_fifth"]
        line += f"; mean reward first fifth {first:.3f}, last fifth {last:.3f}"
    if trainer.chance is not None:
        line += f" (chance {trainer.chance:.3f})"
    if "eval" in summary:
        line += f"; held-out pass rate {summary['eval']['pass_rate']:.3f}"
    wrote = [str(out / "metrics.jsonl"), plot, summary["final_checkpoint"]]
    print(f"{line}; wrote {', '.join(w for w in wrote if w)}")
    return summary
