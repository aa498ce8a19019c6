"""The fused head's options: one frozen dataclass, built and checked once at the public edge
(`HeadOptions.parse`), then passed whole. Every fused module takes these keywords with these
names; a new module-wide option is one field here (plus its check in `parse`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..backends.distributed import VocabParallel
from ..core import validation as check
from ..core.options import LogProbOptions


@dataclass(frozen=True)
class HeadOptions:
    """temperature τ (logits / τ); compute_entropy (the entropy for the metrics); fast_fp32
    (TF32 products for fp32 inputs on CUDA); vocab_parallel (weight and bias are this rank's
    shard of the vocabulary); process_group (this rank holds a slice of a data-parallel batch);
    max_chunk_bytes (the single pass's logits buffer; 0: the two-pass path; None: the device's
    default, see `losses.single_pass.chunk_bytes`)."""

    temperature: float = 1.0
    compute_entropy: bool = False
    fast_fp32: bool = False
    vocab_parallel: VocabParallel | None = None
    process_group: object = None
    max_chunk_bytes: int | None = None

    @classmethod
    def parse(cls, **options) -> HeadOptions:
        """The options from keywords, each checked; an unknown keyword is a TypeError that lists
        the valid ones."""
        unknown = sorted(set(options) - set(NAMES))
        if unknown:
            raise TypeError(
                f"{unknown[0]}: not an option of the fused head; expected one of {', '.join(NAMES)}"
            )
        vocab_parallel = options.get("vocab_parallel")
        if vocab_parallel is not None and not isinstance(vocab_parallel, VocabParallel):
            raise TypeError(
                f"vocab_parallel: expected a VocabParallel or None; got {type(vocab_parallel)}"
            )
        return cls(
            temperature=check.temperature(options.get("temperature", 1.0)),
            compute_entropy=bool(options.get("compute_entropy", False)),
            fast_fp32=bool(options.get("fast_fp32", False)),
            vocab_parallel=vocab_parallel,
            process_group=options.get("process_group"),
            max_chunk_bytes=check.byte_count("max_chunk_bytes", options.get("max_chunk_bytes")),
        )

    def as_dict(self) -> dict:
        """The fields by name (shallow: the process group is the same object)."""
        return {name: getattr(self, name) for name in NAMES}

    def logprob_options(self) -> LogProbOptions:
        return LogProbOptions(self.temperature, -100, self.fast_fp32)


NAMES = tuple(field.name for field in dataclasses.fields(HeadOptions))


def split(options: dict) -> tuple[dict, dict]:
    """(the head's keywords, the rest) of a module's keyword arguments."""
    head = {k: v for k, v in options.items() if k in NAMES}
    return head, {k: v for k, v in options.items() if k not in NAMES}
