"""Glue to Hugging Face causal LMs: sampling, the backbone's last hidden state, the lm_head.

The training forward stops at the backbone: `completion_hidden` returns the last hidden state
at the positions that predict the completion tokens, and the loss takes it with the lm_head
weight. Both run inside one forward call of the model (`call_in_forward`), so DDP's and
FSDP2's hooks run around them and an FSDP2-sharded model holds its full parameters there.
Log-probs that need no gradient (old policy, reference) come from the same hidden state
through the forward-only fused kernel. With PEFT the base model is unwrapped, and the
reference is the model with its adapter disabled.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from dataclasses import dataclass, fields

import torch

from ..head.logprobs import fused_linear_logprobs


def causal_lm(model):
    """The transformers CausalLM inside `model` (a PeftModel is unwrapped)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def is_peft(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def check_head_config(config) -> None:
    """Refuse output layers that are not a plain linear (+ bias): the fused loss is exactly
    log_softmax(h W^T + b), so soft-capped or scaled logits would be trained wrongly."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(config, "final_logit_softcapping", None)
    if cap not in (None, 0.0):
        raise ValueError(
            f"model: final_logit_softcapping={cap} ({getattr(config, 'model_type', '?')}) is not "
            f"supported by the fused loss, which needs a plain linear lm_head"
        )
    scale = getattr(config, "logit_scale", None)
    if scale not in (None, 1.0):
        raise ValueError(f"model: logit_scale={scale} is not supported by the fused loss")


def lm_head(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [V, H], bias [V] | None) of the output layer, which must be a plain linear."""
    lm = causal_lm(model)
    check_head_config(lm.config)
    head = lm.get_output_embeddings()
    if hasattr(head, "base_layer"):
        raise ValueError(
            "model: the lm_head carries a PEFT adapter; remove it from the adapter's target_modules"
        )
    return head.weight, head.bias


def call_in_forward(lm, fn):
    """`fn(lm)`, through lm's `fgrpo_call` when it has one: an FSDP2-sharded model registers
    it as a forward method (`parallel.shard`), so that FSDP2 gathers the parameters around it
    and reduce-scatters their gradients after it."""
    method = getattr(lm, "fgrpo_call", None)
    return fn(lm) if method is None else method(fn)


def completion_hidden(model, input_ids, attention_mask, completion_len: int) -> torch.Tensor:
    """Last hidden state [B, T, H] at the positions predicting the last T tokens (no logits)."""
    lm = causal_lm(model)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = lm.base_model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    )
    return out.last_hidden_state[:, -completion_len - 1 : -1]


@dataclass
class Batch:
    """Prompt + completion rows. input_ids / attention_mask [B, P + T]; completion_* [B, T]."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor

    def rows(self, sl: slice):
        """The same kind of object restricted to rows `sl` (None fields stay None)."""
        return type(self)(**{f.name: _take(getattr(self, f.name), sl) for f in fields(self)})


@dataclass
class Rollout(Batch):
    """A sampled batch with its rewards [B] (each function's: reward_terms [B, F]), advantages
    [B] and fixed log-probs [B, T]."""

    rewards: torch.Tensor | None = None
    reward_terms: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None


@dataclass
class Preferences(Batch):
    """Preference rows, chosen and rejected interleaved; chosen [B] bool."""

    chosen: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None


def _take(value, sl):
    if value is None or isinstance(value, (int, float)):
        return value
    return value[sl]


def completion_logps(lm, batch: Batch, temperature: float) -> torch.Tensor:
    """Per-token log-probs [B, T] (0 where masked) of the completions by the fused kernel."""
    T = batch.completion_ids.shape[1]
    hidden = completion_hidden(lm, batch.input_ids, batch.attention_mask, T)
    weight, bias = lm_head(lm)
    targets = batch.completion_ids.masked_fill(batch.completion_mask == 0, -100)
    return fused_linear_logprobs(hidden, weight, targets, bias, temperature)


@torch.no_grad()
def logps_no_grad(model, batch: Batch, temperature: float, disable_adapter: bool = False):
    """`completion_logps` without gradient, inside the forward of the causal LM in `model`
    (with the PEFT adapter disabled if asked)."""
    ctx = model.disable_adapter() if disable_adapter else nullcontext()
    with ctx:
        fn = functools.partial(completion_logps, batch=batch, temperature=temperature)
        return call_in_forward(causal_lm(model), fn)


def completion_mask(completion_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """1 up to and including the first EOS of each row, 0 after it (int64 [B, T])."""
    is_eos = completion_ids == eos_id
    after = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return (~after).long()


@torch.no_grad()
def sample(
    model, tokenizer, prompts, num_generations, max_new_tokens, temperature, synced=False
) -> Batch:
    """G completions per prompt by ancestral sampling at `temperature` (no top-k / top-p;
    temperature 0: greedy); the G rows of one prompt are contiguous. `synced`: every rank runs
    max_new_tokens forwards (FSDP2's forwards are collectives), as HF's synced_gpus."""
    device = causal_lm(model).device
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left").to(device)
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    out = model.generate(
        input_ids=enc["input_ids"],
        attention_mask=enc["attention_mask"],
        **(sampling if temperature > 0 else dict(do_sample=False)),
        max_new_tokens=max_new_tokens,
        num_return_sequences=num_generations,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        synced_gpus=synced,
    )
    P = enc["input_ids"].shape[1]
    ids = out[:, P:]
    mask = completion_mask(ids, tokenizer.eos_token_id)
    ids = ids.masked_fill(mask == 0, tokenizer.pad_token_id)
    prompt_mask = enc["attention_mask"].repeat_interleave(num_generations, 0)
    input_ids = torch.cat([out[:, :P], ids], 1)
    return Batch(input_ids, torch.cat([prompt_mask, mask], 1), ids, mask)


def encode(tokenizer, prompts, completions) -> Batch:
    """Rows prompt + completion + EOS from text: prompts left-padded, completions right-padded."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    pieces = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions]
    T = max(len(p) for p in pieces) + 1
    ids = torch.full((len(pieces), T), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(pieces), T), dtype=torch.long)
    for i, p in enumerate(pieces):
        ids[i, : len(p) + 1] = torch.tensor([*p, tokenizer.eos_token_id])
        mask[i, : len(p) + 1] = 1
    input_ids = torch.cat([enc["input_ids"], ids], 1)
    return Batch(input_ids, torch.cat([enc["attention_mask"], mask], 1), ids, mask)
