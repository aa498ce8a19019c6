"""The compared implementations ("peers"), each behind one adapter.

Every peer gives per-token log-probs (hidden [B, T, H], weight [V, H], ids [B, T]) → fp32
[B, T], so that its `logprobs` rows measure the same work as ours (tests/test_bench_peers.py
checks each against a float64 oracle). A peer that ships its own GRPO loss also runs the
`grpo` workload through it; the eager and compiled references and ours also run `fgrpo`.

- `eager`: `fgrpo_kernels.reference` (materialises the fp32 [N, V] logits on purpose);
- `compile`: `torch.compile(dynamic=True)` of the same functions (inductor);
- `liger`: Liger-Kernel's chunked selective log-prob (the one under its GRPO loss) and
  `LigerFusedLinearGRPOLoss`; `liger_triton` is its Triton `triton_grpo_loss` on materialised
  logits (CUDA only);
- `cce`: Cut Cross-Entropy, log-probs = −`linear_cross_entropy(reduction="none")`: its
  `torch_compile` implementation on CPU, its Triton kernels (default gradient filtering) on CUDA;
- `trl`: TRL's `trl.kernels.ChunkedLogProbFunction` with the vocabulary chunk its GRPOTrainer
  uses (Triton on CUDA, PyTorch tiles elsewhere);
- `verl`: verl's torch fused path `FusedLinearForPPO` (512-token chunks; it also computes the
  entropy, which verl always does);
- `ours`: `fused_linear_logprobs`, `FusedLinearGRPOLoss`, `FusedLinearFGRPOLoss`.

A peer whose package is missing is an `unavailable` row naming the package, never a crash.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import fgrpo_kernels
from fgrpo_kernels.core import reference

from .workload import EPS, FGRPO_BETA, GRPO_BETA, Workload

LogProbs = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Step = Callable[[Workload], torch.Tensor]
Build = Callable[[str], Step]


def _flat(fn: Callable) -> LogProbs:
    """Adapt a peer taking hidden [N, H] and ids [N] to the [B, T] workload."""
    return lambda h, w, y: fn(h.flatten(0, 1), w, y.flatten()).view(y.shape)


def _eager_grpo(w: Workload) -> torch.Tensor:
    logps = reference.logprobs(w.hidden, w.weight, w.ids)
    return reference.grpo_loss(logps, None, w.ref_logps, w.advantages, w.mask, "dapo", GRPO_BETA)


def _eager_fgrpo(w: Workload) -> torch.Tensor:
    logps = reference.logprobs(w.hidden, w.weight, w.ids)
    return reference.fgrpo_loss(logps, w.ref_logps, w.advantages, w.mask, "pearson", FGRPO_BETA)


def _inductor_settings(device: str) -> None:
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)  # the graph-break notice
    if device == "cpu":  # NB: a compile-worker pool would outlive the CPU worker process
        import torch._inductor.config

        torch._inductor.config.compile_threads = 1


def _compiled(fn: Callable) -> Callable[[str], Callable]:
    def build(device: str) -> Callable:
        _inductor_settings(device)
        return torch.compile(fn, dynamic=True)

    return build


def _liger_logprobs(device: str) -> LogProbs:
    from liger_kernel.chunked_loss.fused_linear_ppo import (
        _SELECTIVE_LOGPROB_VOCAB_CHUNK_SIZE as CHUNK,
    )
    from liger_kernel.chunked_loss.fused_linear_ppo import (
        _ChunkedSelectiveLogProbFunction as Fn,
    )

    return _flat(lambda h, w, y: Fn.apply(h, w, y, None, 1.0, CHUNK))


def _liger_grpo(device: str) -> Step:
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    loss = LigerFusedLinearGRPOLoss(
        beta=GRPO_BETA, compiled=device == "cuda", epsilon_low=EPS, epsilon_high=EPS,
        loss_type="dapo",
    )  # fmt: skip
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


def _cce_logprobs(device: str) -> LogProbs:
    from cut_cross_entropy import linear_cross_entropy

    impl = "cce" if device == "cuda" else "torch_compile"
    _inductor_settings(device)
    return lambda h, w, y: -linear_cross_entropy(h, w, y, reduction="none", impl=impl)


def _trl_logprobs(device: str) -> LogProbs:
    from trl.kernels import ChunkedLogProbFunction as Fn

    try:  # the vocabulary chunk GRPOTrainer passes (a private constant of trl 1.16)
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as chunk
    except ImportError:
        chunk = 32768
    # (hidden, weight, bias, targets, temperature, chunk, softcap, logit_scale, extra outputs)
    return _flat(lambda h, w, y: Fn.apply(h, w, None, y, 1.0, chunk, None, 1.0, ())[0])


def _verl_logprobs(device: str) -> LogProbs:
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    fused = FusedLinearForPPO(impl_backend="torch")
    return lambda h, w, y: fused(h, w, y)[0]


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


@dataclass(frozen=True)
class Peer:
    """One implementation: its log-probs, its own losses (workload → build), its backend."""

    logprobs: Callable[[str], LogProbs] | None
    backend: Callable[[str], str]
    losses: dict[str, Build] = field(default_factory=dict)
    package: str | None = None  # the distribution that provides it (None: torch or this package)
    extra: str | None = "bench"  # the fgrpo-kernels extra that installs it
    devices: tuple[str, ...] = ("cpu", "cuda")
    compiles: bool = False  # pays a compile on its first call

    def runs(self, workload: str) -> bool:
        return workload in self.losses or (workload == "logprobs" and self.logprobs is not None)

    def step(self, workload: str, device: str) -> Step:
        """The unit of work of `workload` (ImportError when the peer's package is missing)."""
        if workload in self.losses:
            return self.losses[workload](device)
        if workload != "logprobs" or self.logprobs is None:
            raise ValueError(f"workload: this peer has no {workload!r}")
        logprobs = self.logprobs(device)
        return lambda w: logprobs(w.hidden, w.weight, w.ids)

    def missing(self, error: ImportError) -> str:
        """The note of an `unavailable` row."""
        how = f"pip install 'fgrpo-kernels[{self.extra}]'" if self.extra else "see the README"
        return f"{self.package} is not installed ({how}): {type(error).__name__}: {error}"

    def version(self) -> str:
        name = self.package or "torch"
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"


def _fixed(name: str) -> Callable[[str], str]:
    return lambda device: name


def _by_device(cpu: str, cuda: str) -> Callable[[str], str]:
    return lambda device: cuda if device == "cuda" else cpu


def _ours_backend(device: str) -> str:
    return fgrpo_kernels.cpu_backend() if device == "cpu" else "triton"


PEERS: dict[str, Peer] = {
    "eager": Peer(
        lambda d: reference.logprobs, _fixed("torch"),
        {"grpo": lambda d: _eager_grpo, "fgrpo": lambda d: _eager_fgrpo},
    ),
    "compile": Peer(
        _compiled(reference.logprobs), _fixed("inductor"),
        {"grpo": _compiled(_eager_grpo), "fgrpo": _compiled(_eager_fgrpo)}, compiles=True,
    ),
    "liger": Peer(
        _liger_logprobs, _fixed("chunked torch"), {"grpo": _liger_grpo}, package="liger-kernel"
    ),
    "liger_triton": Peer(
        None, _fixed("triton on logits"), {"grpo": _liger_triton_grpo}, package="liger-kernel",
        devices=("cuda",),
    ),
    "cce": Peer(
        _cce_logprobs, _by_device("torch_compile", "triton"), package="cut-cross-entropy",
        compiles=True,
    ),
    "trl": Peer(_trl_logprobs, _by_device("chunked torch", "chunked triton"), package="trl"),
    # NB: no extra: verl 0.9.1 pins transformers < 5.11, and pip's downgrade next to TRL 1.16
    # leaves a `kernels` package that breaks `import transformers` (README, Benchmarks).
    "verl": Peer(_verl_logprobs, _fixed("chunked torch"), package="verl", extra=None),
    "ours": Peer(
        lambda d: fgrpo_kernels.fused_linear_logprobs, _ours_backend,
        {"grpo": _ours_grpo, "fgrpo": _ours_fgrpo},
    ),
}  # fmt: skip

ORDER = tuple(PEERS)
