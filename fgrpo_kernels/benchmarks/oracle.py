"""The oracle every peer row is checked against before it is timed.

A peer runs its step on the first tokens of every completion of the case (`Workload.head`: the
same B, H, V, lm_head and code path, at most `CHECK_TOKENS` tokens), forward and, for the
backward passes, backward. A float64 computation from materialised logits (log_softmax, then
`fgrpo_kernels.reference`'s losses) gives the same quantities. The check compares the output
(per-token log-probs, or the loss), dhidden and dweight by relative L2 error
‖peer − oracle‖ / ‖oracle‖ against the tolerance of the case's dtype (`TOLERANCE`): bf16 and
fp16 pipelines that round the logits to the input dtype differ from float64 by ~1e-3, a wrong
sign, scale or missing term by O(1). A row that fails is `wrong`, and is not timed.
"""

from __future__ import annotations

import math

import torch

from fgrpo_kernels.core import reference

from .workload import (
    FGRPO_BETA,
    GRPO_BETA,
    VARIANT_OPTIONS,
    VARIANT_WORKLOADS,
    Workload,
    run_step,
    variant_of,
)

CHECK_TOKENS = 512
# dtype → (output, gradients) tolerance, relative L2 error against float64
TOLERANCE = {"float32": (1e-4, 1e-3), "bfloat16": (1e-2, 2e-2), "float16": (3e-3, 1e-2)}
QUANTITIES = ("out", "dhidden", "dweight")
# M2PO's clip bound is one token's own |Δ| by construction: which side of the clip that token
# falls on is a coin-flip of the last bit, and its gradient with it. Its loss is checked here;
# its gradients are checked in tests/test_policy_fused.py with the head's own log-prob values.
VALUES_ONLY = ("policy:m2po",)


def float64(w: Workload, workload: str, pass_: str) -> dict[str, torch.Tensor]:
    """The oracle's output, dhidden and dweight (as the pass takes them) on `w`, in float64."""
    h = w.hidden.detach().double().requires_grad_(pass_ != "fwd")
    W = w.weight.detach().double().requires_grad_(pass_ == "fwd+bwd")
    with torch.set_grad_enabled(pass_ != "fwd"):
        logps = torch.log_softmax(h @ W.T, -1).gather(-1, w.ids[..., None])[..., 0]
        ref, adv, mask = w.ref_logps.double(), w.advantages.double(), w.mask.double()
        if workload == "grpo":
            out = reference.grpo_loss(logps, None, ref, adv, mask, "dapo", GRPO_BETA)
        elif workload == "fgrpo":
            out = reference.fgrpo_loss(logps, ref, adv, mask, "pearson", FGRPO_BETA)
        elif workload in VARIANT_WORKLOADS:
            out = _variant(workload, w, logps, ref, adv, mask)
        elif workload == "logprobs":
            out = logps
        else:
            raise ValueError(f"workload: expected logprobs, grpo or fgrpo; got {workload!r}")
    result = {"out": out.detach()}
    if pass_ != "fwd":
        out.backward(None if out.dim() == 0 else w.grad_logp.double())
        result["dhidden"] = h.grad
        if pass_ == "fwd+bwd":
            result["dweight"] = W.grad
    return result


def _variant(workload: str, w: Workload, logps, old, adv, mask) -> torch.Tensor:
    """The variant's loss with the reference log-probs as the old ones (on-policy: the current
    ones, detached)."""
    from fgrpo_kernels.losses.policy import VARIANTS

    mode, on_policy = variant_of(workload)
    old = logps.detach() if on_policy else old  # as the module takes no old log-probs
    inputs = {k: v.double() for k, v in w.variant_inputs(mode).items()}
    return VARIANTS[mode].fn(logps, old, adv, mask, **VARIANT_OPTIONS[mode], **inputs)[0]


def rel_err(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> float:
    """‖got − want‖₂ / max(‖want‖₂, floor) (the absolute norm when both are 0); inf for a shape
    mismatch or a non-finite value."""
    if got is None or got.shape != want.shape:
        return math.inf
    got = got.detach().double()
    if not torch.isfinite(got).all():
        return math.inf
    scale = max(float(want.norm()), floor)
    return float((got - want).norm()) / (scale if scale > 0 else 1.0)


def check(step, w: Workload, workload: str, pass_: str, dtype: str) -> tuple[bool, dict, str]:
    """Run `step` on the head of `w` and compare it with the float64 oracle: (ok, errors by
    quantity, a note). Leaves no gradient on `w`."""
    head = w.head(CHECK_TOKENS)
    try:
        out = run_step(step, head, pass_)
        got = {"out": out, "dhidden": head.hidden.grad, "dweight": w.weight.grad}
        want = float64(head, workload, pass_)
    finally:
        w.zero_grad()
    checked = ("out",) if workload in VALUES_ONLY else QUANTITIES
    # On-policy a sequence-ratio loss is −mean_i(a_i)·1, 0 on the group's zero-mean advantages:
    # its value's error is read against mean |a_i|, the size of one sequence's term.
    on_policy = workload in VARIANT_WORKLOADS and variant_of(workload)[1]
    floors = {"out": float(head.advantages.abs().mean()) if on_policy else 0.0}
    errors = {q: rel_err(got[q], want[q], floors.get(q, 0.0)) for q in checked if q in want}
    tol_out, tol_grad = TOLERANCE[dtype]
    bad = [
        f"{q} {e:.3g} > {tol_out if q == 'out' else tol_grad:g}"
        for q, e in errors.items()
        if not e <= (tol_out if q == "out" else tol_grad)
    ]
    text = ", ".join(f"{q} {e:.2g}" for q, e in errors.items())
    if bad:
        return False, errors, f"against the float64 oracle: {', '.join(bad)} (rel L2 error)"
    return True, errors, text
