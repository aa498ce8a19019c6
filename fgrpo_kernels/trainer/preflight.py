"""Checks of `fgrpo train`'s options before anything heavy is loaded: paths, data, rewards, the
model's config and tokenizer (never its weights). Each failure is a ValueError whose message
starts with the option's name; the command prints it as one line.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path

from . import data as data_mod
from . import rewards as rewards_mod

INSTALL = {"wandb": "pip install wandb"}  # the rest come with the train extra
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class Plan:
    """What the checks found, handed to the loading step."""

    rows: list[dict] | None = None  # None: the built-in digit task
    eval_rows: list[dict] | None = None
    preference_rows: list[dict] | None = None
    reward_fns: list = field(default_factory=list)
    tokenizer: object = None  # loaded from --model (None: the tiny model's)


def check_packages(opts: dict) -> None:
    """The optional packages the options need are installed."""
    need = [("transformers", "model")]
    if opts["lora_r"]:
        need.append(("peft", "lora_r"))
    if opts["report_to"] != "none":
        need.append((opts["report_to"], "report_to"))
    for package, arg in need:
        if importlib.util.find_spec(package) is None:
            install = INSTALL.get(package, "pip install 'fgrpo-kernels[train]'")
            raise ValueError(f"{arg}: fgrpo train needs the {package} package ({install})")


def device(name: str, local_rank: int | None = None) -> str:
    """The torch device `--device` names ("auto": cuda when available, else cpu). Under
    torchrun (`local_rank` given) a CUDA device is the rank's own, cuda:LOCAL_RANK."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"device: expected auto, cpu, cuda or cuda:N; got {name!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {name!r} asked for, but torch sees no CUDA device")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected auto, cpu, cuda or cuda:N; got {name!r}")
    if dev.type != "cuda" or local_rank is None:
        return name
    if dev.index is not None:
        raise ValueError(
            f"device: under torchrun each rank uses cuda:LOCAL_RANK; got {name!r} (pass --device "
            "cuda, or choose the GPUs with CUDA_VISIBLE_DEVICES)"
        )
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(
            f"device: local rank {local_rank} has no GPU of its own (torch sees {count}); start "
            f"at most {count} ranks per node or pass --device cpu"
        )
    return f"cuda:{local_rank}"


def model_source(model: str | None) -> str | None:
    """None (the embedded tiny model), an existing local folder, or a Hub id ("org/name")."""
    if model is None:
        return None
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"model: {model!r} is a file; expected a checkpoint folder")
        if not (path / "config.json").exists():
            raise ValueError(f"model: {model!r} has no config.json; expected a checkpoint folder")
        return str(path)
    if HUB_ID.match(model) and not model.startswith((".", "~")):
        return model
    raise ValueError(f"model: no such folder: {model!r}")


def check_model(source: str):
    """The model's config (head) and tokenizer (eos/pad inside the vocabulary); returns the
    tokenizer, with pad set to eos when it has none."""
    from transformers import AutoConfig, AutoTokenizer

    from .hf import check_head_config

    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise ValueError(f"model: cannot read the config of {source!r}: {_first_line(e)}") from None
    check_head_config(config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(
            f"tokenizer: cannot load the tokenizer of {source!r}: {_first_line(e)}"
        ) from None
    vocab = config.get_text_config().vocab_size
    check_tokenizer(tokenizer, vocab)
    return tokenizer


def check_tokenizer(tokenizer, vocab_size: int) -> None:
    """eos (and pad, which defaults to eos) are tokens the model can emit: ids below vocab_size."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(
            "tokenizer: has no eos_token, so completions cannot end; set one that the model "
            f"knows (an id below its vocab_size {vocab_size}) in the checkpoint's tokenizer"
        )
    for name, tid in (("eos_token", eos), ("pad_token", tokenizer.pad_token_id)):
        if tid is not None and not 0 <= tid < vocab_size:
            token = getattr(tokenizer, name)
            raise ValueError(
                f"tokenizer: {name} {token!r} has id {tid}, outside the model's vocabulary "
                f"(vocab_size {vocab_size}); pick a token the model has or resize its embeddings"
            )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token


def load_data(opts: dict) -> Plan:
    """Prompts (and the held-out split), preference pairs and reward functions."""
    plan = Plan()
    if opts["prompts"] is not None:
        plan.rows, held = data_mod.load_rows(opts["prompts"], opts["prompt_column"], "prompts")
        if opts["eval_prompts"] is not None:
            plan.eval_rows, _ = data_mod.load_rows(
                opts["eval_prompts"], opts["prompt_column"], "eval_prompts"
            )
        elif held is not None:
            plan.eval_rows = held
        elif opts["eval_every"]:
            plan.rows, plan.eval_rows = data_mod.split_rows(
                plan.rows, opts["eval_size"], opts["seed"]
            )
    elif opts["eval_prompts"] is not None:
        raise ValueError("eval_prompts: needs --prompts (the built-in task has its own eval set)")
    if opts["preferences"] is not None:
        rows, _ = data_mod.load_rows(opts["preferences"], "prompt", "preferences")
        for n, row in enumerate(rows, 1):
            if not all(isinstance(row.get(k), str) for k in ("chosen", "rejected")):
                raise ValueError(f"preferences: row {n} needs 'chosen' and 'rejected' strings")
        plan.preference_rows = rows
    elif opts["loss"] == "fhal" and opts["prompts"] is not None:
        raise ValueError(
            "preferences: --loss fhal with --prompts needs --preferences FILE (rows with "
            "prompt, chosen, rejected)"
        )
    specs = opts["reward"] or ["pattern" if opts["prompts"] is None else "exact_match"]
    plan.reward_fns = [rewards_mod.resolve(s, opts["answer_column"]) for s in specs]
    weights = opts["reward_weights"]
    reward_set = rewards_mod.RewardSet(plan.reward_fns, weights)
    rows = plan.rows or [{"prompt": "0123?"}]
    columns = {k for r in rows for k in r if k != "prompt"}
    reward_set.check_columns(columns, rows + (plan.eval_rows or []))
    return plan


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
