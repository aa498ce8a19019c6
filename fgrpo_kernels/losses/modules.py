"""The fused loss modules, one family per file (grpo, fgrpo, gift, preference), all on the one
pipeline of `losses.pipeline`: hidden states and the lm_head in, (loss, metrics) out
(docs/math.md, docs/architecture.md).

Each module computes the per-token log-probs with the fused kernel (never the [N, V] logits),
then runs the loss epilogue, which returns the loss and dL/dlogp in one pass; backward feeds
dL/dlogp · grad_output to the log-prob backward. `metrics` is a dict of detached scalars.

Shapes: hidden [B, T, H], weight [V, H], completion_ids / completion_mask [B, T],
advantages / rewards [B], per-token log-probs [B, T].

Every module also takes `vocab_parallel=VocabParallel(...)` (weight and bias are this rank's
shard of the vocabulary; completion ids stay global) and `process_group=` (this rank holds a
slice of a data-parallel batch, in rank order: the normalisers, group statistics and pool
sizes are the whole batch's, and each rank's loss is its share times the group size, so the
mean over ranks — what DDP's gradient averaging takes — is the whole batch's loss; see
docs/math.md §7). A DTensor weight or bias (FSDP2) is gathered once per call.
"""

from __future__ import annotations

# ruff: noqa: F401  (re-exports: `__all__` below is derived from the package's)
from . import __all__ as _package
from .fgrpo import FusedLinearFGRPOLoss
from .gift import FusedLinearGIFTLoss
from .grpo import FusedLinearGRPOLoss
from .pipeline import FusedLoss, LossStep
from .preference import FusedLinearFDOLoss, FusedLinearFHALLoss

# the families this module held first (grpo, fgrpo, gift, preference) and the pipeline's bases
__all__ = [n for n in _package if n not in ("FusedLinearPolicyLoss", "PackedLoss")]
__all__ += ["FusedLoss", "LossStep"]
