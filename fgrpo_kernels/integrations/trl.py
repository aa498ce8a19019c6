"""TRL drop-in: GRPOTrainer's loss from the last hidden state and the lm_head weight.

    from fgrpo_kernels.integrations.trl import FusedGRPOConfig, FusedGRPOTrainer
    trainer = FusedGRPOTrainer(model=..., reward_funcs=..., args=FusedGRPOConfig(...), ...)

or, on a trainer you already built, `use_fused_loss(trainer)`. Only `_compute_loss` changes:
TRL still generates, scores, and computes the old and reference log-probs (for PEFT, with the
adapter disabled). The loss runs the backbone, takes the hidden states that predict the
completion tokens (shifted by one, as TRL's fused head does) and calls FusedLinearGRPOLoss
with TRL's normalisers, so loss and gradients equal TRL's own. Two more `loss_type`s:
"fgrpo" (FusedLinearFGRPOLoss, TRL's advantages, `beta` as the f-GRPO β) and "gift"
(FusedLinearGIFTLoss on the raw rewards, whole groups per micro-batch). Options TRL has and the
fused loss does not (other loss types, two-sided clipping `delta`, off-policy masks, entropy
masks and bonus, vLLM IS correction, MoE aux loss, multimodal inputs, soft-capped heads) fall
back to TRL's own loss for the GRPO family, with one warning. TRL's default
`use_bias_correction_kl=True` (with beta != 0) is reproduced from the fused log-probs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from trl import GRPOConfig, GRPOTrainer

from .. import grpo_math
from ..divergences import NAMES as DIVERGENCES
from ..logprobs import fused_linear_logprobs
from ..losses import FusedLinearFGRPOLoss, FusedLinearGIFTLoss, FusedLinearGRPOLoss
from ..options import LOSS_TYPES as GRPO_FAMILY
from ..options import Level, parse
from . import trl_glue as glue

EXTRA_LOSS_TYPES = ("fgrpo", "gift")
_MULTIMODAL = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes")


@dataclass
class FusedGRPOConfig(GRPOConfig):
    """GRPOConfig plus the options of the extra loss types (`loss_type` "fgrpo" / "gift")."""

    fgrpo_divergence: str = "pearson"
    fgrpo_level: str = "token"
    fgrpo_reduction: str | None = None
    gift_detach_stats: bool = False


class FusedLossMixin:
    """Replaces GRPOTrainer._compute_loss by the fused modules (see the module docstring)."""

    def _fgrpo_setup(self) -> None:
        if self.loss_type in EXTRA_LOSS_TYPES and self.beta == 0.0:
            raise ValueError(
                f"beta: expected a non-zero beta for loss_type={self.loss_type!r} (it is the "
                "divergence scale, and TRL computes reference log-probs only when beta != 0)"
            )
        divergence = getattr(self.args, "fgrpo_divergence", "pearson")
        if divergence not in DIVERGENCES:
            raise ValueError(f"fgrpo_divergence: expected one of {DIVERGENCES}; got {divergence!r}")
        if self.loss_type == "gift" and self.args.steps_per_generation != 1:
            raise ValueError(
                "steps_per_generation: loss_type='gift' needs whole groups in each micro-batch; "
                f"expected 1, got {self.args.steps_per_generation}"
            )
        self._fgrpo_level = parse(
            Level, "importance_sampling_level", self.importance_sampling_level
        )
        self._fgrpo_loss = self._fgrpo_build_loss()
        self._fgrpo_warned = False
        glue.install_hidden_forward(self.model)

    def _fgrpo_build_loss(self) -> torch.nn.Module:
        args, tau = self.args, self.temperature
        if self.loss_type == "fgrpo":
            return FusedLinearFGRPOLoss(
                args.fgrpo_divergence if hasattr(args, "fgrpo_divergence") else "pearson",
                self.beta, getattr(args, "fgrpo_level", "token"),
                getattr(args, "fgrpo_reduction", None), temperature=tau, compute_entropy=True,
            )  # fmt: skip
        if self.loss_type == "gift":
            detach = getattr(args, "gift_detach_stats", False)
            return FusedLinearGIFTLoss(
                self.num_generations, self.beta, detach_stats=detach, temperature=tau,
                compute_entropy=True,
            )  # fmt: skip
        if self.loss_type not in GRPO_FAMILY:
            return None
        return FusedLinearGRPOLoss(
            self.loss_type, self.beta, self.epsilon_low, self.epsilon_high,
            self.importance_sampling_level, tau, self.max_completion_length,
            use_ref_model=self.beta != 0.0, compute_entropy=True,
        )  # fmt: skip

    def _fgrpo_unsupported(self, inputs) -> str | None:
        """Why this batch needs TRL's own loss, or None."""
        args, lm = self.args, glue.causal_lm(self.accelerator.unwrap_model(self.model))
        config = lm.config.get_text_config()
        checks = [
            (self._fgrpo_loss is None, f"loss_type={self.loss_type!r}"),
            (
                self.loss_type in GRPO_FAMILY and getattr(args, "delta", None) is not None,
                "delta (two-sided clipping)",
            ),
            (getattr(self, "off_policy_mask_threshold", None) is not None, "off-policy mask"),
            (getattr(self, "top_entropy_quantile", 1.0) < 1.0, "top_entropy_quantile < 1"),
            (getattr(self, "_entropy_bonus_enabled", False), "entropy bonus"),
            (getattr(self, "aux_loss_enabled", False), "MoE aux loss"),
            (
                self.use_vllm and getattr(self, "vllm_importance_sampling_correction", False),
                "vLLM importance-sampling correction",
            ),
            (any(inputs.get(k) is not None for k in _MULTIMODAL), "multimodal inputs"),
            (inputs["advantages"].dim() != 1, "per-token advantages"),
            (getattr(config, "final_logit_softcapping", None) is not None, "logit soft-capping"),
            (hasattr(lm.get_output_embeddings(), "base_layer"), "an adapter on the lm_head"),
        ]
        for key in ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling"):
            checks.append((getattr(config, key, None) not in (None, 1.0), key))
        return next((why for bad, why in checks if bad), None)

    def _compute_loss(self, model, inputs):
        why = self._fgrpo_unsupported(inputs)
        if why is not None:
            if self.loss_type in EXTRA_LOSS_TYPES:
                raise NotImplementedError(f"loss_type={self.loss_type!r} with {why}")
            if not self._fgrpo_warned:
                warnings.warn(f"fgrpo_kernels: {why} is not fused; using TRL's loss", stacklevel=2)
                self._fgrpo_warned = True
            return super()._compute_loss(model, inputs)
        if self.loss_type == "gift":
            inputs = glue.groups_contiguous(inputs, self.num_generations)
        ids, cmask = inputs["completion_ids"], inputs["completion_mask"]
        mask = cmask if "tool_mask" not in inputs else cmask * inputs["tool_mask"]
        T = ids.size(1)
        with self.accelerator.autocast():
            out = model(
                input_ids=torch.cat([inputs["prompt_ids"], ids], 1),
                attention_mask=torch.cat([inputs["prompt_mask"], cmask], 1),
                fgrpo_last_hidden=True,
            )
        head = glue.causal_lm(self.accelerator.unwrap_model(model)).get_output_embeddings()
        weight, bias = head.weight, head.bias
        hidden = out.last_hidden_state[:, -T - 1 : -1].to(weight.device)
        if hidden.dtype != weight.dtype:  # e.g. cast_lm_head_to_fp32
            hidden = hidden.to(weight.dtype)
        mode = "train" if self.model.training else "eval"
        ref, old, adv = (
            inputs.get("ref_per_token_logps"),
            inputs.get("old_per_token_logps"),
            inputs["advantages"],
        )
        dapo = self.loss_type == "dapo"
        if self._fgrpo_bias_corrected_kl():
            loss, metrics = glue.bias_corrected_grpo_loss(
                self, hidden, weight, bias, ids, mask, adv, ref, old
            )
        elif self.loss_type == "fgrpo":
            loss, metrics = self._fgrpo_loss(
                hidden, weight, ids, mask, advantages=adv, ref_per_token_logps=ref, bias=bias
            )
        elif self.loss_type == "gift":
            rewards = inputs["fgrpo_rewards"]
            loss, metrics = self._fgrpo_loss(hidden, weight, ids, mask, rewards, ref, bias=bias)
        else:  # dapo: the sum here, TRL's normaliser below
            loss, metrics = self._fgrpo_loss(
                hidden, weight, ids, mask, adv, bias, ref_per_token_logps=ref,
                old_per_token_logps=old, num_items_in_batch=1.0 if dapo else None,
            )  # fmt: skip
        accum = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if dapo:  # TRL: Σ mask·pt / (num_items / processes · accum / steps_per_generation)
            norm = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                norm = norm * self.current_gradient_accumulation_steps
                norm = norm / self.args.steps_per_generation
            loss = loss / norm
        else:
            loss = loss / accum
        self._fgrpo_log(mode, metrics, mask, hidden, weight, bias, ids, old, adv)
        return loss

    def _fgrpo_bias_corrected_kl(self) -> bool:
        return (
            self.loss_type in GRPO_FAMILY
            and self.beta != 0.0
            and getattr(self.args, "use_bias_correction_kl", False)
        )

    def _fgrpo_log(self, mode, metrics, mask, hidden, weight, bias, ids, old, adv):
        """TRL's metric names, each a global token-weighted mean like TRL's."""
        tokens = mask.sum().float()
        rows = torch.tensor(float(mask.shape[0]), device=tokens.device)
        sequence = self.importance_sampling_level == "sequence"

        def log(name, value, count):
            totals = self.accelerator.reduce(torch.stack([value * count, count]), reduction="sum")
            self._metrics[mode][name].append((totals[0] / totals[1].clamp(min=1.0)).item())

        if "kl" in metrics:
            log("kl", metrics["kl"], tokens)
        log("entropy", metrics["entropy"], tokens)
        if self.loss_type not in GRPO_FAMILY:
            for name, value in metrics.items():
                if name.startswith("implicit_reward"):
                    log(f"{self.loss_type}/{name}", value, rows)
            return
        for side in ("low", "high", "region"):
            log(
                f"clip_ratio/{side}_mean",
                metrics[f"clip_ratio/{side}_mean"],
                rows if sequence else tokens,
            )
        low, high = self._fgrpo_clip_per_sequence(mask, hidden, weight, bias, ids, old, adv)
        low, high = self.accelerator.gather(low), self.accelerator.gather(high)
        self._metrics[mode]["clip_ratio/low_min"].append(low[~low.isnan()].min().item())
        self._metrics[mode]["clip_ratio/high_max"].append(high[~high.isnan()].max().item())

    @torch.no_grad()
    def _fgrpo_clip_per_sequence(self, mask, hidden, weight, bias, ids, old, adv):
        """Per-sequence clipped fractions [B] (TRL's low_min / high_max inputs); zero without
        old log-probs, since the ratio is then exactly 1."""
        B = mask.shape[0]
        if old is None:
            return (mask.new_zeros(B, dtype=torch.float32),) * 2
        targets = ids.masked_fill(mask == 0, -100)
        logps = fused_linear_logprobs(hidden.detach(), weight, targets, bias, self.temperature)
        coef = grpo_math.importance_ratio(logps, old, mask, self._fgrpo_level)
        low, high = grpo_math.clip_indicators(coef, adv, self.epsilon_low, self.epsilon_high)
        if low.shape[1] == 1:
            return low[:, 0], high[:, 0]
        m = mask.float()
        return (low * m).sum(-1) / m.sum(-1), (high * m).sum(-1) / m.sum(-1)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._fgrpo_rewards_per_func = rewards
        return rewards

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.loss_type == "gift":
            per_func = self._fgrpo_rewards_per_func
            weights = self.reward_weights.to(per_func.device).unsqueeze(0)
            rewards = (per_func * weights).nansum(dim=1)
            n = output["completion_ids"].shape[0]
            start = self.accelerator.process_index * n
            output["fgrpo_rewards"] = rewards[start : start + n]
            output["fgrpo_group"] = torch.arange(start, start + n, device=rewards.device)
            output["fgrpo_group"] = output["fgrpo_group"] // self.num_generations
        return output


class FusedGRPOTrainer(FusedLossMixin, GRPOTrainer):
    """GRPOTrainer whose loss is computed by fgrpo_kernels' fused modules (a drop-in)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._fgrpo_setup()


def use_fused_loss(trainer: GRPOTrainer) -> GRPOTrainer:
    """Switch an existing GRPOTrainer (or subclass) to the fused loss, in place; returns it."""
    if not isinstance(trainer, FusedLossMixin):
        cls = type(trainer)
        trainer.__class__ = type(f"Fused{cls.__name__}", (FusedLossMixin, cls), {})
        trainer._fgrpo_setup()
    return trainer


__all__ = ["EXTRA_LOSS_TYPES", "FusedGRPOConfig", "FusedGRPOTrainer", "use_fused_loss"]
