"""The implementations under test: each `build(device)` returns `step(workload) -> tensor`.

Loss impls return the scalar loss, log-prob impls the per-token log-probs [B, T] (backward then
takes `workload.grad_logp`). Every impl does one policy log-prob pass over the N tokens and the
loss on top; the reference model's log-probs are given. Workload: GRPO "dapo" (β 0.04, ε 0.2)
for the GRPO impls, token-level Pearson f-GRPO (β 0.1) for the f-GRPO ones.

- eager_*: `fgrpo_kernels.reference` (materialises the fp32 [N, V] logits on purpose);
- compile_*: `torch.compile` of the same eager function;
- liger_grpo: Liger-Kernel's chunked `LigerFusedLinearGRPOLoss` (a completion per chunk, tiled);
- liger_triton_grpo: Liger's Triton `triton_grpo_loss` on materialised bf16 logits (CUDA);
- cce_logprobs: cut-cross-entropy's `linear_cross_entropy(reduction="none")` (CUDA, optional);
- ours_*: the public fused modules of this package.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

import fgrpo_kernels
from fgrpo_kernels import reference

GRPO_BETA, EPS, FGRPO_BETA = 0.04, 0.2, 0.1


@dataclass
class Workload:
    """hidden [B, T, H], weight [V, H]; ids, mask, ref_logps, grad_logp [B, T]; advantages [B]."""

    hidden: torch.Tensor
    weight: torch.Tensor
    ids: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    ref_logps: torch.Tensor
    grad_logp: torch.Tensor

    @classmethod
    def make(cls, case) -> Workload:
        dev, dtype = torch.device(case.device), getattr(torch, case.dtype)
        gen = torch.Generator(device=dev).manual_seed(case.seed)
        B, T, H, V = case.generations, case.seq_len, case.hidden, case.vocab
        if case.tokens != B * T:
            raise ValueError(f"tokens: expected a multiple of generations={B}; got {case.tokens}")

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dtype)

        rewards = torch.randint(0, 2, (B,), generator=gen, device=dev).float()
        backward = case.pass_ != "fwd"
        return cls(
            hidden=randn(B, T, H).requires_grad_(backward),
            weight=randn(V, H, scale=H**-0.5).requires_grad_(case.pass_ == "fwd+bwd"),
            ids=torch.randint(0, V, (B, T), generator=gen, device=dev),
            mask=torch.ones(B, T, device=dev),
            advantages=fgrpo_kernels.group_normalize(rewards, B),
            ref_logps=-math.log(V) - 0.5 + 0.1 * torch.randn(B, T, generator=gen, device=dev),
            grad_logp=torch.randn(B, T, generator=gen, device=dev) / (B * T),
        )

    def first(self) -> Workload:
        """The first completion alone ([1, T] batch), sharing the lm_head."""
        head = {k: v[:1] for k, v in vars(self).items() if k not in ("hidden", "weight")}
        hidden = self.hidden[:1].detach().requires_grad_(self.hidden.requires_grad)
        return Workload(hidden=hidden, weight=self.weight, **head)

    def zero_grad(self) -> None:
        self.hidden.grad = None
        self.weight.grad = None


Step = Callable[[Workload], torch.Tensor]


def _eager_grpo(w: Workload) -> torch.Tensor:
    logps = reference.logprobs(w.hidden, w.weight, w.ids)
    return reference.grpo_loss(logps, None, w.ref_logps, w.advantages, w.mask, "dapo", GRPO_BETA)


def _eager_fgrpo(w: Workload) -> torch.Tensor:
    logps = reference.logprobs(w.hidden, w.weight, w.ids)
    return reference.fgrpo_loss(logps, w.ref_logps, w.advantages, w.mask, "pearson", FGRPO_BETA)


def _eager_logprobs(w: Workload) -> torch.Tensor:
    return reference.logprobs(w.hidden, w.weight, w.ids)


def _ours_logprobs(w: Workload) -> torch.Tensor:
    return fgrpo_kernels.fused_linear_logprobs(w.hidden, w.weight, w.ids)


def _compiled(fn: Step) -> Callable[[str], Step]:
    def build(device: str) -> Step:
        logging.getLogger("torch._dynamo").setLevel(logging.ERROR)  # the graph-break notice
        if device == "cpu":  # NB: a compile-worker pool would outlive the CPU worker process
            import torch._inductor.config

            torch._inductor.config.compile_threads = 1
        return torch.compile(fn)

    return build


def _ours_grpo(device: str) -> Step:
    loss = fgrpo_kernels.FusedLinearGRPOLoss("dapo", GRPO_BETA, EPS, EPS)
    return lambda w: loss(
        w.hidden, w.weight, w.ids, w.mask, w.advantages, ref_per_token_logps=w.ref_logps
    )[0]


def _ours_fgrpo(device: str) -> Step:
    loss = fgrpo_kernels.FusedLinearFGRPOLoss("pearson", FGRPO_BETA)
    return lambda w: loss(
        w.hidden, w.weight, w.ids, w.mask, advantages=w.advantages, ref_per_token_logps=w.ref_logps
    )[0]


def _liger_grpo(device: str) -> Step:
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    loss = LigerFusedLinearGRPOLoss(
        beta=GRPO_BETA,
        compiled=device == "cuda",
        epsilon_low=EPS,
        epsilon_high=EPS,
        loss_type="dapo",
    )
    return lambda w: loss(
        w.hidden, w.weight, w.ids, w.mask, w.advantages, ref_per_token_logps=w.ref_logps
    )[0]


def _liger_triton_grpo(device: str) -> Step:
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    def step(w: Workload) -> torch.Tensor:
        # NB: it reads logits [B, T+1, V] and drops the last position, as a causal LM gives them.
        logits = torch.nn.functional.pad(w.hidden, (0, 0, 0, 1)) @ w.weight.T
        loss, _ = triton_grpo_loss(
            logits, None, w.ref_logps, w.ids, w.advantages, w.mask, temperature=1.0,
            beta=GRPO_BETA, eps_low=EPS, eps_high=EPS, loss_type="dapo", reduce=True,
        )  # fmt: skip
        return loss

    return step


def _cce_logprobs(device: str) -> Step:
    from cut_cross_entropy import linear_cross_entropy

    return lambda w: -linear_cross_entropy(w.hidden, w.weight, w.ids, reduction="none")


def _ours_backend(device: str) -> str:
    return fgrpo_kernels.cpu_backend() if device == "cpu" else "triton"


@dataclass(frozen=True)
class Impl:
    build: Callable[[str], Step]
    backend: Callable[[str], str]
    devices: tuple[str, ...] = ("cpu", "cuda")
    compiles: bool = False


def _fixed(name: str) -> Callable[[str], str]:
    return lambda device: name


IMPLS: dict[str, Impl] = {
    "eager_grpo": Impl(lambda d: _eager_grpo, _fixed("torch")),
    "eager_fgrpo": Impl(lambda d: _eager_fgrpo, _fixed("torch")),
    "eager_logprobs": Impl(lambda d: _eager_logprobs, _fixed("torch")),
    "compile_grpo": Impl(_compiled(_eager_grpo), _fixed("inductor"), compiles=True),
    "compile_logprobs": Impl(_compiled(_eager_logprobs), _fixed("inductor"), compiles=True),
    "liger_grpo": Impl(_liger_grpo, _fixed("liger-chunked")),
    "liger_triton_grpo": Impl(_liger_triton_grpo, _fixed("liger-triton"), ("cuda",)),
    "cce_logprobs": Impl(_cce_logprobs, _fixed("cce-triton"), ("cuda",)),
    "ours_grpo": Impl(_ours_grpo, _ours_backend),
    "ours_fgrpo": Impl(_ours_fgrpo, _ours_backend),
    "ours_logprobs": Impl(lambda d: _ours_logprobs, _ours_backend),
}

ORDER = tuple(IMPLS)


def run_step(step: Step, w: Workload, pass_: str) -> None:
    """One timed unit of work: forward (no autograd graph) or forward + backward."""
    if pass_ == "fwd":
        with torch.no_grad():
            step(w)
        return
    out = step(w)
    out.backward(None if out.dim() == 0 else w.grad_logp)


def flops(pass_: str, tokens: int, hidden: int, vocab: int) -> float:
    """The matmul floor: 2·N·H·V forward, ×3 more for dhidden and dweight, ×2 when frozen."""
    return {"fwd": 2, "fwd+bwd": 8, "fwd+bwd-frozen": 6}[pass_] * tokens * hidden * vocab
