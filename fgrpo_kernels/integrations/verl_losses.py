"""Our losses in verl 0.9.1's policy-loss registry (`core_algos.register_policy_loss`).

`register_losses()` (called when `fgrpo_kernels.integrations.verl_enable` is imported, i.e. by
every verl worker given `actor_rollout_ref.model.external_lib=...verl_enable`) adds:

- `fgrpo_<div>` and `fgrpo_<div>_seq` for the six divergences (kl, reverse_kl, pearson,
  hellinger, js, tv): f-GRPO at token and sequence level. The implicit reward is
  r = β·log(π/π_old) with verl's `old_log_prob` as the reference policy, β is verl's
  `actor.policy_loss.ppo_kl_coef` (default 0.1, f-GRPO's default β), and the advantage (verl's
  `grpo` estimator: the group z-score over `uid`, one value per sequence) picks φ₊ or φ₋ by its
  sign and weights the unit by |a|. `rollout_is_weights` multiply each unit's cost.
- `fgrpo_gift`, `fgrpo_fdo`, `fgrpo_fhal`: registered so that choosing them fails with a named
  error. verl's policy-loss call carries per-token log-probs, advantages and the mask of one
  micro-batch, no `uid`, rewards or preference pairs, and a group may be split across
  micro-batches, so GIFT's group normalisation, FDO's chosen/rejected pools and f-HAL's pairs
  cannot be formed there. Use `fgrpo train` or the TRL drop-in for them.

`register_losses()` also adds the advantage estimator `fgrpo` (`algorithm.adv_estimator=fgrpo`):
our `group_normalize` over the groups verl names by `uid`, a_i = (R_i − μ_g)/(σ_g + 1e-4) with
the unbiased σ (verl's `grpo` divides by σ_g + 1e-6 and gives a group of one its raw reward; we
give it 0, as `group_normalize` does). `algorithm.norm_adv_by_std_in_grpo=False` gives
R_i − μ_g. A batch without `uid` is refused with a named error.

Token level honours every `loss_agg_mode` of verl's `agg_loss` (token-mean, token-sum,
seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm) through `agg_loss` itself.
Sequence level has one cost per sequence: `seq-mean-token-mean` and `seq-mean-token-sum` both
give the mean over the non-empty sequences; the token modes are refused. Metrics:
`actor/ppo_kl` (as verl's vanilla loss) and `actor/fgrpo_reward` (the mean implicit reward).
"""

from __future__ import annotations

import functools

import torch

from ..core.divergences import NAMES, phi
from ..core.grpo_math import masked_mean
from ..core.policy_variants_verl_pg import uid_groups
from ..core.reference import compute_dtype

PREFIX = "fgrpo_"
TOKEN_MODES = {f"{PREFIX}{name}": name for name in NAMES}
SEQUENCE_MODES = {f"{PREFIX}{name}_seq": name for name in NAMES}
SEQUENCE_AGG_MODES = ("seq-mean-token-mean", "seq-mean-token-sum")
ADV_ESTIMATOR = "fgrpo"
ADV_EPS = 1e-4
REFUSED = {
    f"{PREFIX}gift": "GIFT normalises the implicit rewards and the rewards over each group",
    f"{PREFIX}fdo": "FDO needs which completions are chosen and rejected",
    f"{PREFIX}fhal": "f-HAL needs the preference pairs beside the rollouts",
}


def register_losses() -> None:
    """Register every mode above in verl's `POLICY_LOSS_REGISTRY` (idempotent; imports verl)."""
    from verl.trainer.ppo import core_algos

    for mode, divergence in TOKEN_MODES.items():
        _register(core_algos, mode, functools.partial(fgrpo_policy_loss, divergence, "token"))
    for mode, divergence in SEQUENCE_MODES.items():
        fn = functools.partial(fgrpo_policy_loss, divergence, "sequence")
        _register(core_algos, mode, fn)
    for mode, why in REFUSED.items():
        _register(core_algos, mode, functools.partial(_refuse, mode, why))
    if ADV_ESTIMATOR not in core_algos.ADV_ESTIMATOR_REGISTRY:
        core_algos.register_adv_est(ADV_ESTIMATOR)(fgrpo_advantage)


def _register(core_algos, mode: str, fn) -> None:
    if mode in core_algos.POLICY_LOSS_REGISTRY:
        return

    @functools.wraps(fn.func)
    def loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
             config=None, rollout_is_weights=None):  # fmt: skip
        return fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                  rollout_is_weights)  # fmt: skip

    core_algos.register_policy_loss(mode)(loss)


def _refuse(mode, why, *args, **kwargs):
    raise ValueError(
        f"loss_mode: {mode!r} cannot run as a verl policy loss: {why}, and verl's policy-loss "
        "call gives one micro-batch's log-probs, advantages and mask only (no uid, rewards or "
        "pairs). Use fgrpo_kernels' trainer (`fgrpo train`) or the TRL drop-in for it; the "
        f"f-GRPO modes ({', '.join(TOKEN_MODES)} and their _seq forms) run in verl."
    )


def fgrpo_policy_loss(
    divergence, level, old_log_prob, log_prob, advantages, response_mask,
    loss_agg_mode="token-mean", config=None, rollout_is_weights=None,
):  # fmt: skip
    """f-GRPO on verl's [B, T] inputs: (loss, metrics). See the module docstring."""
    from verl.trainer.ppo.core_algos import agg_loss

    if config is None:
        raise ValueError(
            "config: expected verl's actor config (it carries policy_loss.ppo_kl_coef)"
        )
    beta = float(config.policy_loss.ppo_kl_coef)
    if not beta > 0:
        raise ValueError(f"policy_loss.ppo_kl_coef: expected β > 0 for f-GRPO; got {beta!r}")
    batch_info = dict(config.global_batch_info or {})
    mask = response_mask.to(log_prob.dtype)
    diff = torch.where(response_mask.bool(), log_prob - old_log_prob.to(log_prob.dtype), 0.0)
    metrics = {"actor/ppo_kl": _mean(-diff, mask)}
    if level == "token":
        a = advantages.to(log_prob.dtype)
        r = beta * diff
        cost = _cost(a, r, divergence)
        if rollout_is_weights is not None:
            cost = cost * rollout_is_weights.to(cost.dtype)
        loss = agg_loss(loss_mat=cost, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                        **batch_info)  # fmt: skip
        metrics["actor/fgrpo_reward"] = _mean(r, mask)
        return loss, metrics
    if loss_agg_mode not in SEQUENCE_AGG_MODES:
        raise ValueError(
            f"loss_agg_mode: sequence-level f-GRPO has one cost per sequence; expected one of "
            f"{', '.join(SEQUENCE_AGG_MODES)}; got {loss_agg_mode!r}"
        )
    lengths = mask.sum(-1)
    length = lengths.clamp(min=1.0)  # L_i, 1 for an empty row
    r = beta * diff.sum(-1)
    a = (advantages.to(log_prob.dtype) * mask).sum(-1) / length
    cost = _cost(a, r, divergence)
    if rollout_is_weights is not None:
        w = rollout_is_weights.to(cost.dtype)
        cost = cost * (w * mask).sum(-1) / length
    # one cost per sequence, spread as cost/L_i over its tokens so that verl's seq-mean of
    # token sums gives the mean over the non-empty sequences exactly (its global_batch_size
    # under data parallelism); seq-mean-token-mean would divide by L_i + 1e-8 instead
    loss_mat = (cost / length)[:, None].expand_as(mask)
    loss = agg_loss(loss_mat=loss_mat, loss_mask=response_mask,
                    loss_agg_mode="seq-mean-token-sum", **batch_info)  # fmt: skip
    metrics["actor/fgrpo_reward"] = _mean(r, lengths > 0)
    return loss, metrics


def fgrpo_advantage(
    token_level_rewards, response_mask, index=None, config=None, **_ignored
):  # fmt: skip
    """verl advantage estimator `fgrpo`: (advantages, returns), both [B, T] (the sequence's
    group z-score on each of its response tokens). Groups are the distinct values of `index`
    (verl's `uid`), in any order and of any size."""
    if index is None:
        raise ValueError(
            "uid: the fgrpo advantage estimator normalises per group and verl gives the group "
            "as non_tensor_batch['uid']; this batch has none"
        )
    if len(index) != token_level_rewards.shape[0]:
        raise ValueError(
            f"uid: expected one per sequence ({token_level_rewards.shape[0]}); got {len(index)}"
        )
    x = token_level_rewards.sum(-1)
    x = x.to(compute_dtype(x))
    if not torch.isfinite(x).all():
        raise ValueError("token_level_rewards: expected finite rewards")
    group, count = uid_groups(index, x)
    mean = torch.zeros_like(count).index_add_(0, group, x) / count
    centered = x - mean[group]
    by_std = True if config is None else bool(getattr(config, "norm_adv_by_std_in_grpo", True))
    if by_std:
        ss = torch.zeros_like(count).index_add_(0, group, centered * centered)
        sigma = torch.sqrt(ss / (count - 1).clamp(min=1.0))
        centered = centered / (sigma[group] + ADV_EPS)
    adv = centered[:, None] * response_mask.to(x.dtype)
    return adv, adv


def _mean(x: torch.Tensor, m: torch.Tensor) -> float:
    return masked_mean(x.detach(), m).item()


def _cost(a: torch.Tensor, r: torch.Tensor, divergence: str) -> torch.Tensor:
    """f-GRPO's unit cost |a|·φ_{sign a}(r) (φ₊ where a > 0)."""
    return a.abs() * phi(r, a > 0, divergence)
