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
) -> tuple[torch.Tensor, dict, list[str]]:
    """(total reward [B] with NaN where no function scored, reward metrics, completion texts);
    rows[i] is the prompt row of completions i*repeat .. (i+1)*repeat - 1."""
    texts = tokenizer.batch_decode(batch.completion_ids, skip_special_tokens=True)
    pairs = zip(batch.completion_ids, batch.completion_mask)
    ids = [row[m.bool()].tolist() for row, m in pairs]
    repeated = [r for r in rows for _ in range(repeat)]
    columns = {k: [r.get(k) for r in repeated] for k in columns_of(rows)}
    prompts = [r["prompt"] for r in repeated]
    total, _, metrics = rewards(prompts, texts, ids, columns, state)
    return total.to(batch.completion_ids.device), metrics, texts


def fill_unscored(rewards: torch.Tensor, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards with each unscored (NaN) entry set to its group's mean of the scored ones (0 if
    none), and the mask of those entries, whose advantage the caller sets to 0 (as TRL does)."""
    unscored = rewards.isnan()
    if not unscored.any():
        return rewards, unscored
    groups = rewards.reshape(-1, G)
    fill = groups.nanmean(-1, keepdim=True).nan_to_num(0.0).expand_as(groups).reshape(-1)
    return torch.where(unscored, fill, rewards), unscored
