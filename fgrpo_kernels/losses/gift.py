"""GIFT on the fused head: mean_i (R̂_i − β·k̂_i)², k_i the summed log-ratio of row i."""

from __future__ import annotations

from ..backends import distributed
from ..core import validation as check
from ..core.options import GIFTOptions
from ..head.autograd import EpilogueFunction
from ..head.batch import Batch
from . import epilogue, metrics, single_pass
from .pipeline import FusedLoss, LossStep


class GIFTStep(LossStep):
    """GIFT on one batch: whole groups on every rank, so a data-parallel batch's loss is a
    mean over its rows."""

    def __init__(self, module, batch: Batch, rewards, ref):
        self.module, self.opts, self.mask, self.B = module, module.opts, batch.mask, batch.B
        self.rewards, self.ref = rewards.detach().float(), ref
        self.need_entropy = module.compute_entropy

    def chunked(self):
        return single_pass.gift(self.ref, self.mask, self.rewards, self.opts)

    def two_pass(self, logps, ent):
        return EpilogueFunction.apply(
            logps, epilogue.gift, self.ref, self.mask, self.rewards, self.opts
        )

    def metrics(self, loss, logps, ent):
        return metrics.gift(loss, logps, self.ref, self.mask, ent, self.opts)

    def finish(self, loss):
        dp = self.module.data_parallel()
        if dp is None:
            return loss
        return self.module.share(loss, self.B, distributed.global_sum([self.B], dp[0])[0], dp[1])


class FusedLinearGIFTLoss(FusedLoss):
    """GIFT on hidden states: mean_i (R̂_i − β·k̂_i)², k_i the summed log-ratio of row i.

    detach_stats=False differentiates through the group mean/std of k (the paper); True holds
    them constant (the released code). Pass old log-probs as `ref_per_token_logps` for the
    released code's π_old variant.
    """

    def __init__(
        self,
        num_generations,
        beta=1.0,
        eps=1e-4,
        detach_stats=False,
        temperature=1.0,
        unbiased=True,
        compute_entropy=False,
        fast_fp32=False,
        **head,
    ):
        super().__init__(temperature, compute_entropy, fast_fp32, **head)
        self.opts = GIFTOptions.parse(num_generations, beta, eps, unbiased, detach_stats)

    def forward(
        self,
        hidden,
        weight,
        completion_ids,
        completion_mask,
        rewards,
        ref_per_token_logps=None,
        *,
        bias=None,
        ref_hidden=None,
        ref_weight=None,
        ref_bias=None,
    ):
        batch = self.batch(hidden, weight, completion_ids, completion_mask, bias)
        check.per_row("rewards", rewards, batch.B)
        check.num_generations("num_generations", self.opts.num_generations, batch.B)
        ref = batch.required_reference(
            self.head, ref_per_token_logps, ref_hidden, ref_weight, ref_bias
        )
        return self.run(batch, GIFTStep(self, batch, rewards, ref))
