"""The one forward pipeline every fused loss runs (docs/architecture.md).

A loss module's `forward` checks its inputs into a `LossStep` (the loss on this batch: its
detached side inputs, its normalisers, its epilogue for each path, its metrics and its
data-parallel scaling), then calls `FusedLoss.run`, which

1. decides the path once (`single_pass.decide`: a `Plan`, or a `Refusal` with its reason,
   recorded in `last_pass`),
2. runs the fused head: the single pass (the loss's gradient formed in the sweep), or the
   log-probs and the step's two-pass epilogue,
3. takes the step's metrics and scales the loss for a data-parallel batch.

The head's options (`HeadOptions`) are parsed once in the constructor and held whole as
`self.head`; each of them also reads and writes as a module attribute (`module.temperature`).
"""

from __future__ import annotations

import torch

from ..backends import distributed
from ..head.batch import Batch
from ..head.options import NAMES, HeadOptions
from . import single_pass


class LossStep:
    """One call of a loss on one batch. Subclasses set `need_entropy` (the head computes the
    entropy) and `return_entropy` (forward returns it), and implement `two_pass`; `chunked`
    (the single pass's `ChunkedLoss`, or why none: str), `metrics` and `finish` (the loss
    as this rank returns it) have defaults."""

    need_entropy: bool = False
    return_entropy: bool = False

    def chunked(self):
        return "this loss has no single pass"

    def two_pass(self, logps: torch.Tensor, entropy: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def metrics(self, loss, logps, entropy) -> dict:
        return {}

    def finish(self, loss: torch.Tensor) -> torch.Tensor:
        return loss


def _head_property(name: str) -> property:
    def get(self):
        return getattr(self.head, name)

    def put(self, value):
        self.head = HeadOptions.parse(**{**self.head.as_dict(), name: value})

    return property(get, put, doc=f"`HeadOptions.{name}` of this module.")


class FusedLoss(torch.nn.Module):
    """The base of every fused loss module: the head's options, the batch, the pipeline.

    Each module takes temperature, compute_entropy and fast_fp32 where its positional order has
    them, and every `HeadOptions` field (vocab_parallel, process_group, max_chunk_bytes, ...)
    by keyword, passed here whole; an unknown keyword is a TypeError listing the valid ones."""

    def __init__(self, *head_args, **head):
        """The head's options by keyword, or positionally in `HeadOptions` order (temperature,
        compute_entropy, fast_fp32, vocab_parallel, process_group, max_chunk_bytes)."""
        super().__init__()
        if len(head_args) > len(NAMES):
            raise TypeError(f"expected at most {len(NAMES)} head options; got {len(head_args)}")
        self.head = HeadOptions.parse(**dict(zip(NAMES, head_args)), **head)
        self.last_pass = None

    def batch(self, hidden, weight, ids, mask, bias, prefix: str = "") -> Batch:
        return Batch.of(self.head, hidden, weight, ids, mask, bias, prefix)

    def data_parallel(self):
        """(group, world size), or None without a process_group."""
        group = distributed.check_group(self.head.process_group)
        return None if group is None else (group, distributed.dist.get_world_size(group))

    @staticmethod
    def share(loss, local, total, world):
        """A rank's share of a mean over the data-parallel batch, times the group size: the
        mean over ranks is then the whole batch's loss."""
        return loss * (world * float(local) / max(float(total), 1.0))

    def fused(self, batch: Batch, step: LossStep):
        """(loss, logps [B, T], entropy [B, T] | None) on the path `single_pass.decide` picks."""
        how = single_pass.decide(batch, self.head, step.chunked)
        self.last_pass = str(how)
        if isinstance(how, single_pass.Plan):
            return single_pass.execute(how, batch, self.head, step.need_entropy)
        logps, ent = batch.logps(self.head, step.need_entropy)
        return step.two_pass(logps, ent), logps, ent

    def run(self, batch: Batch, step: LossStep):
        """(loss, metrics), or (loss, metrics, entropy) when the step returns the entropy."""
        loss, logps, ent = self.fused(batch, step)
        m = step.metrics(loss, logps, ent)
        loss = step.finish(loss)
        return (loss, m, ent) if step.return_entropy else (loss, m)


for _name in NAMES:
    setattr(FusedLoss, _name, _head_property(_name))
