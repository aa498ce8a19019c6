"""The thin on-policy loop: sample, score, old/reference log-probs, fused loss, update.

Per step: G completions for each of `prompts_per_step` prompts; rewards from the user's
function; advantages by group normalisation; reference (and, with several updates per rollout,
old) log-probs by the forward-only fused kernel; then `num_updates` optimizer updates, each
accumulating gradients over micro-batches of whole groups. The loss always takes the last
hidden state and the lm_head weight: the training forward never produces logits. Under
torch.distributed each rank does this on its own prompts, DDP or FSDP2 averages the gradients
and rank 0 writes the run folder (`parallel.py`).
"""

from __future__ import annotations

import copy
import functools
import math
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..core.reference import group_normalize
from . import checkpoint, evaluation, hf, parallel, report, run_dir, scoring
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

    With a torch.distributed process group initialised (torchrun), the run is data-parallel:
    `prompts_per_step` prompts per rank, the model wrapped in DDP (FSDP2 with `config.fsdp`,
    in place; pass no `optimizer` then, the trainer builds it over the sharded parameters),
    global metrics on every rank, and the run folder written by rank 0 (`save`,
    `state_dict` and `train` are collectives: every rank calls them).
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
        self.ranks = parallel.current(config.fsdp)
        if optimizer is not None and self.ranks.mode == "fsdp":
            raise ValueError(
                "optimizer: with fsdp=True the trainer shards the model in place and builds the "
                "optimizer over the sharded parameters; pass none"
            )
        self.ref_model, self.ref_is_adapter = self._reference(ref_model)
        self.wrapped = parallel.wrap(model, self.ranks)
        if self.ref_model is not None and self.ranks.mode == "fsdp":
            parallel.shard(hf.causal_lm(self.ref_model), hf.causal_lm(model).device)
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
        self.restored_rng: dict | None = None  # this rank's random streams, on resume
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
        """n items for this rank: every rank draws the same n per rank and keeps its slice."""
        total = n * self.ranks.world
        if callable(source):
            return self.ranks.mine(list(source(total, self.rng)), n)
        source = list(source)
        pick = self.rng.sample if len(source) >= total else self.rng.choices
        return self.ranks.mine(pick(source, k=total), n)

    def _draw_rows(self, n: int) -> list[dict]:
        if self.sampler is not None:
            return self.ranks.mine(self.sampler.draw(n * self.ranks.world), n)
        return self.ranks.mine(as_rows(self.prompts(n * self.ranks.world, self.rng)), n)

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
        """(rewards [B] with NaN where unscored, each function's [B, F], reward metrics,
        completion texts)."""
        state = RewardState(global_step=self.step_count, max_steps=self.cfg.steps)
        return scoring.score(self.rewards, self.tokenizer, rows, batch, repeat, state)

    def sample(self, prompts: list[str], num_generations: int, temperature: float) -> hf.Batch:
        synced = self.ranks.mode == "fsdp"
        return hf.sample(
            self.model, self.tokenizer, prompts, num_generations, self.cfg.max_new_tokens,
            temperature, synced,
        )  # fmt: skip

    def rollout(self) -> tuple[Rollout, list[str], list[str], dict]:
        """Sample, score, normalise, and attach reference (and old) log-probs."""
        cfg = self.cfg
        rows = self._draw_rows(cfg.prompts_per_step)
        batch = self.sample([r["prompt"] for r in rows], cfg.num_generations, cfg.temperature)
        rewards, terms, metrics, texts = self.score(rows, batch, cfg.num_generations)
        rewards, unscored = scoring.fill_unscored(rewards, cfg.num_generations)
        rollout = Rollout(**vars(batch), rewards=rewards, reward_terms=terms)
        rollout.advantages = self._advantages(rewards).masked_fill(unscored, 0.0)
        rollout.ref_logps = self._fixed_logps(batch, reference=True)
        if cfg.num_updates > 1 and cfg.loss == "grpo":
            rollout.old_logps = self._fixed_logps(batch, reference=False)
        prompts = [r["prompt"] for r in rows for _ in range(cfg.num_generations)]
        return rollout, prompts, texts, metrics

    def _advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Group-normalised advantages; with scale_rewards="batch" the σ is the global batch's
        (every rank's rewards gathered, O(B)), as TRL computes it."""
        cfg = self.cfg
        if not (self.ranks.distributed and cfg.scale_rewards == "batch"):
            return group_normalize(rewards, cfg.num_generations, scale=cfg.scale_rewards)
        every = torch.cat([r.to(rewards.device) for r in self.ranks.gather(rewards.cpu())])
        advantages = group_normalize(every, cfg.num_generations, scale="batch")
        return self.ranks.mine(advantages, rewards.shape[0])

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
        """(loss, metrics) of a micro-batch, computed inside the (wrapped) model's forward."""
        fn = functools.partial(self._loss_in_forward, mb, prefs, num_items)
        return parallel.forward(self.wrapped, fn)

    def _loss_in_forward(self, mb: Rollout, prefs: Preferences | None, num_items, lm):
        T = mb.completion_ids.shape[1]
        hidden = hf.completion_hidden(lm, mb.input_ids, mb.attention_mask, T)
        weight, bias = hf.lm_head(lm)
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
            lm, prefs.input_ids, prefs.attention_mask, prefs.completion_ids.shape[1]
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
        num_items = None
        if dapo:
            # the tokens of the whole rollout on every rank (at least 1: empty completions
            # count 0), divided by the ranks, whose gradients DDP and FSDP2 average (as TRL)
            tokens = self.ranks.total(rollout.completion_mask.sum()).clamp(min=1)
            num_items = float(tokens) / self.ranks.world
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
                with parallel.gradient_sync(self.wrapped, self.ranks, k == n_micro - 1):
                    loss, metrics = self._micro_loss(mb, pmb, num_items)
                    (loss * scale).backward()
                total += float(loss.detach()) * scale
                for name, value in metrics.items():
                    sums[name] = sums.get(name, 0.0) + float(value) / (n_micro * cfg.num_updates)
            clip = cfg.max_grad_norm if cfg.max_grad_norm is not None else math.inf
            norms.append(parallel.as_float(torch.nn.utils.clip_grad_norm_(params, clip)))
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
        scalars = {
            "completion_length": float(rollout.completion_mask.sum(-1).float().mean()),
            **reward_metrics,
            **metrics,
            "rollout_s": t1 - t0,
            "update_s": time.perf_counter() - t1,
        }
        record = {"step": self.step_count}
        G = self.cfg.num_generations
        record |= scoring.global_metrics(self.ranks, self.rewards, rollout, G, scalars)
        record["lr"] = self.scheduler.get_last_lr()[0]
        record["sample"] = f"{prompts[0]} -> {texts[0]!r}"
        return record

    def evaluate(self) -> dict[str, float]:
        """Mean reward and pass rate on the eval rows (see `evaluation.evaluate`)."""
        return evaluation.evaluate(self)

    def request_stop(self) -> None:
        """Finish the current step, then end `train` as if its last step were done."""
        self.stop_requested = True

    def state_dict(self) -> dict:
        """Everything besides the weights that a resumed run needs to continue exactly (see
        `checkpoint.state_dict`; a collective under torch.distributed)."""
        return checkpoint.state_dict(self)

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state_dict()` (the model must already hold the checkpoint's weights);
        `train` then appends to the run's metrics instead of starting them over."""
        checkpoint.load_state_dict(self, state)

    def resume_from(self, path) -> None:
        """`load_state_dict` from a checkpoint folder's trainer_state.pt."""
        self.load_state_dict(run_dir.load_state(path))

    def save(self, path) -> None:
        """A resumable checkpoint: save_pretrained of the model (the adapter for PEFT) and the
        tokenizer, plus trainer_state.pt. Every rank calls it; rank 0 writes."""
        checkpoint.save(self, Path(path))

    def train(self, callback: Callable[[dict], None] | None = None) -> list[dict]:
        """Run up to `cfg.steps` steps (fewer if `request_stop` is called: on any rank, then
        every rank stops after the same step); metrics go to out_dir/metrics.jsonl, one line per
        step, and out_dir/final is a resumable checkpoint. Returns the records of every step
        of the run, earlier sessions included (the same on every rank; `callback` is called on
        every rank). With `cfg.save_total_limit` only the newest checkpoints stay; with
        `cfg.report_to` every record also goes to TensorBoard or W&B (`report.py`)."""
        cfg, main = self.cfg, self.ranks.main
        out = Path(cfg.out_dir)
        history, spent = checkpoint.begin(self, out)
        self.start_step = self.step_count
        reporter = report.NoReport()
        if main:
            reporter = report.open_report(cfg.report_to, out, self.step_count, cfg.to_dict())
        bar = _progress(cfg, self.step_count) if main else None
        try:
            self._steps(out, history, spent, bar, reporter, callback)
        finally:
            if bar is not None:
                bar.close()
            reporter.close()
        self.save(out / run_dir.FINAL)
        return history

    def _steps(self, out: Path, history: list[dict], spent: float, bar, reporter, callback):
        cfg, main = self.cfg, self.ranks.main
        start = time.perf_counter()
        stop = self.ranks.any(self.stop_requested)
        while self.step_count < cfg.steps and not stop:
            record = self.step()
            due = cfg.eval_every and self.step_count % cfg.eval_every == 0
            if self.eval_rows and (due or (cfg.eval_every and self.step_count == cfg.steps)):
                record.update(self.evaluate())
            record["time_s"] = spent + time.perf_counter() - start
            if main:
                run_dir.append_metrics(out, record)
                reporter.log(record)
            history.append(record)
            if bar is not None:
                bar.set_postfix(_postfix(record), refresh=False)
                bar.update()
            if callback is not None:
                callback(record)
            if cfg.save_every and self.step_count % cfg.save_every == 0:
                self.save(out / f"{run_dir.CHECKPOINT}{self.step_count}")
                if main and cfg.save_total_limit:  # after the new one is whole
                    run_dir.rotate(out, cfg.save_total_limit)
            stop = self.ranks.any(self.stop_requested)


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
