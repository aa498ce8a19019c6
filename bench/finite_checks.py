"""CPU cost of the argument checks on values (docs/math.md §6): the finiteness of advantages
and given log-probs, and the 0/1 mask, against one fused GRPO forward+backward.

N = 8192 tokens (B 8 × T 1024), H 128, V 32768, fp32, C++ backend; the loss call's two
versions interleaved, median of 7 each after a warm-up.
Prints JSON: the checks alone (ms), the loss call with and without them (ms), and their share.
The GPU cost (a host sync per tensor) is not measured here.

    python bench/finite_checks.py
"""

import json
import os
import statistics
import time
from unittest import mock

os.environ.setdefault("FGRPO_BACKEND", "cpu")
os.environ.setdefault("FGRPO_CPU_BACKEND", "cpp")

import torch  # noqa: E402

import fgrpo_kernels as fk  # noqa: E402
from fgrpo_kernels.core import validation as check  # noqa: E402

B, T, H, V = 8, 1024, 128, 32768
ROUNDS = 7


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_ms(fn, rounds: int) -> float:
    fn()
    return 1e3 * statistics.median(seconds(fn) for _ in range(rounds))


def main():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(B, T, H, generator=g, requires_grad=True)
    w = (torch.randn(V, H, generator=g) * 0.05).requires_grad_()
    ids = torch.randint(0, V, (B, T), generator=g)
    mask, adv = torch.ones(B, T), torch.randn(B, generator=g)
    mask[:, 900:] = 0
    ref, old = torch.randn(B, T, generator=g) - 8, torch.randn(B, T, generator=g) - 8
    module = fk.FusedLinearGRPOLoss(beta=0.04)

    def loss_call():
        module(h, w, ids, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old)[0].backward()

    def checks():
        check.mask("completion_mask", mask, (B, T))
        check.per_row("advantages", adv, B)
        check.per_token_logps("ref_per_token_logps", ref, mask)
        check.per_token_logps("old_per_token_logps", old, mask)

    shape_only = check.tensor

    def unchecked():
        with (
            mock.patch.object(check, "finite", lambda *a, **k: None),
            mock.patch.object(check, "mask", lambda arg, m, shape: shape_only(arg, m, shape=shape)),
        ):
            loss_call()

    loss_call(), unchecked()  # warm-up
    timed = {"with": [], "without": []}
    for _ in range(ROUNDS):  # interleaved: a shared machine's drift hits both alike
        timed["with"].append(seconds(loss_call))
        timed["without"].append(seconds(unchecked))
    with_checks = 1e3 * statistics.median(timed["with"])
    without = 1e3 * statistics.median(timed["without"])
    alone = median_ms(checks, rounds=51)
    out = {
        "shape": f"N {B * T} (B {B} x T {T}), H {H}, V {V}, fp32",
        "threads": torch.get_num_threads(),
        "checks_alone_ms": round(alone, 3),
        "loss_fwd_bwd_ms_with_checks": round(with_checks, 1),
        "loss_fwd_bwd_ms_without": round(without, 1),
        "checks_share_of_loss_call": f"{alone / with_checks:.2%}",
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
