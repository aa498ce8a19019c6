"""f-GRPO on the fused head: |a_i|·φ_{sign a_i}(β·log π/π_ref) per token or sequence."""

from __future__ import annotations

from ..backends import distributed
from ..core import reference
from ..core import validation as check
from ..core.options import FGRPOOptions, Level, Reduction
from ..head.autograd import EpilogueFunction
from ..head.batch import Batch
from . import epilogue, metrics, rollout, single_pass
from .pipeline import FusedLoss, LossStep


def _float(t):
    return None if t is None else t.detach().float()


class FGRPOStep(LossStep):
    """f-GRPO on one batch. With a process_group, `counts` = the whole batch's (B, Σ mask) and
    advantages from rewards are the whole batch's (groups may straddle ranks)."""

    def __init__(self, module, batch: Batch, advantages, rewards, ref, old, ratio, return_entropy):
        opts = self.opts = module.opts
        self.module, self.mask, self.B, self.ref = module, batch.mask, batch.B, ref
        self.dp, self.counts = module.data_parallel(), None
        if self.dp is not None:
            self.counts = distributed.global_sum([batch.B, float(batch.mask.sum())], self.dp[0])
            self._check_data_parallel()
        check.advantages_or_rewards(
            advantages,
            rewards,
            opts.num_generations,
            batch.B,
            need_rewards=opts.group_is_weights,
            groups_of=None if self.dp is None else int(self.counts[0]),
        )
        if self.dp is not None and advantages is None and not opts.group_is_weights:
            advantages, rewards = self._global_advantages(rewards), None
        self.adv, self.rewards = _float(advantages), _float(rewards)
        self.old = None if old is None else old.detach()
        self.ratio = None if ratio is None else ratio.detach()
        self.return_entropy = return_entropy
        self.need_entropy = module.compute_entropy or return_entropy or opts.entropy_coef != 0.0

    def _check_data_parallel(self):
        opts, G = self.opts, self.opts.num_generations
        if opts.group_is_weights and G and self.B % G:
            raise ValueError(
                f"process_group: group_is_weights needs whole groups on every rank; got {self.B} "
                f"completions here with num_generations={G}"
            )
        if opts.entropy_coef != 0.0 and opts.reduction != Reduction.TOKEN_MEAN:
            raise ValueError(
                "process_group: entropy_coef with a data-parallel batch needs "
                "reduction='token_mean' (one normaliser for the loss and the bonus)"
            )

    def _global_advantages(self, rewards):
        """This rank's advantages from the whole data-parallel batch's rewards (one O(B)
        all-gather): groups may straddle ranks, and σ over the batch is the batch's."""
        group, opts, b = self.dp[0], self.opts, rewards.shape[0]
        every = distributed.gather_rows(rewards.detach().float(), group)
        adv = reference.group_zscore(
            every, opts.num_generations, opts.eps, opts.unbiased, opts.scale
        )
        rank = distributed.dist.get_rank(group)
        return adv[rank * b : (rank + 1) * b]

    def chunked(self):
        if self.return_entropy:
            return single_pass.RETURNED_ENTROPY
        return single_pass.fgrpo(
            self.ref, self.mask, self.adv, self.rewards, self.old, self.ratio, self.opts
        )

    def two_pass(self, logps, ent):
        old = None
        if self.opts.group_is_weights:
            old = logps.detach() if self.old is None else self.old
        return EpilogueFunction.apply(
            logps,
            epilogue.fgrpo,
            ent,
            self.ref,
            self.mask,
            self.adv,
            self.rewards,
            old,
            self.ratio,
            self.opts,
        )

    def metrics(self, loss, logps, ent):
        return metrics.fgrpo(
            loss, logps, self.ref, self.mask, self.adv, self.rewards, ent, self.ratio, self.opts
        )

    def finish(self, loss):
        if self.dp is None:
            return loss
        world, reduction = self.dp[1], self.opts.reduction
        if reduction == Reduction.TOKEN_MEAN:
            return self.module.share(loss, self.mask.sum(), self.counts[1], world)
        if reduction == Reduction.SEQ_MEAN:
            return self.module.share(loss, self.B, self.counts[0], world)
        return loss * world


class FusedLinearFGRPOLoss(FusedLoss):
    """f-GRPO on hidden states: |a_i|·φ_{sign a_i}(β·log π/π_ref) per token or sequence.

    Pass exactly one of `advantages` [B] or `rewards` [B] (then `num_generations` is needed and
    the group normalisation is fused into the epilogue, with `scale_rewards`, `eps`,
    `unbiased`). Reference log-probs come as `ref_per_token_logps` [B, T] or are computed in the
    call from `ref_hidden` (and `ref_weight`, `ref_bias`; default: the policy's lm_head).
    `group_is_weights=True` applies the f-GRPO paper's group importance weights (needs rewards;
    old log-probs default to the current ones, detached). `vllm_is_ratio` (forward) ρ weights
    each unit's cost; `entropy_coef` c subtracts c·(masked mean entropy), with its gradient.
    `return_entropy=True` (forward) also returns the per-token entropy [B, T], differentiable.
    `rollout_correction`: as FusedLinearGRPOLoss's (forward: `old_per_token_logps` and
    `rollout_per_token_logps`); its IS weights are the ρ above, per sequence at sequence level.
    """

    def __init__(
        self,
        divergence="pearson",
        beta=0.1,
        level="token",
        reduction=None,
        num_generations=None,
        temperature=1.0,
        scale_rewards="group",
        eps=1e-4,
        unbiased=True,
        group_is_weights=False,
        compute_entropy=False,
        fast_fp32=False,
        *,
        entropy_coef=0.0,
        rollout_correction=None,
        **head,
    ):
        super().__init__(temperature, compute_entropy, fast_fp32, **head)
        self.rollout_correction = rollout.parse(rollout_correction)
        self.opts = FGRPOOptions.parse(
            divergence,
            beta,
            level,
            reduction,
            num_generations,
            scale_rewards,
            eps,
            unbiased,
            group_is_weights,
            entropy_coef=entropy_coef,
            scale_arg="scale_rewards",
        )

    def forward(
        self,
        hidden,
        weight,
        completion_ids,
        completion_mask,
        *,
        advantages=None,
        rewards=None,
        ref_per_token_logps=None,
        old_per_token_logps=None,
        bias=None,
        ref_hidden=None,
        ref_weight=None,
        ref_bias=None,
        vllm_is_ratio=None,
        return_entropy=False,
        rollout_per_token_logps=None,
    ):
        batch = self.batch(hidden, weight, completion_ids, completion_mask, bias)
        B, T, opts = batch.B, batch.T, self.opts
        check.is_ratio("vllm_is_ratio", vllm_is_ratio, B, T, per_token=opts.level == Level.TOKEN)
        if advantages is not None and rewards is not None and not opts.group_is_weights:
            raise ValueError("advantages: expected exactly one of advantages or rewards; got both")
        batch.optional_logps("old_per_token_logps", old_per_token_logps)
        batch, vllm_is_ratio, corrections = rollout.corrected(
            self.rollout_correction, batch, old_per_token_logps, rollout_per_token_logps,
            vllm_is_ratio, per_token=opts.level == Level.TOKEN,
        )  # fmt: skip
        ref = batch.required_reference(
            self.head, ref_per_token_logps, ref_hidden, ref_weight, ref_bias
        )
        step = FGRPOStep(
            self,
            batch,
            advantages,
            rewards,
            ref,
            old_per_token_logps,
            vllm_is_ratio,
            return_entropy,
        )
        return rollout.with_metrics(self.run(batch, step), corrections)
