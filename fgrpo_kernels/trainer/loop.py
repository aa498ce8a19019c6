"""The thin on-policy loop: sample, score, old/reference log-probs, fused loss, update.

Per step: G completions for each of `prompts_per_step` prompts; rewards from the user's
function; advantages by group normalisation; reference (and, with several updates per rollout,
old) log-probs by the forward-only fused kernel; then `num_updates` optimizer updates, each
accumulating gradients over micro-batches of whole groups. The loss always takes the last
hidden state and the lm_head weight: the training forward never produces logits.
"""

from __future__ import annotations

import copy
import math
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..reference import group_normalize
from . import evaluation, hf, rng, run_dir, scoring
from .config import TrainConfig
from .data import PromptSampler, as_rows
from .hf import Preferences, Rollout
from .rewards import RewardSet, RewardState


class Trainer:
    """GRPO-family RL of a Hugging Face causal LM (optionally a PeftModel) with a fused loss.

    prompts: a callable (n, rng) -> n prompts, or a sequence of prompts, drawn epoch by epoch.
    A prompt is a string or a row dict {"prompt": str, other columns...}; the other columns
    reach the reward functions as keyword lists (TRL's convention, see `rewards.py`).
    reward_fn: one reward function or a list of them (weighted by `config.reward_weights`),
    called as f(prompts=..., completions=..., completion_ids=..., **columns, trainer_state=...,
    log_metric=...); keywords a function does not take are left out.
    eval_prompts: rows scored every `config.eval_every` steps (mean reward and pass rate).
    preference_data (f-HAL): a callable (n, rng) -> n dicts {"prompt", "chosen", "rejected"},
    or a sequence of such dicts. ref_model: a frozen reference; by default a frozen copy of the
    initial model, or the adapter-disabled model for PEFT.
    """

    def __init__(
        self,
        model,
        tokenizer,
        reward_fn,
        prompts,
        config: TrainConfig,
        *,
        eval_prompts: Sequence | None = None,
        ref_model=None,
        preference_data=None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler=None,
    ):
        self.cfg, self.model, self.tokenizer = config, model, tokenizer
        self.rewards = RewardSet(reward_fn, config.reward_weights)
        if config.loss == "fhal" and preference_data is None:
            raise ValueError("preference_data: expected preference pairs for loss='fhal'; got None")
        self.prompts, self.preference_data = prompts, preference_data
        self.sampler = None if callable(prompts) else PromptSampler(as_rows(prompts), config.seed)
        self.eval_rows = None if eval_prompts is None else as_rows(eval_prompts)
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
        self.chance: float | None = None
        self.resumed = False
        self.stop_requested = False
        self.start_step = 0  # the step this session of `train` started after

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

    def _draw_rows(self, n: int) -> list[dict]:
        if self.sampler is not None:
            return self.sampler.draw(n)
        return as_rows(self.prompts(n, self.rng))

    def _fixed_logps(self, batch: hf.Batch, reference: bool):
        tau = self.cfg.temperature
        if not reference:
            return hf.logps_no_grad(self.model, batch, tau)
        if self.ref_is_adapter:
            return hf.logps_no_grad(self.model, batch, tau, disable_adapter=True)
        if self.ref_model is None:
            return None
        return hf.logps_no_grad(self.ref_model, batch, tau)

    def score(self, rows: list[dict], batch: hf.Batch, repeat: int):
        """(rewards [B] with NaN where unscored, reward metrics, completion texts)."""
        state = RewardState(global_step=self.step_count, max_steps=self.cfg.steps)
        return scoring.score(self.rewards, self.tokenizer, rows, batch, repeat, state)

    def rollout(self) -> tuple[Rollout, list[str], list[str], dict]:
        """Sample, score, normalise, and attach reference (and old) log-probs."""
        cfg = self.cfg
        rows = self._draw_rows(cfg.prompts_per_step)
        batch = hf.sample(
            self.model, self.tokenizer, [r["prompt"] for r in rows], cfg.num_generations,
            cfg.max_new_tokens, cfg.temperature,
        )  # fmt: skip
        rewards, metrics, texts = self.score(rows, batch, cfg.num_generations)
        rewards, unscored = scoring.fill_unscored(rewards, cfg.num_generations)
        rollout = Rollout(**vars(batch), rewards=rewards)
        advantages = group_normalize(rewards, cfg.num_generations, scale=cfg.scale_rewards)
        rollout.advantages = advantages.masked_fill(unscored, 0.0)
        rollout.ref_logps = self._fixed_logps(batch, reference=True)
        if cfg.num_updates > 1 and cfg.loss == "grpo":
            rollout.old_logps = self._fixed_logps(batch, reference=False)
        prompts = [r["prompt"] for r in rows for _ in range(cfg.num_generations)]
        return rollout, prompts, texts, metrics

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
        rollout, prompts, texts, reward_metrics = self.rollout()
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
            "rollouts": r.numel(),
            "completion_length": float(rollout.completion_mask.sum(-1).float().mean()),
            **reward_metrics,
            **metrics,
            "lr": self.scheduler.get_last_lr()[0],
            "rollout_s": t1 - t0,
            "update_s": time.perf_counter() - t1,
        }
        record["sample"] = f"{prompts[0]} -> {texts[0]!r}"
        return record

    def evaluate(self) -> dict[str, float]:
        """Mean reward and pass rate on the eval rows (see `evaluation.evaluate`)."""
        return evaluation.evaluate(self)

    def request_stop(self) -> None:
        """Finish the current step, then end `train` as if its last step were done."""
        self.stop_requested = True

    def state_dict(self) -> dict:
        """Everything besides the weights that a resumed run needs to continue exactly."""
        return {
            "step": self.step_count,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng.rng_state(),
            "trainer_rng": rng.python_rng_state(self.rng),
            "sampler": None if self.sampler is None else self.sampler.state_dict(),
            "chance": self.chance,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state_dict()` (the model must already hold the checkpoint's weights);
        `train` then appends to the run's metrics instead of starting them over."""
        self.step_count = int(state["step"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        rng.set_python_rng_state(self.rng, state["trainer_rng"])
        if self.sampler is not None and state["sampler"] is not None:
            self.sampler.load_state_dict(state["sampler"])
        self.chance = state["chance"]
        self._rng_state = state["rng"]
        self.resumed = True

    def resume_from(self, checkpoint) -> None:
        """`load_state_dict` from a checkpoint folder's trainer_state.pt."""
        self.load_state_dict(run_dir.load_state(checkpoint))

    def save(self, path) -> None:
        """A resumable checkpoint: save_pretrained of the model (the adapter for PEFT) and the
        tokenizer, plus trainer_state.pt."""
        run_dir.save_checkpoint(Path(path), self.model, self.tokenizer, self.state_dict())

    def _begin(self, out: Path) -> tuple[list[dict], float]:
        """(history so far, seconds already spent): a fresh run seeds every random stream and
        starts its metrics; a resumed one restores them and keeps its logged steps."""
        out.mkdir(parents=True, exist_ok=True)
        if not self.resumed:
            rng.seed_everything(self.cfg.seed)
            run_dir.start_metrics(out, self.cfg.to_dict())
            if self.cfg.chance_samples:
                self.chance = evaluation.chance_level(self, self.cfg.chance_samples)
            return [], 0.0
        history = run_dir.resume_metrics(out, self.step_count)
        rng.set_rng_state(self._rng_state)  # last: loading models may have drawn numbers
        return history, (history[-1].get("time_s", 0.0) if history else 0.0)

    def train(self, callback: Callable[[dict], None] | None = None) -> list[dict]:
        """Run up to `cfg.steps` steps (fewer if `request_stop` is called); metrics go to
        out_dir/metrics.jsonl, one line per step, and out_dir/final is a resumable checkpoint.
        Returns the records of every step of the run, earlier sessions included."""
        cfg = self.cfg
        out = Path(cfg.out_dir)
        history, spent = self._begin(out)
        self.start_step = self.step_count
        start, bar = time.perf_counter(), _progress(cfg, self.step_count)
        while self.step_count < cfg.steps and not self.stop_requested:
            record = self.step()
            due = cfg.eval_every and self.step_count % cfg.eval_every == 0
            if self.eval_rows and (due or (cfg.eval_every and self.step_count == cfg.steps)):
                record.update(self.evaluate())
            record["time_s"] = spent + time.perf_counter() - start
            run_dir.append_metrics(out, record)
            history.append(record)
            if bar is not None:
                bar.set_postfix(_postfix(record), refresh=False)
                bar.update()
            if callback is not None:
                callback(record)
            if cfg.save_every and self.step_count % cfg.save_every == 0:
                self.save(out / f"{run_dir.CHECKPOINT}{self.step_count}")
        if bar is not None:
            bar.close()
        self.save(out / run_dir.FINAL)
        return history


def _progress(cfg: TrainConfig, done: int):
    if not cfg.progress:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm comes with the dev extra; without it, no bar
        return None
    return tqdm(total=cfg.steps, initial=done, desc=f"train {cfg.loss}", unit="step")


def _postfix(record: dict) -> dict[str, str]:
    kl = record.get("kl", record.get("fgrpo/kl"))
    out = {"reward": f"{record['reward_mean']:.3f}", "loss": f"{record['loss']:.4f}"}
    if kl is not None:
        out["kl"] = f"{kl:.3f}"
    return out
