"""The compared implementations ("peers"), each behind one adapter, run as their users run them.

Every peer gives per-token log-probs (hidden [B, T, H], weight [V, H], ids [B, T]) → fp32
[B, T], so that its `logprobs` rows measure the same work as ours; a peer that ships its own
GRPO loss also runs the `grpo` workload through it. `oracle.py` checks every peer's values and
gradients against a float64 computation before it is timed (a `wrong` row if it fails);
`fgrpo_kernels.reference` is that oracle's loss and is never a timed peer.

- `eager`: what a TRL user runs: `h @ W.T` in the input dtype (bf16 logits for bf16 inputs),
  TRL's `selective_log_softmax`, then the loss in plain PyTorch;
- `compile`: `torch.compile(dynamic=True)` of that pipeline (inductor);
- `liger_flce`: Liger's Triton `LigerFusedLinearCrossEntropyFunction`, log-probs = −loss per
  token (`reduction="none"`; Liger then recomputes the chunked logits in its backward to fold in
  the per-token gradient) — CUDA (or the Triton interpreter);
- `liger`: `LigerFusedLinearGRPOLoss(compiled=True)`, Liger's default; when dynamo fails on it
  the row becomes `liger (eager)` (compiled=False) and its note names the error;
  `liger_triton`: its Triton `triton_grpo_loss` on materialised logits (CUDA only);
- `cce`: Cut Cross-Entropy, log-probs = −`linear_cross_entropy(reduction="none")`: its
  `torch_compile` implementation on CPU, its Triton kernels (default gradient filtering) on CUDA;
- `trl`: TRL's `trl.kernels.ChunkedLogProbFunction` with the vocabulary chunk its GRPOTrainer
  uses (Triton on CUDA, PyTorch tiles elsewhere);
- `verl`: verl's torch fused path `FusedLinearForPPO` (512-token chunks, with the entropy);
  `verl_triton`: verl's Triton `linear_cross_entropy` (log-probs and entropy), CUDA only;
- `ours` (the defaults: the GRPO loss in a single pass where it fits) and `ours_two_pass`
  (single pass off: log-probs, then the loss, then the backward).

`Peer.floor_k` is the k of the FLOP floor k·N·H·V (report.py): 6 where the gradient is taken in
the forward or the logits are kept for the backward, 8 where the backward recomputes them.
A peer whose package is missing is an `unavailable` row naming its install line, never a crash.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import fgrpo_kernels
from fgrpo_kernels.core import reference

from .workload import (
    EPS,
    FGRPO_BETA,
    GRPO_BETA,
    VARIANT_OPTIONS,
    VARIANT_WORKLOADS,
    Workload,
    variant_of,
)

LogProbs = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Step = Callable[[Workload], torch.Tensor]
Build = Callable[[str], Step]
VERL_INSTALL = "pip install verl==0.9.1 in its own environment (README, Benchmarks)"


def _flat(fn: Callable) -> LogProbs:
    """Adapt a peer taking hidden [N, H] and ids [N] to the [B, T] workload."""
    return lambda h, w, y: fn(h.flatten(0, 1), w, y.flatten()).view(y.shape)


def eager_logprobs(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The TRL user's pipeline: logits `hidden @ weight.T` in the input dtype, then TRL's
    `selective_log_softmax` (fp32 out; the cast is exact)."""
    from trl.trainer.utils import selective_log_softmax

    return selective_log_softmax(hidden @ weight.T, ids).float()


def _eager_grpo(w: Workload) -> torch.Tensor:
    logps = eager_logprobs(w.hidden, w.weight, w.ids)
    return reference.grpo_loss(logps, None, w.ref_logps, w.advantages, w.mask, "dapo", GRPO_BETA)


def _eager_fgrpo(w: Workload) -> torch.Tensor:
    logps = eager_logprobs(w.hidden, w.weight, w.ids)
    return reference.fgrpo_loss(logps, w.ref_logps, w.advantages, w.mask, "pearson", FGRPO_BETA)


def _needs_trl(fn: Callable) -> Callable[[str], Callable]:
    def build(device: str) -> Callable:
        import trl.trainer.utils  # noqa: F401 — ImportError here: an `unavailable` row

        return fn

    return build


def _inductor_settings(device: str) -> None:
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)  # the graph-break notice
    if device == "cpu":  # NB: a compile-worker pool would outlive the CPU worker process
        import torch._inductor.config

        torch._inductor.config.compile_threads = 1


def _compiled(fn: Callable) -> Callable[[str], Callable]:
    def build(device: str) -> Callable:
        import trl.trainer.utils  # noqa: F401

        _inductor_settings(device)
        return torch.compile(fn, dynamic=True)

    return build


def _liger_flce_logprobs(device: str) -> LogProbs:
    from liger_kernel.ops.fused_linear_cross_entropy import (
        LigerFusedLinearCrossEntropyFunction as Fn,
    )

    # (input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing,
    #  reduction): loss per token = −log p(target)
    return _flat(lambda h, w, y: -Fn.apply(h, w, y, None, None, -100, 0.0, 0.0, "none")[0].float())


def _liger_grpo(compiled: bool) -> Build:
    def build(device: str) -> Step:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        if compiled:
            _inductor_settings(device)
        loss = LigerFusedLinearGRPOLoss(
            beta=GRPO_BETA, compiled=compiled, epsilon_low=EPS, epsilon_high=EPS,
            loss_type="dapo",
        )  # fmt: skip
        return lambda w: loss(
            w.hidden, w.weight, w.ids, w.mask, w.advantages, ref_per_token_logps=w.ref_logps
        )[0]

    return build


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


def _verl_triton_logprobs(device: str) -> LogProbs:
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

    # (hidden, weight, labels, temperature, reduction) → (log-probs, entropy), as verl's actor
    return _flat(lambda h, w, y: linear_cross_entropy(h, w, y, 1.0, "none")[0].float())


def _ours_grpo(max_chunk_bytes: int | None) -> Build:
    def build(device: str) -> Step:
        loss = fgrpo_kernels.FusedLinearGRPOLoss(
            "dapo", GRPO_BETA, EPS, EPS, max_chunk_bytes=max_chunk_bytes
        )
        return lambda w: loss(
            w.hidden, w.weight, w.ids, w.mask, w.advantages, ref_per_token_logps=w.ref_logps
        )[0]

    return build


def _ours_fgrpo(max_chunk_bytes: int | None) -> Build:
    def build(device: str) -> Step:
        loss = fgrpo_kernels.FusedLinearFGRPOLoss(
            "pearson", FGRPO_BETA, max_chunk_bytes=max_chunk_bytes
        )
        return lambda w: loss(
            w.hidden, w.weight, w.ids, w.mask, advantages=w.advantages,
            ref_per_token_logps=w.ref_logps,
        )[0]  # fmt: skip

    return build


def _ours_variant(workload: str) -> Build:
    mode, on_policy = variant_of(workload)

    def build(device: str) -> Step:
        from fgrpo_kernels.losses.policy import FusedLinearPolicyLoss

        loss = FusedLinearPolicyLoss(mode, **VARIANT_OPTIONS[mode])
        return lambda w: loss(
            w.hidden, w.weight, w.ids, w.mask, w.advantages,
            old_per_token_logps=None if on_policy else w.ref_logps, **w.variant_inputs(mode),
        )[0]  # fmt: skip

    return build


OURS_VARIANTS = {workload: _ours_variant(workload) for workload in VARIANT_WORKLOADS}


def _no_recompute(*workloads: str) -> Callable[[str, str], bool]:
    return lambda workload, device: workload in workloads


def _recomputes(workload: str, device: str) -> bool:
    return False


def _ours_saves(workload: str, device: str) -> bool:
    """Ours takes the loss's gradient in the forward (single pass) where the default buffer
    budget of the device is above 0; its log-prob primitive recomputes the logits."""
    from fgrpo_kernels.losses import single_pass

    # the variants run the two-pass path (no single pass for them yet)
    return workload in ("grpo", "fgrpo") and single_pass.DEFAULT_BYTES[device] > 0


@dataclass(frozen=True)
class Peer:
    """One implementation: its log-probs, its own losses (workload → build), its backend."""

    logprobs: Callable[[str], LogProbs] | None
    backend: Callable[[str], str]
    losses: dict[str, Build] = field(default_factory=dict)
    package: str | None = None  # the distribution that provides it (None: torch or this package)
    install: str | None = "pip install 'fgrpo-kernels[bench]'"  # the line that installs it
    devices: tuple[str, ...] = ("cpu", "cuda")
    compiles: bool = False  # pays a compile on its first call
    # (workload, device) → True when the backward needs no second logits GEMM (k = 6, not 8)
    keeps_grad: Callable[[str, str], bool] = _recomputes
    fallback: str | None = None  # the peer whose row replaces this one when dynamo fails
    interpreted: bool = False  # Triton only: runs on CPU tensors under TRITON_INTERPRET=1

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

    def floor_k(self, workload: str, pass_: str, device: str) -> int:
        """k of the FLOP floor k·N·H·V: 2 per logits GEMM (forward, recompute, dhidden,
        dweight) this peer must run."""
        if pass_ == "fwd":
            return 2
        grads = 2 if pass_ == "fwd+bwd-frozen" else 4
        return 2 + grads + (0 if self.keeps_grad(workload, device) else 2)

    def missing(self, error: ImportError) -> str:
        """The note of an `unavailable` row: what is missing and the line that installs it."""
        how = self.install or "see the README"
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


_EAGER = _no_recompute("logprobs", "grpo", "fgrpo")  # the [N, V] logits are kept for backward
PEERS: dict[str, Peer] = {
    "eager": Peer(
        _needs_trl(eager_logprobs), _fixed("torch"),
        {"grpo": _needs_trl(_eager_grpo), "fgrpo": _needs_trl(_eager_fgrpo)}, package="trl",
        keeps_grad=_EAGER,
    ),
    "compile": Peer(
        _compiled(eager_logprobs), _fixed("inductor"),
        {"grpo": _compiled(_eager_grpo), "fgrpo": _compiled(_eager_fgrpo)}, package="trl",
        compiles=True, keeps_grad=_EAGER,
    ),
    "liger_flce": Peer(
        _liger_flce_logprobs, _fixed("triton"), package="liger-kernel", devices=("cuda",),
        interpreted=True,
    ),
    "liger": Peer(
        None, _fixed("chunked torch, compiled"), {"grpo": _liger_grpo(True)},
        package="liger-kernel", compiles=True, keeps_grad=_no_recompute("grpo"),
        fallback="liger (eager)",
    ),
    "liger (eager)": Peer(
        None, _fixed("chunked torch"), {"grpo": _liger_grpo(False)}, package="liger-kernel",
        keeps_grad=_no_recompute("grpo"),
    ),
    "liger_triton": Peer(
        None, _fixed("triton on logits"), {"grpo": _liger_triton_grpo}, package="liger-kernel",
        devices=("cuda",), keeps_grad=_no_recompute("grpo"), interpreted=True,
    ),
    "cce": Peer(
        _cce_logprobs, _by_device("torch_compile", "triton"), package="cut-cross-entropy",
        compiles=True,
    ),
    "trl": Peer(_trl_logprobs, _by_device("chunked torch", "chunked triton"), package="trl"),
    # NB: no extra: verl 0.9.1 pins transformers < 5.11, and pip's downgrade next to TRL 1.16
    # leaves a `kernels` package that breaks `import transformers` (README, Benchmarks).
    "verl": Peer(_verl_logprobs, _fixed("chunked torch"), package="verl", install=VERL_INSTALL),
    "verl_triton": Peer(
        _verl_triton_logprobs, _fixed("triton"), package="verl", install=VERL_INSTALL,
        devices=("cuda",),
    ),
    "ours": Peer(
        lambda d: fgrpo_kernels.fused_linear_logprobs, _ours_backend,
        {"grpo": _ours_grpo(None), "fgrpo": _ours_fgrpo(None), **OURS_VARIANTS},
        keeps_grad=_ours_saves,
    ),
    "ours_two_pass": Peer(
        None, _ours_backend, {"grpo": _ours_grpo(0), "fgrpo": _ours_fgrpo(0)},
    ),
}  # fmt: skip

ORDER = tuple(PEERS)
