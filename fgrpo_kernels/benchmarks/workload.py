"""The benchmark workload: the tensors of one case, one timed unit of work, and its floors.

Every implementation of a case sees the same tensors: B = `generations` completions of one
prompt (one GRPO group), T = N / B tokens each, the lm_head [V, H], reference log-probs given,
every token unmasked. Workloads ("what" of a case):

- `logprobs`: per-token log-probs [B, T] of the target ids; backward takes `grad_logp`;
- `grpo`: GRPO "dapo" loss (β 0.04, ε 0.2, TRL/Liger semantics) on those log-probs;
- `fgrpo`: token-level Pearson f-GRPO loss (β 0.1);
- `policy:MODE`: a policy-loss variant (`FusedLinearPolicyLoss(MODE)`, the source's defaults;
  `VARIANT_OPTIONS`), with the reference log-probs as the old ones (so ratios differ from 1)
  and, for clip_cov, a random keep mask drawn up front (verl draws it inside its loss);
  `policy:MODE@on-policy` (the sequence-local ones): no old log-probs (TRL's num_iterations=1).

Passes: `fwd` (no autograd graph), `fwd+bwd` (gradients of hidden and weight),
`fwd+bwd-frozen` (the lm_head takes no gradient, as with a frozen head or PEFT).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import fgrpo_kernels

# the policy-loss variants' workloads, each with the options its source has no default for
VARIANT_OPTIONS = {
    "gmpo": {}, "gspo_token": {}, "vanilla": {}, "gspo": {}, "geo_mean": {}, "gpg": {},
    "dro": {"dro_beta": 0.1}, "dppo_tv": {}, "dppo_kl": {}, "clip_cov": {}, "kl_cov": {},
    "m2po": {},
}  # fmt: skip
ON_POLICY = "@on-policy"
VARIANT_WORKLOADS = (
    *(f"policy:{mode}" for mode in VARIANT_OPTIONS),
    *(f"policy:{mode}{ON_POLICY}" for mode in ("gmpo", "gspo", "gspo_token", "geo_mean")),
)
WORKLOADS = ("logprobs", "grpo", "fgrpo", *VARIANT_WORKLOADS)
PASSES = ("fwd", "fwd+bwd", "fwd+bwd-frozen")
GRPO_BETA, EPS, FGRPO_BETA = 0.04, 0.2, 0.1


def variant_of(workload: str) -> tuple[str, bool]:
    """(mode, on-policy) of a `policy:MODE[@on-policy]` workload."""
    mode = workload.removeprefix("policy:")
    return mode.removesuffix(ON_POLICY), mode.endswith(ON_POLICY)


@dataclass
class Workload:
    """hidden [B, T, H], weight [V, H]; ids, mask, ref_logps, grad_logp, clip_cov_keep [B, T];
    advantages [B]."""

    hidden: torch.Tensor
    weight: torch.Tensor
    ids: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    ref_logps: torch.Tensor
    grad_logp: torch.Tensor
    clip_cov_keep: torch.Tensor

    def variant_inputs(self, mode: str) -> dict:
        """The per-call inputs of policy variant `mode` besides the batch."""
        return {"clip_cov_keep": self.clip_cov_keep} if mode == "clip_cov" else {}

    @classmethod
    def make(cls, case) -> Workload:
        """The tensors of `case` (any object with the fields of `presets.Case`), seeded."""
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
            # last: the draws above stay those of the workloads before it
            clip_cov_keep=(torch.rand(B, T, generator=gen, device=dev) > 2e-4).float(),
        )

    def prefix(self, fraction: int = 8) -> Workload:
        """The first T / `fraction` tokens of every completion, sharing the lm_head: the same
        code path and batch size at a fraction of the cost (for warm-ups)."""
        return self._first(max(self.ids.shape[1] // fraction, 1))

    def head(self, max_tokens: int) -> Workload:
        """The first tokens of every completion, at most `max_tokens` in all (at least one per
        completion), sharing the lm_head: what the oracle check runs (`oracle.py`)."""
        B, T = self.ids.shape
        return self._first(max(1, min(T, max_tokens // B)))

    def _first(self, t: int) -> Workload:
        # NB: contiguous copies, not views: a compiled graph guards on the inputs' layout
        cut = {
            k: getattr(self, k)[:, :t].clone()
            for k in ("ids", "mask", "ref_logps", "grad_logp", "clip_cov_keep")
        }
        hidden = self.hidden[:, :t].detach().clone().requires_grad_(self.hidden.requires_grad)
        return Workload(hidden=hidden, weight=self.weight, advantages=self.advantages, **cut)

    def zero_grad(self) -> None:
        self.hidden.grad = None
        self.weight.grad = None


def run_step(step, w: Workload, pass_: str) -> torch.Tensor:
    """One timed unit of work: forward (no autograd graph) or forward + backward; its output."""
    if pass_ == "fwd":
        with torch.no_grad():
            return step(w)
    out = step(w)
    out.backward(None if out.dim() == 0 else w.grad_logp)
    return out


def flops(pass_: str, tokens: int, hidden: int, vocab: int, k: int | None = None) -> float:
    """The matmul floor k·N·H·V; by default k = 2 forward, 8 for a backward that recomputes the
    logits (dhidden and dweight), 6 when frozen (`Peer.floor_k` gives each peer's own k)."""
    k = k or {"fwd": 2, "fwd+bwd": 8, "fwd+bwd-frozen": 6}[pass_]
    return k * tokens * hidden * vocab


def memory_floor(pass_: str, tokens: int, hidden: int, vocab: int, dtype: str) -> int:
    """Bytes every implementation must add to its inputs: the fp32 per-token output, and the
    gradients (dhidden, plus dweight unless the head is frozen) in the input dtype."""
    size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    grads = {"fwd": 0, "fwd+bwd": (tokens + vocab) * hidden, "fwd+bwd-frozen": tokens * hidden}
    return 4 * tokens + size * grads[pass_]
