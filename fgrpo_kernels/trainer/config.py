"""The one configuration dataclass of the thin trainer."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ..core import validation as check
from ..core.divergences import NAMES as DIVERGENCES
from ..core.options import Level, LossType, Scale, parse, parse_level_reduction
from ..losses import FusedLinearFGRPOLoss, FusedLinearGIFTLoss, FusedLinearGRPOLoss
from ..losses.preference import FusedLinearFHALLoss

LOSSES = ("fgrpo", "grpo", "gift", "fhal")
DEFAULT_BETA = {"fgrpo": 0.1, "grpo": 0.04, "gift": 1.0, "fhal": 0.1}
SCHEDULERS = ("constant", "linear", "cosine")
REFERENCES = ("auto", "copy", "adapter")
REPORT_TO = ("none", "tensorboard", "wandb")


@dataclass
class TrainConfig:
    """Everything the loop needs. `beta=None` takes the loss's usual value (DEFAULT_BETA).

    One step = one rollout of `prompts_per_step` prompts × `num_generations` completions
    (`rollouts_per_step`, when set, fixes that product: prompts_per_step = it / G), then
    `num_updates` optimizer updates on it, each accumulating gradients over `grad_accum`
    micro-batches of whole groups. With `num_updates > 1` the GRPO family clips the ratio to
    the rollout's (old) log-probs; f-GRPO, GIFT and f-HAL have no ratio and simply take more
    steps on the same samples. Under torch.distributed (torchrun) the counts are per rank: a
    step of N ranks samples N × prompts_per_step prompts.
    """

    out_dir: str = "fgrpo-out"
    loss: str = "fgrpo"
    # f-GRPO / f-HAL
    divergence: str = "pearson"
    level: str = "token"
    reduction: str | None = None
    fhal_lam: float = 0.5
    pref_batch_size: int = 8
    # GRPO family
    loss_type: str = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    importance_sampling_level: str = "token"
    # GIFT
    gift_detach_stats: bool = False
    # all losses
    beta: float | None = None
    scale_rewards: str = "group"
    # sampling
    num_generations: int = 8
    prompts_per_step: int = 16
    rollouts_per_step: int | None = None
    max_new_tokens: int = 2
    temperature: float = 1.0
    # optimisation
    steps: int = 300
    lr: float = 3e-3
    weight_decay: float = 0.0
    scheduler: str = "constant"
    warmup_steps: int = 0
    grad_accum: int = 1
    max_grad_norm: float | None = 1.0
    num_updates: int = 1
    reference: str = "auto"
    # rewards and evaluation
    reward_weights: list[float] | None = None
    eval_every: int = 0
    eval_temperature: float = 0.0
    pass_threshold: float = 1.0
    chance_samples: int = 256
    # data parallelism (under torch.distributed): DDP, or FSDP2 with fsdp
    fsdp: bool = False
    # bookkeeping
    seed: int = 0
    save_every: int = 0
    save_total_limit: int = 0  # keep the newest N checkpoint-N/ (and final/); 0: every one
    report_to: str = "none"  # also log every metric to "tensorboard" or "wandb" (TRL's names)
    progress: bool = True

    def __post_init__(self):
        check.choice("loss", self.loss, LOSSES)
        check.choice("divergence", self.divergence, DIVERGENCES)
        parse_level_reduction(self.level, self.reduction)
        parse(LossType, "loss_type", self.loss_type)
        parse(Level, "importance_sampling_level", self.importance_sampling_level)
        parse(Scale, "scale_rewards", self.scale_rewards)
        check.choice("scheduler", self.scheduler, SCHEDULERS)
        check.choice("reference", self.reference, REFERENCES)
        for name in ("num_generations", "prompts_per_step", "max_new_tokens", "steps"):
            check.positive_int(name, getattr(self, name))
        for name in ("grad_accum", "num_updates", "pref_batch_size"):
            check.positive_int(name, getattr(self, name))
        if self.num_generations < 2:
            raise ValueError(
                f"num_generations: expected an int >= 2 (advantages compare the completions of "
                f"one prompt; a group of one learns nothing); got {self.num_generations}"
            )
        if self.rollouts_per_step is not None:
            check.positive_int("rollouts_per_step", self.rollouts_per_step)
            if self.rollouts_per_step % self.num_generations:
                raise ValueError(
                    f"rollouts_per_step: expected a multiple of num_generations="
                    f"{self.num_generations}; got {self.rollouts_per_step}"
                )
            self.prompts_per_step = self.rollouts_per_step // self.num_generations
        check.choice("report_to", self.report_to, REPORT_TO)
        for name in ("warmup_steps", "save_every", "save_total_limit", "eval_every",
                     "chance_samples"):  # fmt: skip
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name}: expected an int >= 0; got {getattr(self, name)!r}")
        check.positive("lr", self.lr)
        check.positive("temperature", self.temperature)
        check.positive("weight_decay", self.weight_decay, allow_zero=True)
        check.positive("eval_temperature", self.eval_temperature, allow_zero=True)
        check.real("pass_threshold", self.pass_threshold)
        if self.reward_weights is not None:
            self.reward_weights = [check.real("reward_weights", w) for w in self.reward_weights]
        if self.prompts_per_step % self.grad_accum:
            raise ValueError(
                f"grad_accum: expected a divisor of prompts_per_step={self.prompts_per_step} "
                f"(micro-batches hold whole groups); got {self.grad_accum}"
            )
        if self.loss == "fhal" and self.pref_batch_size % self.grad_accum:
            raise ValueError(
                f"pref_batch_size: expected a multiple of grad_accum={self.grad_accum}; "
                f"got {self.pref_batch_size}"
            )
        if not 0.0 <= self.fhal_lam <= 1.0:
            raise ValueError(f"fhal_lam: expected a number in [0, 1]; got {self.fhal_lam!r}")
        if not isinstance(self.fsdp, bool):
            raise TypeError(f"fsdp: expected a bool; got {self.fsdp!r}")
        if self.beta is None:
            self.beta = DEFAULT_BETA[self.loss]
        check.real("beta", self.beta)
        if self.max_grad_norm is not None:
            check.positive("max_grad_norm", self.max_grad_norm)

    def to_dict(self) -> dict:
        return asdict(self)

    def loss_module(self) -> torch.nn.Module:
        """The fused module that `loss` names, with entropy tracking on."""
        G, tau = self.num_generations, self.temperature
        if self.loss == "fgrpo":
            return FusedLinearFGRPOLoss(
                self.divergence, self.beta, self.level, self.reduction, G, tau,
                self.scale_rewards, compute_entropy=True,
            )  # fmt: skip
        if self.loss == "grpo":
            return FusedLinearGRPOLoss(
                self.loss_type, self.beta, self.epsilon_low, self.epsilon_high,
                self.importance_sampling_level, tau, self.max_new_tokens,
                use_ref_model=self.beta != 0.0, compute_entropy=True,
            )  # fmt: skip
        if self.loss == "gift":
            return FusedLinearGIFTLoss(
                G, self.beta, detach_stats=self.gift_detach_stats, temperature=tau,
                compute_entropy=True,
            )  # fmt: skip
        return FusedLinearFHALLoss(
            self.divergence, self.beta, self.fhal_lam, self.level, self.reduction, G, tau,
            scale_rewards=self.scale_rewards, compute_entropy=True,
        )  # fmt: skip

    def lr_factor(self, update: int) -> float:
        """Learning-rate multiplier after `update` optimizer updates (warm-up, then schedule)."""
        if update < self.warmup_steps:
            return (update + 1) / self.warmup_steps
        total = self.steps * self.num_updates - self.warmup_steps
        frac = min((update - self.warmup_steps) / max(total, 1), 1.0)
        if self.scheduler == "linear":
            return 1.0 - frac
        if self.scheduler == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * frac))
        return 1.0
