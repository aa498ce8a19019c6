"""Fused modules for off-policy preference data: FDO, and f-HAL = λ·FDO + (1 − λ)·f-GRPO.

Shapes: hidden [B, T, H], weight [V, H], completion_ids / completion_mask [B, T], chosen [B]
bool (both pools non-empty).
"""

from __future__ import annotations

import torch

from ..backends import distributed
from ..core import validation as check
from ..core.options import FDOOptions, FGRPOOptions, Level, Reduction, mixing_weight
from ..head.autograd import EpilogueFunction
from ..head.batch import Batch
from . import epilogue, metrics, single_pass
from .fgrpo import FusedLinearFGRPOLoss
from .pipeline import FusedLoss, LossStep


def _pools(module: FusedLoss, chosen, B: int):
    """Check `chosen` [B] bool with both pools non-empty — over the whole data-parallel batch
    with a process_group — and return the batch's (chosen, total) counts (None: this batch)."""
    dp = module.data_parallel()
    pools = None
    if dp is not None:
        check.tensor("chosen", chosen, shape=(B,), dtypes=(torch.bool,))
        pools = distributed.global_sum([float(chosen.sum()), B], dp[0])
    check.chosen("chosen", chosen, B, pools)
    return pools


class FDOStep(LossStep):
    """FDO on one batch. Data-parallel, it is sequence-level f-GRPO with advantages
    ±1/(pool size) over the whole batch's pools (Σ_chosen φ₊/n_chosen + Σ_rejected φ₊/n_rej)."""

    def __init__(self, module, batch: Batch, chosen, ref, pools):
        self.opts, self.mask, self.chosen, self.ref = module.opts, batch.mask, chosen, ref
        self.dp = module.data_parallel()
        if self.dp is not None:
            n_chosen, n = float(pools[0]), float(pools[1])
            self.adv = torch.where(chosen, 1.0 / n_chosen, -1.0 / (n - n_chosen)).float()
            self.seq = FGRPOOptions(
                self.opts.divergence, self.opts.beta, Level.SEQUENCE, Reduction.SUM
            )

    def chunked(self):
        if self.dp is None:
            return single_pass.fdo(self.ref, self.mask, self.chosen, self.opts)
        return single_pass.fgrpo(self.ref, self.mask, self.adv, None, None, None, self.seq)

    def two_pass(self, logps, ent):
        if self.dp is None:
            return EpilogueFunction.apply(
                logps, epilogue.fdo, self.ref, self.mask, self.chosen, self.opts
            )
        return EpilogueFunction.apply(
            logps, epilogue.fgrpo, None, self.ref, self.mask, self.adv, None, None, None, self.seq
        )

    def metrics(self, loss, logps, ent):
        # the metrics' loss is the one this rank returns (scaled when data-parallel)
        return metrics.fdo(
            self.finish(loss), logps, self.ref, self.mask, self.chosen, self.opts.beta
        )

    def finish(self, loss):
        return loss if self.dp is None else loss * self.dp[1]


class FusedLinearFDOLoss(FusedLoss):
    """FDO: mean_chosen φ₊(r) + mean_rejected φ₋(r), r_i = β Σ_t mask·log(π/π_ref)."""

    def __init__(
        self,
        divergence="pearson",
        beta=0.1,
        temperature=1.0,
        fast_fp32=False,
        **head,
    ):
        super().__init__(temperature, False, fast_fp32, **head)
        self.opts = FDOOptions.parse(divergence, beta)

    def forward(
        self,
        hidden,
        weight,
        completion_ids,
        completion_mask,
        chosen,
        ref_per_token_logps=None,
        *,
        bias=None,
        ref_hidden=None,
        ref_weight=None,
        ref_bias=None,
    ):
        batch = self.batch(hidden, weight, completion_ids, completion_mask, bias)
        pools = _pools(self, chosen, batch.B)
        ref = batch.required_reference(
            self.head, ref_per_token_logps, ref_hidden, ref_weight, ref_bias
        )
        return self.run(batch, FDOStep(self, batch, chosen, ref, pools))


class FusedLinearFHALLoss(FusedLinearFGRPOLoss):
    """f-HAL: lam·FDO(preference batch) + (1 − lam)·f-GRPO(on-policy batch), one divergence
    and β for both. The on-policy arguments are those of FusedLinearFGRPOLoss; the preference
    batch comes as pref_hidden, pref_completion_ids, pref_completion_mask, chosen."""

    def __init__(
        self,
        divergence="pearson",
        beta=0.1,
        lam=0.5,
        level="token",
        reduction=None,
        num_generations=None,
        temperature=1.0,
        **fgrpo_options,
    ):
        super().__init__(
            divergence, beta, level, reduction, num_generations, temperature, **fgrpo_options
        )
        self.lam = mixing_weight(lam)
        head = self.head.as_dict()
        head.pop("compute_entropy")
        self.fdo = FusedLinearFDOLoss(divergence, beta, **head)

    def forward(
        self,
        hidden,
        weight,
        completion_ids,
        completion_mask,
        pref_hidden,
        pref_completion_ids,
        pref_completion_mask,
        chosen,
        *,
        advantages=None,
        rewards=None,
        ref_per_token_logps=None,
        pref_ref_per_token_logps=None,
        old_per_token_logps=None,
        bias=None,
        ref_hidden=None,
        pref_ref_hidden=None,
        ref_weight=None,
        ref_bias=None,
    ):
        pref = self.batch(
            pref_hidden, weight, pref_completion_ids, pref_completion_mask, bias, "pref_"
        )
        _pools(self, chosen, pref.B)
        pref.optional_logps("pref_ref_per_token_logps", pref_ref_per_token_logps)
        on_policy, m_on = super().forward(
            hidden, weight, completion_ids, completion_mask, advantages=advantages,
            rewards=rewards, ref_per_token_logps=ref_per_token_logps, bias=bias,
            old_per_token_logps=old_per_token_logps, ref_hidden=ref_hidden,
            ref_weight=ref_weight, ref_bias=ref_bias,
        )  # fmt: skip
        pref_loss, m_pref = self.fdo(
            pref_hidden, weight, pref_completion_ids, pref_completion_mask, chosen,
            pref_ref_per_token_logps, bias=bias, ref_hidden=pref_ref_hidden,
            ref_weight=ref_weight, ref_bias=ref_bias,
        )  # fmt: skip
        loss = self.lam * pref_loss + (1.0 - self.lam) * on_policy
        out = {"loss": loss.detach()}
        out.update({f"fgrpo/{k}": v for k, v in m_on.items()})
        out.update({f"fdo/{k}": v for k, v in m_pref.items()})
        return loss, out
