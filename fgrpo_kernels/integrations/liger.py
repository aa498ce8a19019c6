"""Liger-Kernel drop-in: Liger 0.8.5's GRPO loss API, computed by `FusedLinearGRPOLoss`.

    # from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    from fgrpo_kernels.integrations.liger import LigerFusedLinearGRPOLoss

`LigerFusedLinearGRPOLoss` has exactly the constructor (`beta` first) and forward (`_input`,
`lin_weight`, `selected_token_ids`, `attention_mask`, `advantages`, `bias`,
`ref_per_token_logps`, `old_per_token_logps`, `ref_input`, `ref_weight`, `ref_bias`,
`vllm_is_ratio`, `num_items_in_batch`) of Liger-Kernel 0.8.5, positional order included, and
returns `(loss, (kl, clip_ratio))` like it (`kl` only when beta != 0). `liger_fused_linear_grpo`
(and `LigerFusedLinearGRPOFunction.apply`) is the functional form with Liger's positional
parameter list. Liger's conventions are kept: options a loss type ignores are ignored (not an
error), the dapo-family normaliser `num_items_in_batch` (or the mask's token count, summed over
ranks) is divided by the world size, `compiled` and `chunk_size` have no effect. The sequence-
level check for cispo / sapo / vespo raises at the call, as Liger's does.

By design, where Liger differs: exponential arguments saturate at 80 (Liger overflows to inf);
`luspo` masks the padding (Liger sums every position of a [B, T] per-token loss, padding
included; we follow TRL 1.16, which masks, see docs/math.md).
"""

from __future__ import annotations

import warnings

import torch

from ..core.options import LOSS_TYPE_SPECS, LossType, Normaliser, Objective, parse
from ..losses import FusedLinearGRPOLoss


def _dapo_items(mask: torch.Tensor, num_items_in_batch):
    """Liger's per-process normaliser of the dapo family: num_items_in_batch (or the mask's
    tokens summed over ranks) divided by the world size."""
    world = 1
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
    if num_items_in_batch is not None:
        total = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=mask.device)
    else:
        total = mask.to(torch.float32).sum()
        if world > 1:
            total = total.clone()
            dist.all_reduce(total)
    return total / world


def liger_fused_linear_grpo(
    _input,
    weight,
    selected_token_ids,
    attention_mask,
    advantages,
    bias=None,
    ref_per_token_logps=None,
    old_per_token_logps=None,
    ref_input=None,
    ref_weight=None,
    ref_bias=None,
    beta=0.04,
    epsilon_low=0.2,
    epsilon_high=0.2,
    loss_type="dapo",
    max_completion_length=None,
    importance_sampling_level="token",
    sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05,
    temperature=1.0,
    compiled=True,
    use_ref_model=True,
    chunk_size=1,
    vllm_is_ratio=None,
    delta=None,
    use_bias_correction_kl=False,
    vespo_k_pos=2.0,
    vespo_lambda_pos=3.0,
    vespo_k_neg=3.0,
    vespo_lambda_neg=2.0,
    num_items_in_batch=None,
):
    """Liger's `LigerFusedLinearGRPOFunction.apply`: (loss, (kl if beta != 0, clip_ratio))."""
    kind = parse(LossType, "loss_type", loss_type)
    spec = LOSS_TYPE_SPECS[kind]
    own = dict(spec.params)
    given = {
        "sapo_temperature_pos": sapo_temperature_pos,
        "sapo_temperature_neg": sapo_temperature_neg,
        "vespo_k_pos": vespo_k_pos,
        "vespo_lambda_pos": vespo_lambda_pos,
        "vespo_k_neg": vespo_k_neg,
        "vespo_lambda_neg": vespo_lambda_neg,
    }
    params = {k: float(v) for k, v in given.items() if k in own}
    clipped = spec.objective == Objective.CLIPPED
    module = FusedLinearGRPOLoss(
        kind, float(beta), float(epsilon_low), float(epsilon_high), importance_sampling_level,
        float(temperature), max_completion_length, use_ref_model=bool(use_ref_model),
        delta=float(delta) if clipped and delta is not None else None,
        use_bias_correction_kl=bool(use_bias_correction_kl), **params,
    )  # fmt: skip
    if use_ref_model:
        if ref_per_token_logps is None and ref_input is None:
            raise ValueError(
                "ref_per_token_logps: expected ref_per_token_logps or ref_input when "
                "use_ref_model is True; got neither"
            )
        if ref_per_token_logps is not None and ref_input is not None:
            warnings.warn(
                "Both ref_per_token_logps and ref_input are provided. Using ref_per_token_logps.",
                stacklevel=2,
            )
            ref_input = None
    if kind == LossType.DR_GRPO and max_completion_length is None:
        raise ValueError("max_completion_length: expected an int for loss_type 'dr_grpo'; got None")
    items = None
    if spec.normaliser == Normaliser.ITEMS:
        items = _dapo_items(attention_mask, num_items_in_batch)
    loss, metrics = module(
        _input,
        weight,
        selected_token_ids,
        attention_mask,
        advantages,
        bias,
        ref_per_token_logps=ref_per_token_logps if use_ref_model else None,
        old_per_token_logps=old_per_token_logps,
        ref_input=ref_input if use_ref_model else None,
        ref_weight=ref_weight,
        ref_bias=ref_bias,
        vllm_is_ratio=vllm_is_ratio,
        num_items_in_batch=items,
    )
    out = []
    if beta != 0.0:
        out.append(metrics.get("kl", torch.zeros((), device=loss.device)))
    out.append(metrics["clip_ratio"])
    return loss, tuple(out)


class LigerFusedLinearGRPOFunction:
    """Liger's autograd Function name; `apply` takes its positional parameter list."""

    apply = staticmethod(liger_fused_linear_grpo)


class LigerFusedLinearGRPOLoss(torch.nn.Module):
    """Liger-Kernel 0.8.5's `LigerFusedLinearGRPOLoss`, same constructor and forward, on
    `FusedLinearGRPOLoss` (see the module docstring). Options are read at each call, so
    changing an attribute (e.g. `loss.beta`) takes effect as in Liger."""

    def __init__(
        self,
        beta: float = 0.04,
        compiled: bool = True,
        use_ref_model: bool = True,
        chunk_size: int = 1,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        loss_type: str = "dapo",
        max_completion_length: int | None = None,
        importance_sampling_level: str = "token",
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        temperature: float = 1.0,
        delta: float | None = None,
        use_bias_correction_kl: bool = False,
        vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0,
        vespo_k_neg: float = 3.0,
        vespo_lambda_neg: float = 2.0,
    ):
        super().__init__()
        for arg, value in (("sapo_temperature_pos", sapo_temperature_pos),
                           ("sapo_temperature_neg", sapo_temperature_neg)):  # fmt: skip
            if value <= 0:
                raise ValueError(f"{arg}: expected a positive number; got {value!r}")
        if delta is not None and delta <= 0:
            raise ValueError(f"delta: expected a positive number; got {delta!r}")
        self.beta = beta
        self.compiled = compiled
        self.use_ref_model = use_ref_model
        self.chunk_size = chunk_size
        self.epsilon_low = epsilon_low
        self.epsilon_high = epsilon_high
        self.loss_type = loss_type
        self.max_completion_length = max_completion_length
        self.importance_sampling_level = importance_sampling_level
        self.sapo_temperature_pos = sapo_temperature_pos
        self.sapo_temperature_neg = sapo_temperature_neg
        self.temperature = temperature
        self.delta = delta
        self.use_bias_correction_kl = use_bias_correction_kl
        self.vespo_k_pos = vespo_k_pos
        self.vespo_lambda_pos = vespo_lambda_pos
        self.vespo_k_neg = vespo_k_neg
        self.vespo_lambda_neg = vespo_lambda_neg

    def forward(
        self,
        _input,
        lin_weight,
        selected_token_ids,
        attention_mask,
        advantages,
        bias=None,
        ref_per_token_logps=None,
        old_per_token_logps=None,
        ref_input=None,
        ref_weight=None,
        ref_bias=None,
        vllm_is_ratio=None,
        num_items_in_batch=None,
    ):
        return liger_fused_linear_grpo(
            _input, lin_weight, selected_token_ids, attention_mask, advantages, bias,
            ref_per_token_logps, old_per_token_logps, ref_input, ref_weight, ref_bias,
            self.beta, self.epsilon_low, self.epsilon_high, self.loss_type,
            self.max_completion_length, self.importance_sampling_level,
            self.sapo_temperature_pos, self.sapo_temperature_neg, self.temperature,
            self.compiled, self.use_ref_model, self.chunk_size, vllm_is_ratio, self.delta,
            self.use_bias_correction_kl, self.vespo_k_pos, self.vespo_lambda_pos,
            self.vespo_k_neg, self.vespo_lambda_neg, num_items_in_batch,
        )  # fmt: skip


__all__ = ["LigerFusedLinearGRPOFunction", "LigerFusedLinearGRPOLoss", "liger_fused_linear_grpo"]
