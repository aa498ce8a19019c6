"""The loss epilogue: from per-token log-probs to (loss, dL/dlogp) in one pass, no vocabulary.

Every loss of docs/math.md is a function of the fp32 per-token log-probs [B, T] (and, for the
entropy mask and bonus, the entropies) and O(B·T) side inputs. The epilogue returns the loss
*and* its gradient with respect to the log-probs (and the entropies), so the fused modules run
[log-prob kernel → epilogue] forward and [log-prob backward fed dL/dlogp · grad_output and
dL/dH · grad_output] backward. Batch-wide normalisers are inputs (`grpo_math.Normalisers`).
Two implementations share the signatures below:

- Triton (`kernels.epilogue`), on CUDA tensors and under TRITON_INTERPRET=1;
- PyTorch: autograd of the option-taking `reference` losses on a detached leaf (exact; the CPU
  path).

Options arrive parsed (`fgrpo_kernels.core.options`): nothing here validates or converts them.
"""

from __future__ import annotations

import torch

from ..core import grpo_math, reference
from ..core.options import FDOOptions, FGRPOOptions, GIFTOptions, GRPOOptions, Level, Reduction
from ..head.autograd import use_triton


def _autograd(loss_fn, logps, *args, entropy=None, entropy_grad=False, **kwargs):
    """(loss, dloss/dlogps, dloss/dentropy | None) of a reference loss, by autograd on detached
    float64 leaves; `entropy` is passed to the loss as its keyword of that name.

    NB: O(B·T) work, so float64 costs nothing here and keeps slopes that cancel in fp32
    (sech² of a saturated tanh, a z-score's eps-only gradient) exact; results come back in
    the dtype of `logps`."""
    with torch.enable_grad():
        x = logps.detach().double().requires_grad_(True)
        leaves = [x]
        if entropy is not None:
            kwargs["entropy"] = entropy.detach().double().requires_grad_(entropy_grad)
            leaves += [kwargs["entropy"]] if entropy_grad else []
        loss = loss_fn(x, *args, **kwargs)
        grads = torch.autograd.grad(loss, leaves)
    dent = grads[1].to(logps.dtype) if entropy_grad else None
    return loss.detach().to(logps.dtype), grads[0].to(logps.dtype), dent


def _with_grad(loss_fn, logps: torch.Tensor, *args) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, dloss/dlogps) of a reference loss (see `_autograd`)."""
    return _autograd(loss_fn, logps, *args)[:2]


def _minus_bonus(out, entropy, weights, scale):
    """(loss − c·mean entropy, dL/dlogp, dL/dentropy) from a kernel's (loss, dL/dlogp); scale
    = c / max(Σ weights, 1) or None (no bonus: dL/dentropy None)."""
    loss, dlogp = out
    if scale is None:
        return loss, dlogp, None
    bonus = grpo_math.entropy_bonus(entropy.float(), weights, scale)
    return loss - bonus, dlogp, -(scale.float() * weights.float())


def _no_tokens_zero(result: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor):
    """The Triton twin of `reference.zero_without_tokens` (dL/dlogp is already 0 where masked)."""
    loss, grad = result
    return reference.zero_without_tokens(loss, mask), grad


def _triton(device: torch.device):
    if use_triton(device):
        from ..backends.triton import epilogue

        return epilogue
    return None


def fgrpo(logps, entropy, ref_logps, mask, advantages, rewards, old_logps, vllm_is_ratio,
          opts: FGRPOOptions):  # fmt: skip
    """f-GRPO: (loss, dL/dlogps, dL/dentropy | None). `advantages` [B], or None with `rewards`
    [B] (then normalised per group inside); `old_logps` [B, T] only for group_is_weights;
    `vllm_is_ratio` ρ weights each unit; `entropy` [B, T] for opts.entropy_coef."""
    kernels = _triton(logps.device)
    bonus = opts.entropy_coef != 0.0
    if kernels is None:
        return _autograd(
            reference.fgrpo, logps, ref_logps, mask, advantages, rewards, old_logps, opts,
            vllm_is_ratio=vllm_is_ratio, entropy=entropy if bonus else None, entropy_grad=bonus,
        )  # fmt: skip
    out = kernels.fgrpo(logps, ref_logps, mask, advantages, rewards, old_logps, opts, vllm_is_ratio)
    out = _no_tokens_zero(out, mask)
    if not bonus:
        return (*out, None)
    m = mask.float()
    return _minus_bonus(out, entropy, m, opts.entropy_coef / m.sum().clamp(min=1.0))


def fgrpo_advantages(rewards, opts: FGRPOOptions) -> torch.Tensor:
    """Advantages [B] (float32) from rewards [B] as `fgrpo` forms them inside: group statistics
    in float64 in the Triton kernels, in the rewards' compute dtype in the PyTorch reference (a
    group of equal rewards leaves float32 rounding over σ + eps, ~1e-5, which a caller that
    forms them up front, the single pass, must share)."""
    wide = _triton(rewards.device) is not None
    x = rewards.double() if wide else rewards.to(reference.compute_dtype(rewards))
    return reference.group_zscore(x, opts.num_generations, opts.eps, opts.unbiased,
                                  opts.scale).float()  # fmt: skip


def grpo(logps, entropy, old_logps, ref_logps, mask, advantages, vllm_is_ratio, sampling_logps,
         norms: grpo_math.Normalisers, opts: GRPOOptions):  # fmt: skip
    """TRL/Liger GRPO family: (loss, dL/dlogps, dL/dentropy | None). old None → logps (ratio
    1); ref None → no KL; `entropy` [B, T] for the entropy mask and bonus; `norms` the batch's
    `grpo_math.Normalisers` (row scales, entropy threshold, bonus scale)."""
    # the Triton epilogue knows k3 only: another estimator takes the PyTorch epilogue (O(N))
    kernels = _triton(logps.device) if opts.kl_penalty is None else None
    bonus = norms.entropy_scale is not None
    if kernels is None:
        return _autograd(
            reference.grpo, logps, old_logps, ref_logps, mask, advantages, None, opts,
            vllm_is_ratio=vllm_is_ratio, entropy=entropy, entropy_grad=bonus,
            sampling_logps=sampling_logps, norms=norms,
        )  # fmt: skip
    out = kernels.grpo(
        logps, old_logps, ref_logps, mask, advantages, opts, norms, vllm_is_ratio, entropy,
        sampling_logps,
    )  # fmt: skip
    weights = grpo_math.bonus_mask(mask, opts, entropy, norms.entropy_threshold) if bonus else None
    return _minus_bonus(out, entropy, weights, norms.entropy_scale)


def gift(logps, ref_logps, mask, rewards, opts: GIFTOptions):
    """GIFT: (loss, dL/dlogps), through the group statistics unless opts.detach_stats."""
    kernels = _triton(logps.device)
    if kernels is not None:
        return _no_tokens_zero(kernels.gift(logps, ref_logps, mask, rewards, opts), mask)
    return _with_grad(reference.gift, logps, ref_logps, mask, rewards, opts)


def fdo_as_fgrpo(chosen, opts: FDOOptions) -> tuple[torch.Tensor, FGRPOOptions]:
    """FDO as sequence-level f-GRPO with reduction "sum": (advantages +1/n_chosen on chosen rows,
    −1/n_rejected on rejected ones, the f-GRPO options)."""
    n_chosen = chosen.sum()
    dtype = torch.float32
    adv = torch.where(
        chosen, 1.0 / n_chosen.to(dtype), -1.0 / (chosen.numel() - n_chosen).to(dtype)
    )
    return adv, FGRPOOptions(opts.divergence, opts.beta, Level.SEQUENCE, Reduction.SUM)


def fdo(logps, ref_logps, mask, chosen, opts: FDOOptions):
    """FDO: (loss, dL/dlogps); on the Triton path it is sequence-level f-GRPO (`fdo_as_fgrpo`)."""
    kernels = _triton(logps.device)
    if kernels is None:
        return _with_grad(reference.fdo, logps, ref_logps, mask, chosen, opts)
    adv, seq = fdo_as_fgrpo(chosen, opts)
    return _no_tokens_zero(kernels.fgrpo(logps, ref_logps, mask, adv, None, None, seq), mask)
