"""TRL drop-in for the experimental GMPOTrainer (trl.experimental.gmpo): its loss from the last
hidden state and the lm_head weight, through `FusedLinearPolicyLoss("gmpo")`.

    from fgrpo_kernels.integrations.trl_gmpo import FusedGMPOTrainer
    trainer = FusedGMPOTrainer(model=..., reward_funcs=..., args=GMPOConfig(...), ...)

or `use_fused_gmpo_loss(trainer)` on a GMPOTrainer you already built. As with the GRPO drop-in
only `_compute_loss` changes, and TRL's options mean what they mean in TRL's GMPO loss:
`epsilon` / `epsilon_high` clip the per-token log-ratio, `beta` adds the sequence-averaged k3,
`top_entropy_quantile` drops low-entropy tokens from the geometric mean, the loss is the mean
over sequences divided by the accumulation steps. TRL's GMPO loss reads no vLLM IS ratio,
`delta`, `loss_type` or entropy bonus, and neither does this one. Metrics: TRL's names (kl,
entropy, clip_ratio/*).
"""

from __future__ import annotations

from trl.experimental.gmpo import GMPOTrainer

from ..losses.policy import FusedLinearPolicyLoss
from .trl import FusedLossMixin, use_fused_loss


class FusedGMPOMixin(FusedLossMixin):
    """Replaces GMPOTrainer._compute_loss by the fused GMPO loss."""

    def _fgrpo_build_loss(self):
        return FusedLinearPolicyLoss(
            "gmpo",
            epsilon=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            beta=self.beta,
            top_entropy_quantile=self.top_entropy_quantile,
            temperature=self._fgrpo_temperature,
            compute_entropy=True,
        )

    def _compute_loss(self, model, inputs):
        _, hidden, weight, bias, mask, mode, accum = self._fgrpo_hidden(model, inputs)
        loss, metrics = self._fgrpo_loss(
            hidden,
            weight,
            inputs["completion_ids"],
            mask,
            inputs["advantages"],
            bias,
            old_per_token_logps=inputs.get("old_per_token_logps"),
            ref_per_token_logps=inputs.get("ref_per_token_logps") if self.beta != 0.0 else None,
        )
        self._fgrpo_log(mode, metrics, mask)
        return loss / accum


class FusedGMPOTrainer(FusedGMPOMixin, GMPOTrainer):
    """GMPOTrainer whose loss is computed by the fused GMPO loss (a drop-in)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._fgrpo_setup()


def use_fused_gmpo_loss(trainer: GMPOTrainer) -> GMPOTrainer:
    """Switch an existing GMPOTrainer to the fused loss, in place; returns it."""
    if not isinstance(trainer, GMPOTrainer):
        raise TypeError(f"trainer: expected a GMPOTrainer; got {type(trainer).__name__}")
    return use_fused_loss(trainer, FusedGMPOMixin)


__all__ = ["FusedGMPOTrainer", "use_fused_gmpo_loss"]
