"""The GRPO family (TRL's GRPOTrainer / Liger's LigerFusedLinearGRPOLoss) on the fused head."""

from __future__ import annotations

import operator

import torch

from ..backends import distributed
from ..core import grpo_math
from ..core import validation as check
from ..core.kl_estimators import with_parsed_penalty
from ..core.options import GRPOOptions
from ..head.autograd import EpilogueFunction
from ..head.batch import Batch
from ..head.options import split
from . import epilogue, metrics, rollout, single_pass
from .pipeline import FusedLoss, LossStep

# (old, ref, mask, advantages, ratio, sampling, norms, opts) of a `GRPOStep`
_INPUTS = operator.attrgetter("old", "ref", "mask", "adv", "ratio", "sampling", "norms", "opts")


def _detached(t):
    return None if t is None else t.detach()


class GRPOStep(LossStep):
    """The GRPO family on one batch: the detached side inputs and the batch's normalisers
    (`grpo_math.Normalisers`; with the entropy mask they wait for the entropies)."""

    def __init__(
        self,
        module,
        batch: Batch,
        advantages,
        ref,
        old,
        sampling,
        ratio,
        num_items_in_batch,
        return_entropy,
    ):
        opts = self.opts = module.opts
        self.module, self.mask, self.B = module, batch.mask, batch.B
        self.adv = advantages.detach().float()
        self.ref, self.old, self.sampling = ref, _detached(old), _detached(sampling)
        self.ratio, self.num_items = _detached(ratio), num_items_in_batch
        self.return_entropy = return_entropy
        self.need_entropy = module.compute_entropy or return_entropy or opts.needs_entropy
        self.dp = module.data_parallel()
        # Without the entropy mask the normalisers need no entropy: one set (and, data-parallel,
        # one collective) whichever path runs on this rank.
        self.norms = None if opts.entropy_mask else self.normalisers(None, None)

    def normalisers(self, detached, threshold) -> grpo_math.Normalisers:
        opts, mask, counts = self.opts, self.mask, {}
        if self.dp is not None:  # the whole data-parallel batch's B, Σ mask and bonus tokens
            bonus = 0.0
            if opts.entropy_coef != 0.0:
                bonus = grpo_math.bonus_mask(mask, opts, detached, threshold).sum()
            total = distributed.global_sum([self.B, float(mask.sum()), float(bonus)], self.dp[0])
            counts = {"batch": int(total[0]), "tokens": float(total[1])}
            if opts.entropy_coef != 0.0:
                counts["bonus_count"] = float(total[2])
        return grpo_math.normalisers(mask, opts, self.num_items, detached, threshold, **counts)

    def chunked(self):
        if self.return_entropy:
            return single_pass.RETURNED_ENTROPY
        if self.opts.entropy_mask:
            return single_pass.ENTROPY_MASK
        return single_pass.grpo(*self.inputs())

    def inputs(self) -> tuple:
        """The epilogue's and the single pass's arguments after the log-probs (and entropy)."""
        return _INPUTS(self)

    def two_pass(self, logps, ent):
        if self.opts.entropy_mask:  # its threshold is a quantile of the batch's entropies
            threshold = self.module.entropy_threshold(ent, self.mask)
            self.norms = self.normalisers(ent.detach(), threshold)
        return EpilogueFunction.apply(logps, epilogue.grpo, ent, *self.inputs())

    def metrics(self, loss, logps, ent):
        return metrics.grpo(
            loss,
            logps,
            ent,
            self.old,
            self.ref,
            self.mask,
            self.adv,
            self.ratio,
            self.norms,
            self.opts,
        )

    def finish(self, loss):
        return loss if self.dp is None else loss * self.dp[1]


class FusedLinearGRPOLoss(FusedLoss):
    """TRL's GRPOTrainer loss / Liger's LigerFusedLinearGRPOLoss on hidden states (drop-in).

    loss_type "grpo" | "bnpo" | "dr_grpo" | "dapo" | "luspo" | "cispo" | "sapo" | "vespo";
    importance_sampling_level "token" | "sequence" (GSPO; not for cispo, sapo, vespo). old
    log-probs default to the current ones, detached. With beta != 0 the reference log-probs are
    required (`ref_per_token_logps`, or `ref_input`/`ref_hidden`) unless `use_ref_model=False`.
    Keyword `options` (TRL's names, docs/math.md "The GRPO family"): `delta` (two-sided clip),
    `clip_ratio_c` (dual clip), `use_bias_correction_kl`, `entropy_coef` (entropy bonus, with
    its gradient), `top_entropy_quantile` (policy term on high-entropy tokens only),
    `off_policy_mask_threshold` (with `sampling_per_token_logps`, default the old log-probs),
    and `sapo_temperature_pos/neg`, `vespo_k_pos/neg`, `vespo_lambda_pos/neg` (None: TRL's
    defaults); unknown names are a TypeError. Forward takes the rollout engine's IS ratio
    `vllm_is_ratio` [B, T], [B, 1] or [B]; `return_entropy=True` returns (loss, metrics,
    entropy [B, T]) with the entropy differentiable. `rollout_correction` (a
    `RolloutCorrection` or a dict of verl's, OpenRLHF's or TRL's names; docs/math.md "Rollout
    correction") takes the IS weights and rejection masks from the old and the sampler's
    log-probs (forward: `old_per_token_logps`, `rollout_per_token_logps`): the weights multiply
    the policy term as `vllm_is_ratio` does, the rejected tokens leave the mask. `compiled`
    and `chunk_size` are accepted for Liger compatibility and have no effect here.
    """

    def __init__(
        self,
        loss_type="dapo",
        beta=0.04,
        epsilon_low=0.2,
        epsilon_high=0.2,
        importance_sampling_level="token",
        temperature=1.0,
        max_completion_length=None,
        use_ref_model=True,
        compute_entropy=False,
        fast_fp32=False,
        compiled=True,
        chunk_size=1,
        *,
        rollout_correction=None,
        **options,
    ):
        head, options = split(options)  # the other HeadOptions (vocab_parallel, ...) by keyword
        super().__init__(temperature, compute_entropy, fast_fp32, **head)
        self.use_ref_model = bool(use_ref_model)
        self.rollout_correction = rollout.parse(rollout_correction)
        self.opts = GRPOOptions.parse(
            loss_type=loss_type,
            beta=beta,
            epsilon_low=epsilon_low,
            epsilon_high=epsilon_high,
            importance_sampling_level=importance_sampling_level,
            max_completion_length=max_completion_length,
            **with_parsed_penalty(options),
        )

    def entropy_threshold(self, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The entropy mask's threshold: the (1 − top_entropy_quantile) quantile of the batch's
        unmasked entropies (every rank's with a process_group, as TRL gathers them). Override to
        take it over more than that."""
        dp = self.data_parallel()
        if dp is None:
            return grpo_math.entropy_threshold(entropy, mask, self.opts.top_entropy_quantile)
        values = distributed.gather_values(entropy.detach()[mask.bool()].float(), dp[0])
        every = torch.ones_like(values, dtype=torch.bool)
        return grpo_math.entropy_threshold(values, every, self.opts.top_entropy_quantile)

    def forward(
        self,
        hidden,
        weight,
        completion_ids,
        completion_mask,
        advantages,
        bias=None,
        *,
        ref_per_token_logps=None,
        old_per_token_logps=None,
        ref_input=None,
        ref_hidden=None,
        ref_weight=None,
        ref_bias=None,
        vllm_is_ratio=None,
        num_items_in_batch=None,
        sampling_per_token_logps=None,
        return_entropy=False,
        rollout_per_token_logps=None,
    ):
        batch = self.batch(hidden, weight, completion_ids, completion_mask, bias)
        B, T = batch.B, batch.T
        check.per_row("advantages", advantages, B)
        batch.optional_logps("old_per_token_logps", old_per_token_logps)
        check.optional_per_token("sampling_per_token_logps", sampling_per_token_logps, B, T)
        check.is_ratio("vllm_is_ratio", vllm_is_ratio, B, T)
        check.num_items_in_batch(num_items_in_batch)
        batch, vllm_is_ratio, corrections = rollout.corrected(
            self.rollout_correction, batch, old_per_token_logps, rollout_per_token_logps,
            vllm_is_ratio,
        )  # fmt: skip
        ref = None
        if self.opts.beta != 0.0 and self.use_ref_model:
            ref = batch.required_reference(
                self.head,
                ref_per_token_logps,
                ref_hidden if ref_hidden is not None else ref_input,
                ref_weight,
                ref_bias,
                why=" when beta != 0",
            )
        step = GRPOStep(
            self,
            batch,
            advantages,
            ref,
            old_per_token_logps,
            sampling_per_token_logps,
            vllm_is_ratio,
            num_items_in_batch,
            return_entropy,
        )
        return rollout.with_metrics(self.run(batch, step), corrections)
