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
from . import epilogue, metrics, single_pass
from .modules import FusedLinearFGRPOLoss, _FusedLinearLoss


def _pools(module: _FusedLinearLoss, chosen, B: int):
    """Check `chosen` [B] bool with both pools non-empty — over the whole data-parallel batch
    with a process_group — and return the batch's (chosen, total) counts (None: this batch)."""
    dp = module._data_parallel()
    pools = None
    if dp is not None:
        check.tensor("chosen", chosen, shape=(B,), dtypes=(torch.bool,))
        pools = distributed.global_sum([float(chosen.sum()), B], dp[0])
    check.chosen("chosen", chosen, B, pools)
    return pools


class FusedLinearFDOLoss(_FusedLinearLoss):
    """FDO: mean_chosen φ₊(r) + mean_rejected φ₋(r), r_i = β Σ_t mask·log(π/π_ref)."""

    def __init__(
        self, divergence="pearson", beta=0.1, temperature=1.0, fast_fp32=False, *,
        vocab_parallel=None, process_group=None, max_chunk_bytes=None,
    ):  # fmt: skip
        super().__init__(
            temperature, False, fast_fp32, vocab_parallel, process_group, max_chunk_bytes
        )
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
        B, T, weight, bias = self._batch(hidden, weight, completion_ids, completion_mask, bias)
        dp, pools = self._data_parallel(), _pools(self, chosen, B)
        ref = self._given_or_computed(
            "ref_per_token_logps",
            ref_per_token_logps,
            ref_hidden,
            weight if ref_weight is None else ref_weight,
            ref_bias,
            completion_ids,
            completion_mask,
            B,
            T,
        )
        if ref is None:
            raise ValueError(
                "ref_per_token_logps: expected [B, T] reference log-probs (or ref_hidden); got None"
            )
        args = (hidden, weight, completion_ids, completion_mask, bias)
        if dp is None:
            out = self._single_pass(
                *args, lambda: single_pass.fdo(ref, completion_mask, chosen, self.opts)
            )
            if out is None:
                logps, _ = self._logps(*args)
                loss = EpilogueFunction.apply(
                    logps, epilogue.fdo, ref, completion_mask, chosen, self.opts
                )
            else:
                loss, logps, _ = out
        else:  # Σ_chosen φ₊/n_chosen + Σ_rejected φ₋/n_rejected over the whole batch's pools
            n_chosen, n = float(pools[0]), float(pools[1])
            adv = torch.where(chosen, 1.0 / n_chosen, -1.0 / (n - n_chosen)).float()
            seq = FGRPOOptions(self.opts.divergence, self.opts.beta, Level.SEQUENCE, Reduction.SUM)
            out = self._single_pass(
                *args,
                lambda: single_pass.fgrpo(ref, completion_mask, adv, None, None, None, seq),
            )
            if out is None:
                logps, _ = self._logps(*args)
                loss = EpilogueFunction.apply(
                    logps, epilogue.fgrpo, None, ref, completion_mask, adv, None, None, None, seq
                )
            else:
                loss, logps, _ = out
            loss = loss * dp[1]
        return loss, metrics.fdo(loss, logps, ref, completion_mask, chosen, self.opts.beta)


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
        self.fdo = FusedLinearFDOLoss(
            divergence, beta, temperature, self.fast_fp32, vocab_parallel=self.vocab_parallel,
            process_group=self.process_group, max_chunk_bytes=self.max_chunk_bytes,
        )  # fmt: skip

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
        self._batch(pref_hidden, weight, pref_completion_ids, pref_completion_mask, bias, "pref_")
        _pools(self, chosen, pref_hidden.shape[0])
        check.optional_per_token(
            "pref_ref_per_token_logps", pref_ref_per_token_logps, *pref_hidden.shape[:2]
        )
        on_policy, m_on = super().forward(
            hidden,
            weight,
            completion_ids,
            completion_mask,
            advantages=advantages,
            rewards=rewards,
            ref_per_token_logps=ref_per_token_logps,
            old_per_token_logps=old_per_token_logps,
            bias=bias,
            ref_hidden=ref_hidden,
            ref_weight=ref_weight,
            ref_bias=ref_bias,
        )
        pref, m_pref = self.fdo(
            pref_hidden,
            weight,
            pref_completion_ids,
            pref_completion_mask,
            chosen,
            pref_ref_per_token_logps,
            bias=bias,
            ref_hidden=pref_ref_hidden,
            ref_weight=ref_weight,
            ref_bias=ref_bias,
        )
        loss = self.lam * pref + (1.0 - self.lam) * on_policy
        out = {"loss": loss.detach()}
        out.update({f"fgrpo/{k}": v for k, v in m_on.items()})
        out.update({f"fdo/{k}": v for k, v in m_pref.items()})
        return loss, out
