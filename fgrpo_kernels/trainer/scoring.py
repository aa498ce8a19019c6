"""Scoring a batch of completions: decode, call the reward functions with the rows' columns,
and fill in what no function scored."""

from __future__ import annotations

import torch

from . import hf
from .rewards import RewardSet, RewardState


def columns_of(rows: list[dict]) -> list[str]:
    """The data columns of `rows` besides "prompt", in order of first appearance."""
    seen: dict[str, None] = {}
    for r in rows:
        seen.update(dict.fromkeys(k for k in r if k != "prompt"))
    return list(seen)


def score(
    rewards: RewardSet,
    tokenizer,
    rows: list[dict],
    batch: hf.Batch,
    repeat: int,
    state: RewardState,
) -> tuple[torch.Tensor, torch.Tensor, dict, list[str]]:
    """(total reward [B] with NaN where no function scored, each function's rewards [B, F]
    (NaN where it did not score), reward metrics, completion texts); rows[i] is the prompt
    row of completions i*repeat .. (i+1)*repeat - 1."""
    texts = tokenizer.batch_decode(batch.completion_ids, skip_special_tokens=True)
    pairs = zip(batch.completion_ids, batch.completion_mask)
    ids = [row[m.bool()].tolist() for row, m in pairs]
    repeated = [r for r in rows for _ in range(repeat)]
    columns = {k: [r.get(k) for r in repeated] for k in columns_of(rows)}
    prompts = [r["prompt"] for r in repeated]
    total, per_func, metrics = rewards(prompts, texts, ids, columns, state)
    return total.to(batch.completion_ids.device), per_func, metrics, texts


def fill_unscored(rewards: torch.Tensor, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards with each unscored (NaN) entry set to its group's mean of the scored ones (0 if
    none), and the mask of those entries, whose advantage the caller sets to 0 (as TRL does)."""
    unscored = rewards.isnan()
    if not unscored.any():
        return rewards, unscored
    groups = rewards.reshape(-1, G)
    fill = groups.nanmean(-1, keepdim=True).nan_to_num(0.0).expand_as(groups).reshape(-1)
    return torch.where(unscored, fill, rewards), unscored


def global_metrics(ranks, rewards: RewardSet, rollout: hf.Rollout, G: int, scalars: dict) -> dict:
    """A step's reward statistics over every rank's completions (rewards gathered, O(B)), then
    `scalars` (losses, KL, timings...) averaged over the ranks that report them (a process
    alone is a world of one)."""
    every = ranks.gather((rollout.rewards.cpu(), rollout.reward_terms, scalars))
    r = torch.cat([e[0] for e in every])
    groups = r.reshape(-1, G)
    out = {
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std()) if r.numel() > 1 else 0.0,
        "frac_reward_zero_std": float((groups.std(-1) == 0).float().mean()),
        "rollouts": r.numel(),
    }
    out |= rewards.statistics(torch.cat([e[1] for e in every]))
    per_function = {f"rewards/{n}/{s}" for n in rewards.names for s in ("mean", "std")}
    for key in dict.fromkeys(k for e in every for k in e[2] if k not in per_function):
        values = [e[2][key] for e in every if key in e[2]]
        out[key] = sum(values) / len(values)
    return out
