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
    else sampled with a generator seeded by (seed, step). Under torch.distributed each rank
    scores its share of the rows (padded to equal shares: FSDP2's forwards are collectives)
    and every rank returns the totals of all of them."""
    cfg, rows, ranks = trainer.cfg, trainer.eval_rows, trainer.ranks
    share = -(-len(rows) // ranks.world)
    mine = ranks.mine(rows, share)
    padded = mine + rows[: share - len(mine)] if len(mine) < share else mine
    device = hf.causal_lm(trainer.model).device
    devices = [device] if device.type == "cuda" else []
    chunk = cfg.prompts_per_step * cfg.num_generations
    totals, terms = [], []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(cfg.seed * 1_000_003 + trainer.step_count)
        for i in range(0, share, chunk):
            part = padded[i : i + chunk]
            batch = trainer.sample([r["prompt"] for r in part], 1, cfg.eval_temperature)
            total, per_func, _, _ = trainer.score(part, batch, 1)
            keep = max(min(len(mine) - i, len(part)), 0)  # the padding is not counted
            totals.append(total[:keep].cpu())
            terms.append(per_func[:keep])
    every = ranks.gather((torch.cat(totals), torch.cat(terms)))
    total = torch.cat([t for t, _ in every])
    scored = total[~total.isnan()]
    out = {
        "eval/reward_mean": float(scored.mean()) if scored.numel() else 0.0,
        "eval/pass_rate": float((total >= cfg.pass_threshold).float().mean()),
    }
    stats = trainer.rewards.statistics(torch.cat([t for _, t in every]))
    out.update({f"eval/{k}": v for k, v in stats.items() if k.endswith("/mean")})
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
    total = trainer.score(rows, batch, 1)[0]
    scored = total[~total.isnan()]
    return float(scored.mean()) if scored.numel() else None
