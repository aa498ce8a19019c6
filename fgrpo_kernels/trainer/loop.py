"""The thin on-policy loop: sample, score, old/reference log-probs, fused loss, update.

Per step: G completions for each of `prompts_per_step` prompts; rewards from the user's
function; advantages by group normalisation; reference (and, with several updates per rollout,
old) log-probs by the forward-only fused kernel; then `num_updates` optimizer updates, each
accumulating gradients over micro-batches of whole groups. The loss always takes the last
hidden state and the lm_head weight: the training forward never produces logits.
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..reference import group_normalize
from . import hf
from .config import TrainConfig

RewardFn = Callable[[list[str], list[str]], Sequence[float]]


@dataclass
class Rollout(hf.Batch):
    """A sampled batch with its rewards [B], advantages [B] and fixed log-probs [B, T]."""

    rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None


@dataclass
class Preferences(hf.Batch):
    """Preference rows, chosen and rejected interleaved; chosen [B] bool."""

    chosen: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None


class Trainer:
    """GRPO-family RL of a Hugging Face causal LM (optionally a PeftModel) with a fused loss.

    prompts: a callable (n, rng) -> n prompt strings, or a sequence of prompts to draw from.
    reward_fn(prompts, completions) -> one reward per completion (prompts repeated G times).
    preference_data (f-HAL): a callable (n, rng) -> n dicts {"prompt", "chosen", "rejected"},
    or a sequence of such dicts. ref_model: a frozen reference; by default a frozen copy of the
    initial model, or the adapter-disabled model for PEFT.
    """

    def __init__(
        self,
        model,
        tokenizer,
        reward_fn: RewardFn,
        prompts,
        config: TrainConfig,
        *,
        ref_model=None,
        preference_data=None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler=None,
    ):
        self.cfg, self.model, self.tokenizer, self.reward_fn = config, model, tokenizer, reward_fn
        if config.loss == "fhal" and preference_data is None:
            raise ValueError("preference_data: expected preference pairs for loss='fhal'; got None")
        self.prompts, self.preference_data = prompts, preference_data
        self.rng = random.Random(config.seed)
        self.loss_fn = config.loss_module()
        hf.lm_head(model)  # fail early on heads the fused loss cannot take
        self.ref_model, self.ref_is_adapter = self._reference(ref_model)
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = optimizer or torch.optim.AdamW(
            params, lr=config.lr, weight_decay=config.weight_decay
        )
        self.scheduler = scheduler or torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, config.lr_factor
        )
        self.model.eval()  # no dropout during RL, as in TRL's default
        self.step_count = 0

    def _reference(self, ref_model):
        cfg = self.cfg
        if cfg.loss == "grpo" and cfg.beta == 0.0:
            return None, False
        if ref_model is not None:
            return ref_model.eval().requires_grad_(False), False
        mode = cfg.reference
        if mode == "auto":
            mode = "adapter" if hf.is_peft(self.model) else "copy"
        if mode == "adapter":
            if not hf.is_peft(self.model):
                raise ValueError("reference: 'adapter' needs a PEFT model; got a plain model")
            return None, True
        return copy.deepcopy(self.model).eval().requires_grad_(False), False

    def _draw(self, source, n):
        if callable(source):
            return list(source(n, self.rng))
        source = list(source)
        return self.rng.sample(source, n) if len(source) >= n else self.rng.choices(source, k=n)

    def _fixed_logps(self, batch: hf.Batch, reference: bool):
        tau = self.cfg.temperature
        if not reference:
            return hf.logps_no_grad(self.model, batch, tau)
        if self.ref_is_adapter:
            return hf.logps_no_grad(self.model, batch, tau, disable_adapter=True)
        if self.ref_model is None:
            return None
        return hf.logps_no_grad(self.ref_model, batch, tau)

    def rollout(self) -> tuple[Rollout, list[str], list[str]]:
        """Sample, score, normalise, and attach reference (and old) log-probs."""
        cfg = self.cfg
        prompts = self._draw(self.prompts, cfg.prompts_per_step)
        batch = hf.sample(
            self.model, self.tokenizer, prompts, cfg.num_generations, cfg.max_new_tokens,
            cfg.temperature,
        )  # fmt: skip
        texts = self.tokenizer.batch_decode(batch.completion_ids, skip_special_tokens=True)
        repeated = [p for p in prompts for _ in range(cfg.num_generations)]
        scores = [float(r) for r in self.reward_fn(repeated, texts)]
        if len(scores) != len(texts):
            raise ValueError(f"reward_fn: expected {len(texts)} rewards; got {len(scores)}")
        rewards = torch.tensor(scores, device=batch.completion_ids.device)
        rollout = Rollout(**vars(batch), rewards=rewards)
        rollout.advantages = group_normalize(rewards, cfg.num_generations, scale=cfg.scale_rewards)
        rollout.ref_logps = self._fixed_logps(batch, reference=True)
        if cfg.num_updates > 1 and cfg.loss == "grpo":
            rollout.old_logps = self._fixed_logps(batch, reference=False)
        return rollout, repeated, texts

    def preferences(self) -> Preferences:
        pairs = self._draw(self.preference_data, self.cfg.pref_batch_size)
        prompts = [p["prompt"] for p in pairs for _ in range(2)]
        texts = [p[k] for p in pairs for k in ("chosen", "rejected")]
        batch = hf.encode(self.tokenizer, prompts, texts)
        device = hf.causal_lm(self.model).device
        chosen = torch.arange(len(texts), device=device) % 2 == 0
        prefs = Preferences(**{k: v.to(device) for k, v in vars(batch).items()}, chosen=chosen)
        prefs.ref_logps = self._fixed_logps(prefs, reference=True)
        return prefs

    def _micro_loss(self, mb: Rollout, prefs: Preferences | None, num_items):
        T = mb.completion_ids.shape[1]
        hidden = hf.completion_hidden(self.model, mb.input_ids, mb.attention_mask, T)
        weight, bias = hf.lm_head(self.model)
        ids, mask, cfg = mb.completion_ids, mb.completion_mask, self.cfg
        if cfg.loss == "fgrpo":
            return self.loss_fn(
                hidden, weight, ids, mask, advantages=mb.advantages,
                ref_per_token_logps=mb.ref_logps, bias=bias,
            )  # fmt: skip
        if cfg.loss == "grpo":
            return self.loss_fn(
                hidden, weight, ids, mask, mb.advantages, bias, ref_per_token_logps=mb.ref_logps,
                old_per_token_logps=mb.old_logps, num_items_in_batch=num_items,
            )  # fmt: skip
        if cfg.loss == "gift":
            return self.loss_fn(hidden, weight, ids, mask, mb.rewards, mb.ref_logps, bias=bias)
        pref_hidden = hf.completion_hidden(
            self.model, prefs.input_ids, prefs.attention_mask, prefs.completion_ids.shape[1]
        )
        return self.loss_fn(
            hidden, weight, ids, mask, pref_hidden, prefs.completion_ids, prefs.completion_mask,
            prefs.chosen, advantages=mb.advantages, ref_per_token_logps=mb.ref_logps,
            pref_ref_per_token_logps=prefs.ref_logps, bias=bias,
        )  # fmt: skip

    def update(self, rollout: Rollout, prefs: Preferences | None = None) -> dict[str, float]:
        """`num_updates` optimizer steps on one rollout; returns averaged loss metrics."""
        cfg = self.cfg
        n_micro = cfg.grad_accum
        rows = rollout.completion_ids.shape[0] // n_micro
        pref_rows = 0 if prefs is None else prefs.completion_ids.shape[0] // n_micro
        dapo = cfg.loss == "grpo" and cfg.loss_type == "dapo"
        # dapo: the whole rollout's tokens (at least 1: a rollout of empty completions has 0)
        num_items = rollout.completion_mask.sum().clamp(min=1) if dapo else None
        scale = 1.0 if dapo else 1.0 / n_micro
        sums: dict[str, float] = {}
        losses, norms = [], []
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for _ in range(cfg.num_updates):
            self.optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for k in range(n_micro):
                mb = rollout.rows(slice(k * rows, (k + 1) * rows))
                pmb = None
                if prefs is not None:
                    pmb = prefs.rows(slice(k * pref_rows, (k + 1) * pref_rows))
                loss, metrics = self._micro_loss(mb, pmb, num_items)
                (loss * scale).backward()
                total += float(loss.detach()) * scale
                for name, value in metrics.items():
                    sums[name] = sums.get(name, 0.0) + float(value) / (n_micro * cfg.num_updates)
            clip = cfg.max_grad_norm if cfg.max_grad_norm is not None else math.inf
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
            self.optimizer.step()
            self.scheduler.step()
            losses.append(total)
        sums["loss"] = sum(losses) / len(losses)  # the whole rollout's loss, mean over updates
        sums["grad_norm"] = sum(norms) / len(norms)
        return sums

    def step(self) -> dict[str, float]:
        """One rollout and its updates; returns the step's metrics record."""
        t0 = time.perf_counter()
        rollout, prompts, texts = self.rollout()
        prefs = self.preferences() if self.cfg.loss == "fhal" else None
        t1 = time.perf_counter()
        metrics = self.update(rollout, prefs)
        self.step_count += 1
        r = rollout.rewards
        groups = r.reshape(-1, self.cfg.num_generations)
        record = {
            "step": self.step_count,
            "reward_mean": float(r.mean()),
            "reward_std": float(r.std()) if r.numel() > 1 else 0.0,
            "frac_reward_zero_std": float((groups.std(-1) == 0).float().mean()),
            "completion_length": float(rollout.completion_mask.sum(-1).float().mean()),
            **metrics,
            "lr": self.scheduler.get_last_lr()[0],
            "rollout_s": t1 - t0,
            "update_s": time.perf_counter() - t1,
        }
        record["sample"] = f"{prompts[0]} -> {texts[0]!r}"
        return record

    def save(self, path) -> None:
        """save_pretrained of the model (the adapter for PEFT) and the tokenizer."""
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)

    def train(self, callback: Callable[[dict], None] | None = None) -> list[dict]:
        """Run `cfg.steps` steps; metrics go to out_dir/metrics.jsonl, one line per step."""
        cfg = self.cfg
        out = Path(cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        torch.manual_seed(cfg.seed)
        history, start, bar = [], time.perf_counter(), _progress(cfg)
        with open(out / "metrics.jsonl", "w") as log:
            for _ in range(cfg.steps):
                record = self.step()
                record["time_s"] = time.perf_counter() - start
                log.write(json.dumps(record) + "\n")
                log.flush()
                history.append(record)
                if bar is not None:
                    bar.set_postfix(_postfix(record), refresh=False)
                    bar.update()
                if callback is not None:
                    callback(record)
                if cfg.save_every and self.step_count % cfg.save_every == 0:
                    self.save(out / f"checkpoint-{self.step_count}")
        if bar is not None:
            bar.close()
        self.save(out / "final")
        return history


def _progress(cfg: TrainConfig):
    if not cfg.progress:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm comes with the dev extra; without it, no bar
        return None
    return tqdm(total=cfg.steps, desc=f"train {cfg.loss}", unit="step")


def _postfix(record: dict) -> dict[str, str]:
    kl = record.get("kl", record.get("fgrpo/kl"))
    out = {"reward": f"{record['reward_mean']:.3f}", "loss": f"{record['loss']:.4f}"}
    if kl is not None:
        out["kl"] = f"{kl:.3f}"
    return out
