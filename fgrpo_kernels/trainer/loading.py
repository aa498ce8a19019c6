"""Loading for `fgrpo train` (after the checks): the policy (fresh, LoRA-wrapped, or from a
checkpoint), the original reference model on resume, the data, and the Trainer."""

from __future__ import annotations

import random
from pathlib import Path

from .config import TrainConfig
from .loop import Trainer
from .preflight import Plan
from .task import PatternTask
from .tiny import tiny_model, tiny_tokenizer

EVAL_PROMPTS = 64  # held-out prompts of the built-in task


def load_base(source: str | None, seed: int):
    """The run's initial model: the tiny model built from `seed`, or `source` from_pretrained."""
    if source is None:
        return tiny_model(seed)
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(source)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"model: cannot load {source!r}: {first}") from None


def load_policy(opts: dict, source: str | None, checkpoint: Path | None):
    """The model to train: the initial one (LoRA-wrapped with --lora-r), or a checkpoint's."""
    if opts["lora_r"]:
        from peft import LoraConfig, PeftModel, get_peft_model

        base = load_base(source, opts["seed"])
        if checkpoint is not None:
            return PeftModel.from_pretrained(base, str(checkpoint), is_trainable=True)
        target = opts["lora_target"]
        lora = LoraConfig(
            r=opts["lora_r"],
            lora_alpha=opts["lora_alpha"] or 2 * opts["lora_r"],
            target_modules=target if target == "all-linear" else target.split(","),
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
        )
        return get_peft_model(base, lora)
    if checkpoint is None:
        return load_base(source, opts["seed"])
    if source is None:  # rebuilt as the run built it, then the checkpoint's weights
        from safetensors.torch import load_file

        model = tiny_model(opts["seed"])
        model.load_state_dict(load_file(Path(checkpoint) / "model.safetensors"))
        return model
    return load_base(str(checkpoint), opts["seed"])


def load_models(opts: dict, cfg: TrainConfig, source, checkpoint: Path | None, device: str):
    """(policy, reference or None) on `device`: on resume the reference is the run's original
    model, reloaded, not the checkpoint (None: the Trainer copies the policy, or disables the
    adapter)."""
    policy = load_policy(opts, source, checkpoint).to(device)
    uses_ref = not (cfg.loss == "grpo" and cfg.beta == 0.0)
    if checkpoint is not None and uses_ref and not opts["lora_r"]:
        return policy, load_base(source, opts["seed"]).to(device)
    return policy, None


def make_trainer(
    opts: dict, cfg: TrainConfig, plan: Plan, tokenizer, models, checkpoint: Path | None
) -> Trainer:
    """The Trainer of the run (resumed from `checkpoint` when given); under torch.distributed
    this wraps the policy (DDP / FSDP2), a collective."""
    policy, ref = models
    tokenizer = tokenizer if tokenizer is not None else tiny_tokenizer()
    task = PatternTask(steps=tuple(int(c) for c in opts["task_steps"]))
    prompts = plan.rows if plan.rows is not None else task.prompts
    eval_rows = plan.eval_rows
    if eval_rows is None and plan.rows is None and cfg.eval_every:
        eval_rows = task.prompts(EVAL_PROMPTS, random.Random(cfg.seed + 1))
    trainer = Trainer(
        policy, tokenizer, plan.reward_fns, prompts, cfg, eval_prompts=eval_rows,
        ref_model=ref, preference_data=plan.preference_rows or task.preference_pairs,
    )  # fmt: skip
    if checkpoint is not None:
        trainer.resume_from(checkpoint)
    return trainer
