"""One call's checked inputs to the fused head: a padded batch of completions.

`Batch.of` checks hidden [B, T, H], weight [V, H], ids / mask [B, T] and bias [V] once (with the
lm_head gathered if FSDP2 shards it), and the batch then yields its unmasked tokens and their
per-token log-probs (and entropies) as [B, T], 0 where masked. Every loss module builds one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends import distributed
from ..core import validation as check
from .logprobs import fused_linear_logprobs
from .options import HeadOptions


def lm_head(weight, bias):
    """(weight, bias) as plain tensors: a DTensor (FSDP2) weight or bias gathered once."""
    if distributed.is_dtensor(weight):
        weight = distributed.gather_dtensor(weight, "weight")
    if distributed.is_dtensor(bias):
        bias = distributed.gather_dtensor(bias, "bias")
    return weight, bias


def vocab_size(head: HeadOptions, weight) -> int | None:
    """The global V under vocabulary parallelism (ids are global), else None."""
    if head.vocab_parallel is None:
        return None
    check.tensor("weight", weight, ndim=2)
    return distributed.resolve(head.vocab_parallel, weight.shape[0], weight.device).total


@dataclass(frozen=True)
class Batch:
    """hidden [B, T, H], weight [V, H], ids [B, T], mask [B, T], bias [V] | None, after the
    checks; `B`, `T` the batch's sizes."""

    hidden: torch.Tensor
    weight: torch.Tensor
    ids: torch.Tensor
    mask: torch.Tensor
    bias: torch.Tensor | None
    B: int
    T: int

    @classmethod
    def of(cls, head: HeadOptions, hidden, weight, ids, mask, bias, prefix: str = "") -> Batch:
        weight, bias = lm_head(weight, bias)
        B, T, _, _ = check.linear_batch(
            hidden, weight, ids, mask, bias, prefix=prefix, vocab_size=vocab_size(head, weight)
        )
        return cls(hidden, weight, ids, mask, bias, B, T)

    def per_token_logps(self, name: str, t):
        """Given log-probs `name` [B, T] (reference, old, rollout): floating, finite where the
        mask is set (masked positions never reach a loss; TRL's padding holds whatever the
        model scored there)."""
        return check.per_token_logps(name, t, self.mask)

    def optional_logps(self, name: str, t) -> None:
        if t is not None:
            self.per_token_logps(name, t)

    def wants_grad(self) -> bool:
        return torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (self.hidden, self.weight, self.bias)
        )

    def lengths(self) -> list[int]:
        return self.mask.bool().sum(-1).tolist()

    def tokens(self):
        """(positions [N], hidden [N, H], targets [N]) of the unmasked tokens, row-major."""
        B, T, H = self.hidden.shape
        positions = self.mask.reshape(-1).bool().nonzero().squeeze(1)
        if len(positions) == B * T:  # every token counts: a view, no copy (nor its gradient's)
            return positions, self.hidden.reshape(B * T, H), self.ids.reshape(-1)
        rows = self.hidden.reshape(B * T, H).index_select(0, positions)
        return positions, rows, self.ids.reshape(-1).index_select(0, positions)

    def logps(self, head: HeadOptions, entropy: bool = False):
        """Per-token log-probs [B, T] and, with `entropy`, entropies [B, T] (both 0 where
        masked, both differentiable); only unmasked rows reach the kernel."""
        positions, rows, targets = self.tokens()
        out = fused_linear_logprobs(
            rows,
            self.weight,
            targets,
            self.bias,
            head.temperature,
            return_entropy=entropy,
            fast_fp32=head.fast_fp32,
            vocab_parallel=head.vocab_parallel,
        )
        logp, ent = out if entropy else (out, None)
        flat = self.B * self.T

        def scatter(x):
            return x.new_zeros(flat).index_copy(0, positions, x).reshape(self.B, self.T)

        return scatter(logp), None if ent is None else scatter(ent)

    def given_or_computed(self, head: HeadOptions, name: str, given, hidden, weight, bias):
        """Per-token log-probs passed in as `name` [B, T], or computed forward-only from
        (hidden, weight, bias) on this batch's ids and mask — the Liger convention for an
        in-call reference model; None when neither is given."""
        if given is not None:
            return self.per_token_logps(name, given).detach()
        if hidden is None:
            return None
        weight_arg = "weight" if weight is None else "ref_weight"
        weight, bias = lm_head(self.weight if weight is None else weight, bias)
        check.tensor("ref_hidden", hidden, shape=(self.B, self.T, None), floating=True)
        check.tensor("ref_weight", weight, shape=(None, hidden.shape[-1]), floating=True)
        check.head_dtypes("ref_hidden", hidden, weight_arg, weight)
        if bias is not None:
            check.tensor("ref_bias", bias, shape=(weight.shape[0],), floating=True)
        other = Batch(hidden, weight, self.ids, self.mask, bias, self.B, self.T)
        with torch.no_grad():
            return other.logps(head)[0]

    def required_reference(self, head: HeadOptions, given, hidden, weight, bias, why=""):
        """`given_or_computed` for `ref_per_token_logps`, refusing None."""
        ref = self.given_or_computed(head, "ref_per_token_logps", given, hidden, weight, bias)
        if ref is None:
            raise ValueError(
                "ref_per_token_logps: expected [B, T] reference log-probs (or "
                f"{'ref_input' if why else 'ref_hidden'}){why}; got None"
            )
        return ref
