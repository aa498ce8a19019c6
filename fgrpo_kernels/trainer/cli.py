"""`fgrpo train`: RL of a causal LM on the built-in pattern task, with a fused loss.

With only `--out DIR` it builds the embedded tiny Llama (no download), trains it from scratch
on the CPU and writes DIR/metrics.jsonl, DIR/reward.png, DIR/train_config.json and the
save_pretrained checkpoint DIR/final. `--model PATH` trains a local Hugging Face checkpoint
(with its tokenizer) on the same task instead.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ..divergences import NAMES as DIVERGENCES
from ..options import LEVELS, LOSS_TYPES
from .config import LOSSES, TrainConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--out", required=True, metavar="DIR", help="output directory")
    a("--model", metavar="PATH", help="local HF checkpoint (default: the embedded tiny model)")
    a("--loss", choices=LOSSES, default="fgrpo", help="loss family (default: fgrpo)")
    a("--divergence", choices=DIVERGENCES, default="pearson", help="f-GRPO / f-HAL divergence")
    a("--level", choices=LEVELS, default="token", help="f-GRPO level")
    a("--loss-type", choices=LOSS_TYPES, default="dapo", help="GRPO-family normalisation")
    a("--beta", type=float, help="beta (default: fgrpo/fhal 0.1, grpo 0.04, gift 1.0)")
    a("--num-generations", type=int, default=8, metavar="G", help="completions per prompt")
    a("--prompts-per-step", type=int, default=16, help="prompts per rollout")
    a("--steps", type=int, default=300, help="rollouts (default: 300)")
    a("--lr", type=float, default=3e-3, help="AdamW learning rate (default: 3e-3)")
    a("--temperature", type=float, default=1.0, help="sampling temperature")
    a("--max-new-tokens", type=int, default=2, help="completion length limit")
    a("--grad-accum", type=int, default=1, help="micro-batches per update")
    a("--num-updates", type=int, default=1, help="optimizer updates per rollout")
    a("--max-grad-norm", type=float, default=1.0, help="gradient clipping (<= 0: off)")
    a("--scheduler", choices=("constant", "linear", "cosine"), default="constant")
    a("--save-every", type=int, default=0, help="checkpoint every N steps (0: final only)")
    a("--seed", type=int, default=0)
    a("--task-steps", default="19", help="digit steps of the progressions (default: 19)")
    a("--threads", type=int, default=1, help="torch CPU threads (default: 1; tiny ops)")
    a("--no-progress", action="store_true", help="no progress bar")


def load(path: str | None, seed: int):
    """(model, tokenizer): a local checkpoint, or the embedded tiny model."""
    if path is None:
        from .tiny import tiny_model, tiny_tokenizer

        return tiny_model(seed), tiny_tokenizer()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def fifths(history: list[dict]) -> tuple[float, float]:
    """Mean reward of the first and of the last fifth of the steps."""
    n = max(len(history) // 5, 1)
    rewards = [r["reward_mean"] for r in history]
    return sum(rewards[:n]) / n, sum(rewards[-n:]) / n


def plot_rewards(history: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    rewards = [r["reward_mean"] for r in history]
    k = max(len(rewards) // 20, 1)
    windows = [rewards[max(0, i - k + 1) : i + 1] for i in range(len(rewards))]
    smooth = [sum(w) / len(w) for w in windows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, rewards, alpha=0.35, label="reward (mean of the rollout)")
    ax.plot(steps, smooth, label=f"moving mean ({k} steps)")
    ax.set(xlabel="step", ylabel="reward", ylim=(-0.02, 1.02), title=title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    import torch

    from .loop import Trainer
    from .task import PatternTask

    torch.set_num_threads(args.threads)
    try:
        from transformers.utils import logging

        logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass
    cfg = TrainConfig(
        out_dir=args.out,
        loss=args.loss,
        divergence=args.divergence,
        level=args.level,
        loss_type=args.loss_type,
        beta=args.beta,
        num_generations=args.num_generations,
        prompts_per_step=args.prompts_per_step,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        steps=args.steps,
        lr=args.lr,
        scheduler=args.scheduler,
        grad_accum=args.grad_accum,
        num_updates=args.num_updates,
        max_grad_norm=args.max_grad_norm if args.max_grad_norm > 0 else None,
        save_every=args.save_every,
        seed=args.seed,
        progress=not args.no_progress,
    )
    task = PatternTask(steps=tuple(int(c) for c in args.task_steps))
    model, tokenizer = load(args.model, args.seed)
    trainer = Trainer(
        model, tokenizer, task.reward, task.prompts, cfg, preference_data=task.preference_pairs
    )
    start = time.perf_counter()
    history = trainer.train()
    wall = time.perf_counter() - start
    out = Path(args.out)
    name = cfg.loss + (f" {cfg.divergence}" if cfg.loss in ("fgrpo", "fhal") else "")
    name += f" {cfg.loss_type}" if cfg.loss == "grpo" else ""
    name += f" {cfg.level}-level" if cfg.loss in ("fgrpo", "fhal") and cfg.level != "token" else ""
    plot_rewards(history, out / "reward.png", f"fgrpo train: {name}")
    first, last = fifths(history)
    summary = {
        "loss": name,
        "steps": len(history),
        "wall_s": round(wall, 1),
        "reward_first_fifth": round(first, 4),
        "reward_last_fifth": round(last, 4),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"{name}: {len(history)} steps in {wall:.0f} s; mean reward first fifth {first:.3f}, "
        f"last fifth {last:.3f} (+{last - first:.3f}); wrote {out / 'metrics.jsonl'}, "
        f"{out / 'reward.png'}, {out / 'final'}"
    )
    return 0
