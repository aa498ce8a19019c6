"""Held-out evaluation and the chance level of the reward.

Both draw from their own seeded generators, never from the training streams, so evaluating
(or not) leaves the training run, and its resumption, unchanged.
"""

from __future__ import annotations

import random

import torch

from . import hf
from .data import as_rows


@torch.no_grad()
def evaluate(trainer) -> dict[str, float]:
    """eval/reward_mean, eval/pass_rate (total reward >= cfg.pass_threshold) and the mean of
    each reward function, over one completion per eval row: greedy at eval_temperature 0,
    else sampled with a generator seeded by (seed, step)."""
    cfg, rows = trainer.cfg, trainer.eval_rows
    device = hf.causal_lm(trainer.model).device
    devices = [device] if device.type == "cuda" else []
    chunk = cfg.prompts_per_step * cfg.num_generations
    totals, sums = [], {}
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(cfg.seed * 1_000_003 + trainer.step_count)
        for i in range(0, len(rows), chunk):
            part = rows[i : i + chunk]
            batch = hf.sample(
                trainer.model, trainer.tokenizer, [r["prompt"] for r in part], 1,
                cfg.max_new_tokens, cfg.eval_temperature,
            )  # fmt: skip
            total, metrics, _ = trainer.score(part, batch, 1)
            totals.append(total.cpu())
            for name, value in metrics.items():
                if name.endswith("/mean"):
                    sums[name] = sums.get(name, 0.0) + value * len(part)
    total = torch.cat(totals)
    scored = total[~total.isnan()]
    out = {
        "eval/reward_mean": float(scored.mean()) if scored.numel() else 0.0,
        "eval/pass_rate": float((total >= cfg.pass_threshold).float().mean()),
    }
    out.update({f"eval/{name}": value / len(rows) for name, value in sums.items()})
    return out


def chance_level(trainer, n: int) -> float | None:
    """Mean reward of `n` completions of uniformly random tokens (stopping at EOS, at most
    max_new_tokens), on prompts drawn from the eval rows or the training prompts: what a
    policy that ignores the prompt and favours no token scores."""
    cfg, tokenizer = trainer.cfg, trainer.tokenizer
    rng = random.Random(cfg.seed * 1_000_003 - 1)
    if trainer.eval_rows:
        rows = rng.choices(trainer.eval_rows, k=n)
    elif trainer.sampler is not None:
        rows = rng.choices(trainer.sampler.rows, k=n)
    else:
        rows = as_rows(trainer.prompts(n, rng))
    vocab = min(len(tokenizer), hf.lm_head(trainer.model)[0].shape[0])
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    ids = torch.full((n, cfg.max_new_tokens), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i in range(n):
        for t in range(cfg.max_new_tokens):
            ids[i, t], mask[i, t] = rng.randrange(vocab), 1
            if ids[i, t] == eos:
                break
    ids = ids.masked_fill(mask == 0, pad)
    batch = hf.Batch(ids, mask, ids, mask)  # only the completions are read
    total, _, _ = trainer.score(rows, batch, 1)
    scored = total[~total.isnan()]
    return float(scored.mean()) if scored.numel() else None
