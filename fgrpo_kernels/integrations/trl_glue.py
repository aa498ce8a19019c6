"""Tensor-level helpers of the TRL drop-in (no TRL import): the hidden-state forward, group
reordering, the logit scale and the MoE load-balancing loss."""

from __future__ import annotations

import functools
import types

import torch


def causal_lm(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def install_hidden_forward(model) -> None:
    """Let `model(..., fgrpo_last_hidden=True)` return the backbone output (no lm_head), so the
    loss goes through every wrapper (DDP, PEFT) like TRL's `fused_lm_head=True` call."""
    target = causal_lm(model)
    if getattr(target, "_fgrpo_hidden_forward", False):
        return
    inner = target.forward

    @functools.wraps(type(target).forward)
    def forward(self, *args, fgrpo_last_hidden=False, **kwargs):
        if not fgrpo_last_hidden:
            return inner(*args, **kwargs)
        for key in ("labels", "shift_labels", "num_items_in_batch", "fused_lm_head"):
            kwargs.pop(key, None)
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        kwargs["use_cache"] = False
        return self.base_model(*args, **kwargs)

    target.forward = types.MethodType(forward, target)
    target._fgrpo_hidden_forward = True


def groups_contiguous(inputs: dict, num_generations: int) -> dict:
    """Rows reordered so that each group's G completions are contiguous (TRL shuffles)."""
    group = inputs["fgrpo_group"]
    order = torch.argsort(group, stable=True)
    counts = torch.unique(group, return_counts=True)[1]
    if bool((counts != num_generations).any()):
        raise ValueError(
            "loss_type: 'gift' needs whole groups of num_generations completions per micro-batch"
        )
    B = group.shape[0]
    return {
        k: v[order] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == B else v
        for k, v in inputs.items()
    }


def logit_scale(config) -> float:
    """The factor a model applies to its logits before the softmax, read as TRL's fused head
    reads it (logit_scale, output_multiplier, lm_head_multiplier, 1 / logits_scaling); the
    fused loss folds it into the temperature (τ / scale)."""
    scale = getattr(config, "logit_scale", None)
    for key in ("output_multiplier", "lm_head_multiplier"):
        scale = getattr(config, key, None) if scale is None else scale
    if scale is None and getattr(config, "logits_scaling", None) is not None:
        scaling = config.logits_scaling
        scale = scaling if config.model_type == "hyperclovax" else 1.0 / scaling
    scale = 1.0 if scale is None else float(scale)
    if not scale > 0.0:
        raise NotImplementedError(f"logit_scale: a logit scale of {scale} is not supported")
    return scale


def router_aux_loss(model, out, inputs, completion_mask) -> torch.Tensor:
    """The MoE load-balancing loss of this forward, as TRL's fused head computes it (Mixtral's
    load_balancing_loss_func over the router logits, masked by the attention mask)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    config = causal_lm(model).config.get_text_config()
    attention = torch.cat([inputs["prompt_mask"], completion_mask], 1)
    return load_balancing_loss_func(
        out.router_logits, config.num_experts, config.num_experts_per_tok, attention
    )
