"""TRL drop-in: GRPOTrainer's loss from the last hidden state and the lm_head weight.

    from fgrpo_kernels.integrations.trl import FusedGRPOConfig, FusedGRPOTrainer
    trainer = FusedGRPOTrainer(model=..., reward_funcs=..., args=FusedGRPOConfig(...), ...)

or, on a trainer you already built, `use_fused_loss(trainer)`. Only `_compute_loss` changes:
TRL still generates, scores, and computes the old, reference and sampling log-probs and the vLLM
importance-sampling ratio (for PEFT, with the adapter disabled). The loss runs the backbone,
takes the hidden states that predict the completion tokens (shifted by one, as TRL's fused head
does) and calls FusedLinearGRPOLoss with TRL's options and normalisers, so loss and gradients
equal TRL's own: every loss type, `delta`, the vLLM IS correction in every mode,
`use_bias_correction_kl`, `entropy_coef` (static or adaptive), `top_entropy_quantile`,
`off_policy_mask_threshold`, `mask_truncated_completions`, `num_items_in_batch`, the MoE
load-balancing loss and scaled logits (`logit_scale` and kin). There is no fallback to TRL's
loss: what is not fused (soft-capped logits, vision-language models, per-token advantages)
raises with the option's name. Two more `loss_type`s: "fgrpo" (FusedLinearFGRPOLoss, TRL's
advantages, `beta` as the f-GRPO β) and "gift" (FusedLinearGIFTLoss on the raw rewards, whole
groups per micro-batch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from trl import GRPOConfig, GRPOTrainer

from ..core.divergences import NAMES as DIVERGENCES
from ..core.options import LOSS_TYPE_SPECS, LOSS_TYPES, LossType, Normaliser, Objective, parse
from ..losses import FusedLinearFGRPOLoss, FusedLinearGIFTLoss, FusedLinearGRPOLoss
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


class _TRLGRPOLoss(FusedLinearGRPOLoss):
    """FusedLinearGRPOLoss whose entropy-mask threshold is TRL's: the quantile of the
    unmasked entropies gathered from every process (`gather(local) -> all`)."""

    def __init__(self, gather, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._gather = gather
        self.last_entropy_threshold = None

    def entropy_threshold(self, entropy, mask):
        local = entropy.detach()[mask.bool()].float()
        every = self._gather(local)
        quantile = self.opts.top_entropy_quantile
        inf = torch.full((), float("inf"), device=entropy.device)
        threshold = torch.quantile(every, 1.0 - quantile) if every.numel() else inf
        self.last_entropy_threshold = threshold
        return threshold


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
        known = LOSS_TYPES + EXTRA_LOSS_TYPES
        if self.loss_type not in known:
            raise ValueError(f"loss_type: expected one of {known}; got {self.loss_type!r}")
        lm = glue.causal_lm(self.accelerator.unwrap_model(self.model))
        self._fgrpo_temperature = self.temperature / glue.logit_scale(lm.config.get_text_config())
        self._fgrpo_unsupported()
        self._fgrpo_loss = self._fgrpo_build_loss()
        glue.install_hidden_forward(self.model)

    def _fgrpo_unsupported(self) -> None:
        """What the fused loss cannot compute raises here, named (no silent fallback)."""
        lm = glue.causal_lm(self.accelerator.unwrap_model(self.model))
        config = lm.config.get_text_config()
        checks = [
            (getattr(config, "final_logit_softcapping", None) is not None,
             "final_logit_softcapping", "soft-capped logits"),
            (getattr(self, "_is_vlm", False), "processing_class",
             "vision-language models (multimodal inputs)"),
            (hasattr(lm.get_output_embeddings(), "base_layer"), "peft_config",
             "an adapter on the lm_head"),
            (self.loss_type in EXTRA_LOSS_TYPES and self._fgrpo_trl_options(),
             "loss_type", f"loss_type={self.loss_type!r} with {self._fgrpo_trl_options()}"),
        ]  # fmt: skip
        for bad, arg, what in checks:
            if bad:
                raise NotImplementedError(f"{arg}: {what} is not supported by the fused loss")

    def _fgrpo_trl_options(self) -> list[str]:
        """The GRPO-family options set on this trainer that the extra loss type lacks ("fgrpo"
        takes the vLLM IS ratio and a static entropy bonus, "gift" none)."""
        on = {
            "delta": getattr(self.args, "delta", None) is not None,
            "off_policy_mask_threshold": self.off_policy_mask_threshold is not None,
            "top_entropy_quantile": self.top_entropy_quantile < 1.0,
            "use_adaptive_entropy": getattr(self, "use_adaptive_entropy", False),
        }
        if self.loss_type == "gift":
            on["entropy_coef"] = getattr(self, "_entropy_bonus_enabled", False)
            on["vllm_importance_sampling_correction"] = self._fgrpo_vllm_is()
        return [name for name, value in on.items() if value]

    def _fgrpo_vllm_is(self) -> bool:
        return bool(self.use_vllm and self.vllm_importance_sampling_correction)

    def _fgrpo_build_loss(self) -> torch.nn.Module:
        args, tau = self.args, self._fgrpo_temperature
        if self.loss_type == "fgrpo":
            return FusedLinearFGRPOLoss(
                args.fgrpo_divergence if hasattr(args, "fgrpo_divergence") else "pearson",
                self.beta, getattr(args, "fgrpo_level", "token"),
                getattr(args, "fgrpo_reduction", None), temperature=tau, compute_entropy=True,
                entropy_coef=self.entropy_coef if self._entropy_bonus_enabled else 0.0,
            )  # fmt: skip
        if self.loss_type == "gift":
            detach = getattr(args, "gift_detach_stats", False)
            return FusedLinearGIFTLoss(
                self.num_generations, self.beta, detach_stats=detach, temperature=tau,
                compute_entropy=True,
            )  # fmt: skip
        spec = LOSS_TYPE_SPECS[parse(LossType, "loss_type", self.loss_type)]
        params = {name: getattr(args, name, None) for name, _ in spec.params}
        delta = getattr(args, "delta", None) if spec.objective == Objective.CLIPPED else None
        bonus = getattr(self, "_entropy_bonus_enabled", False)

        def gather(local):
            padded = self.accelerator.pad_across_processes(local, dim=0, pad_index=-1e9)
            every = self.accelerator.gather(padded)
            return every[every != -1e9]

        return _TRLGRPOLoss(
            gather, self.loss_type, self.beta, self.epsilon_low, self.epsilon_high,
            self.importance_sampling_level, tau, self.max_completion_length,
            use_ref_model=self.beta != 0.0, compute_entropy=True, delta=delta,
            use_bias_correction_kl=getattr(args, "use_bias_correction_kl", False),
            entropy_coef=self.entropy_coef if bonus else 0.0,
            top_entropy_quantile=self.top_entropy_quantile,
            off_policy_mask_threshold=self.off_policy_mask_threshold, **params,
        )  # fmt: skip

    def _fgrpo_hidden(self, model, inputs, aux=False):
        """(backbone output, hidden [B, T, H] predicting the completion tokens, lm_head weight,
        bias, the loss mask, mode, TRL's accumulation divisor)."""
        if any(inputs.get(k) is not None for k in _MULTIMODAL):
            raise NotImplementedError("pixel_values: multimodal inputs are not supported")
        if inputs["advantages"].dim() != 1:
            raise NotImplementedError("advantages: per-token advantages are not supported")
        ids, cmask = inputs["completion_ids"], inputs["completion_mask"]
        mask = cmask if "tool_mask" not in inputs else cmask * inputs["tool_mask"]
        T = ids.size(1)
        with self.accelerator.autocast():
            out = model(
                input_ids=torch.cat([inputs["prompt_ids"], ids], 1),
                attention_mask=torch.cat([inputs["prompt_mask"], cmask], 1),
                fgrpo_last_hidden=True,
                **({"output_router_logits": True} if aux else {}),
            )
        head = glue.causal_lm(self.accelerator.unwrap_model(model)).get_output_embeddings()
        weight, bias = head.weight, head.bias
        hidden = out.last_hidden_state[:, -T - 1 : -1].to(weight.device)
        if hidden.dtype != weight.dtype:  # e.g. cast_lm_head_to_fp32
            hidden = hidden.to(weight.dtype)
        mode = "train" if self.model.training else "eval"
        accum = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        return out, hidden, weight, bias, mask, mode, accum

    def _compute_loss(self, model, inputs):
        if self.loss_type == "gift" and inputs["advantages"].dim() == 1:
            inputs = glue.groups_contiguous(inputs, self.num_generations)
        aux = getattr(self, "aux_loss_enabled", False)
        out, hidden, weight, bias, mask, mode, accum = self._fgrpo_hidden(model, inputs, aux)
        ids, cmask = inputs["completion_ids"], inputs["completion_mask"]
        ref, adv = inputs.get("ref_per_token_logps"), inputs["advantages"]
        if self.loss_type == "fgrpo":
            ratio = inputs.get("importance_sampling_ratio") if self._fgrpo_vllm_is() else None
            loss, metrics = self._fgrpo_loss(
                hidden, weight, ids, mask, advantages=adv, ref_per_token_logps=ref, bias=bias,
                vllm_is_ratio=ratio,
            )  # fmt: skip
            loss = loss / accum
        elif self.loss_type == "gift":
            rewards = inputs["fgrpo_rewards"]
            loss, metrics = self._fgrpo_loss(hidden, weight, ids, mask, rewards, ref, bias=bias)
            loss = loss / accum
        else:
            loss, metrics = self._fgrpo_grpo_loss(mode, accum, inputs, hidden, weight, bias, mask)
        if aux:
            aux_loss = glue.router_aux_loss(self.model, out, inputs, cmask)
            loss = loss + self.router_aux_loss_coef * aux_loss / accum
            self._metrics[mode]["aux_loss"].append(
                self.accelerator.gather_for_metrics(aux_loss.detach()).mean().item()
            )
        self._fgrpo_log(mode, metrics, mask)
        return loss

    def _fgrpo_grpo_loss(self, mode, accum, inputs, hidden, weight, bias, mask):
        """The GRPO family with TRL's normalisers: the module's loss is Σ n_i·pt − c·H̄; TRL's is
        that with the dapo-family normaliser num_items / processes · accum / steps_per_generation,
        the others and the bonus divided by accum."""
        loss_fn = self._fgrpo_loss
        items = None
        if loss_fn.opts.spec.normaliser == Normaliser.ITEMS:
            items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                items = items / self.args.steps_per_generation
        ratio = inputs.get("importance_sampling_ratio") if self._fgrpo_vllm_is() else None
        coef = self._fgrpo_entropy_coef()
        if coef != loss_fn.opts.entropy_coef:
            loss_fn.opts = dataclasses.replace(loss_fn.opts, entropy_coef=coef)
        loss, metrics, entropy = loss_fn(
            hidden, weight, inputs["completion_ids"], mask, inputs["advantages"], bias,
            ref_per_token_logps=inputs.get("ref_per_token_logps"),
            old_per_token_logps=inputs.get("old_per_token_logps"),
            sampling_per_token_logps=inputs.get("sampling_per_token_logps"),
            vllm_is_ratio=ratio,
            num_items_in_batch=items, return_entropy=True,
        )  # fmt: skip
        if getattr(self, "_entropy_bonus_enabled", False):
            policy = metrics.get("policy_loss", loss.detach())
            if items is not None:
                policy = policy / accum
            self._metrics[mode]["policy_loss"].append(
                self.accelerator.gather(policy).nanmean().item()
            )
            self._fgrpo_adapt_entropy(mode, entropy.detach(), mask)
        return loss / accum, metrics

    def _fgrpo_entropy_coef(self) -> float:
        """TRL's entropy coefficient for this micro-batch: the static one, or under adaptive
        control the current one while the last step's entropy is at or below the target."""
        if not getattr(self, "_entropy_bonus_enabled", False):
            return 0.0
        if getattr(self, "use_adaptive_entropy", False):
            low = self._last_world_entropy <= self.args.entropy_target
            return self.entropy_coef if low else 0.0
        return self.entropy_coef

    def _fgrpo_adapt_entropy(self, mode, entropy, mask) -> None:
        """TRL's adaptive entropy controller (Skywork-OR1): accumulate the window's entropy over
        the bonus tokens; at each optimizer step move the coefficient by entropy_coef_delta
        towards keeping the entropy above entropy_target, within [min, max]."""
        if mode == "train" and getattr(self, "use_adaptive_entropy", False):
            weights = mask.float()
            if self.top_entropy_quantile < 1.0:
                keep = entropy * weights >= self._fgrpo_loss.last_entropy_threshold
                weights = weights * keep.float()
            stats = torch.stack([(entropy * weights).sum(), weights.sum()])
            window = self._entropy_window_stats
            self._entropy_window_stats = stats if window is None else window + stats
            if self.accelerator.sync_gradients:
                total = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world = (total[0] / total[1].clamp(min=1.0)).item()
                a = self.args
                if world <= a.entropy_target:
                    self.entropy_coef = min(
                        self.entropy_coef + a.entropy_coef_delta, a.entropy_coef_max
                    )
                else:
                    self.entropy_coef = max(
                        self.entropy_coef - a.entropy_coef_delta, a.entropy_coef_min
                    )
                self._last_world_entropy = world
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)

    def _fgrpo_log(self, mode, metrics, mask):
        """TRL's metric names, each reduced over processes as TRL does."""
        tokens = mask.sum().float()
        rows = torch.tensor(float(mask.shape[0]), device=tokens.device)
        sequence = self.importance_sampling_level == "sequence"

        def log(name, count, key=None):
            if name in metrics:
                totals = torch.stack([metrics[name] * count, count])
                totals = self.accelerator.reduce(totals, reduction="sum")
                value = (totals[0] / totals[1].clamp(min=1.0)).item()
                self._metrics[mode][key or name].append(value)

        log("kl", tokens)
        log("entropy", tokens)
        if self.loss_type in EXTRA_LOSS_TYPES:
            for name in metrics:
                if name.startswith("implicit_reward"):
                    log(name, rows, key=f"{self.loss_type}/{name}")
            return
        for side in ("low", "high", "region"):
            log(f"clip_ratio/{side}_mean", rows if sequence else tokens)
        log("cispo_clip_ratio", tokens)
        log("vespo/phi_seq_mean", rows)
        for name, extreme in (
            ("clip_ratio/low_min", torch.min),
            ("clip_ratio/high_max", torch.max),
        ):
            if name in metrics:
                every = self.accelerator.gather(metrics[name].reshape(1))
                every = every[~every.isnan()]
                value = extreme(every).item() if every.numel() else float("nan")
                self._metrics[mode][name].append(value)

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


def use_fused_loss(trainer: GRPOTrainer, mixin: type = FusedLossMixin) -> GRPOTrainer:
    """Switch an existing GRPOTrainer (or subclass) to the fused loss of `mixin`, in place;
    returns it."""
    if not isinstance(trainer, mixin):
        cls = type(trainer)
        trainer.__class__ = type(f"Fused{cls.__name__}", (mixin, cls), {})
        trainer._fgrpo_setup()
    return trainer


__all__ = ["EXTRA_LOSS_TYPES", "FusedGRPOConfig", "FusedGRPOTrainer", "use_fused_loss"]
