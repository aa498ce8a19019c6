"""The rollout correction on the fused GRPO and f-GRPO modules (`rollout_correction=`).

Outside verl's bypass mode the correction needs no current log-prob: log ρ = old − rollout
(`core.rollout_correction`). So it runs before the fused head: rejected tokens leave the
batch's mask, and the IS weights become the module's rollout IS ratio (`vllm_is_ratio`), which
multiplies each token's policy term (each unit's cost for f-GRPO), as verl multiplies its
`pg_losses` by `rollout_is_weights`.
"""

from __future__ import annotations

import dataclasses

from ..core import validation as check
from ..core.options import Level
from ..core.rollout_correction import RolloutCorrection, rollout_correction
from ..head.batch import Batch


def options_of(options) -> RolloutCorrection | None:
    """None, a RolloutCorrection, or a dict of verl's, OpenRLHF's or TRL's names, parsed."""
    if options is None or isinstance(options, RolloutCorrection):
        return options
    if not isinstance(options, dict):
        raise TypeError(
            f"rollout_correction: expected a RolloutCorrection, a dict or None; got {options!r}"
        )
    return RolloutCorrection.parse(**options)


def parse(options) -> RolloutCorrection | None:
    """`options_of`, refusing verl's bypass mode (these modules correct before the head)."""
    opts = options_of(options)
    if opts is not None and opts.bypass:
        raise ValueError(
            "rollout_correction: bypass mode (log ρ = logp − rollout) needs the current "
            "log-probs before the loss; use FusedLinearPolicyLoss for it"
        )
    return opts


def corrected(opts: RolloutCorrection | None, batch: Batch, old, rollout, ratio, per_token=True):
    """(the batch with rejected tokens masked out, the IS ratio, the correction's metrics).
    `per_token=False` (sequence-level f-GRPO): the ratio is one weight per sequence [B]."""
    if opts is None:
        if rollout is not None:
            raise ValueError("rollout_per_token_logps: given without rollout_correction")
        return batch, ratio, {}
    B, T = batch.B, batch.T
    if old is None:
        raise ValueError(
            "old_per_token_logps: rollout_correction needs the old log-probs (log ρ = old − "
            "rollout); got None"
        )
    if ratio is not None:
        raise ValueError("vllm_is_ratio: pass vllm_is_ratio or rollout_correction, not both")
    check.tensor("rollout_per_token_logps", rollout, shape=(B, T), floating=True)
    batch.per_token_logps("rollout_per_token_logps", rollout)  # finite where the mask is set
    old = old.detach()
    weights, mask, metrics = rollout_correction(old, old, rollout.detach(), batch.mask, opts)
    ratio = weights if opts.applies_weights else None
    if ratio is not None and not per_token:
        if opts.level != Level.SEQUENCE:
            raise ValueError(
                "rollout_correction: sequence-level f-GRPO weighs whole sequences; expected "
                "sequence-level IS weights (rollout_is='sequence')"
            )
        ratio = (weights * mask).amax(-1)  # one weight per sequence; 0 for a rejected one
    return dataclasses.replace(batch, mask=mask), ratio, metrics


def with_metrics(out: tuple, extra: dict) -> tuple:
    """A module's (loss, metrics[, entropy]) with the correction's metrics added."""
    return (out[0], {**out[1], **extra}, *out[2:]) if extra else out
