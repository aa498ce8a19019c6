"""Timing half of bench/gpu_check.py: the implementations it times and how.

Each implementation is `make(hidden, weight, targets) -> step`, where `step()` runs one forward
(returning the per-token log-probs, with grad, or a loss) and `measure` runs the backward of
Σ g·logp (or of the loss), timing forward and backward separately with CUDA events (wall clock
on a CPU) and reading the peak memory beyond the inputs. The GRPO loss rows (dapo, β 0.04,
B = 8 completions) compare the single pass (gradients formed in the forward, ~1 GiB logits
buffer) with the two-pass path (max_chunk_bytes=0) and Liger's chunked GRPO loss; their floor is
6·N·H·V, the FLOPs of a loss whose dL/dlogp is known in the forward. `timing_plan` orders the
rows by priority; `time_row` measures one, with the FLOP floor at the GEMM rate `gemm_ceiling`
measured for the same N.
"""

from __future__ import annotations

import importlib.util
import statistics
import time

import torch

import fgrpo_kernels
from fgrpo_kernels.backends.triton import autotune


def ours(hidden, weight, targets):
    return lambda: fgrpo_kernels.fused_linear_logprobs(hidden, weight, targets)


def eager_logprobs(hidden, weight, targets):
    """What a plain PyTorch pipeline does: bf16 logits [N, V], log-softmax in fp32, gather."""
    logits = (hidden @ weight.T).float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, targets.clamp_min(0)[:, None])[:, 0]


def eager(hidden, weight, targets):
    return lambda: eager_logprobs(hidden, weight, targets)


def compiled(hidden, weight, targets, backend="inductor"):
    fn = torch.compile(eager_logprobs, backend=backend, dynamic=False)
    return lambda: fn(hidden, weight, targets)


def liger(hidden, weight, targets):
    """Liger-Kernel's fused linear cross-entropy, per token (logp = −CE), grads in fp32."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    def step():
        ce = liger_fused_linear_cross_entropy(
            hidden, weight, targets, reduction="none", accum_dtype=torch.float32
        )
        return -ce

    return step


def cut_cross_entropy(hidden, weight, targets):
    """Apple's Cut Cross-Entropy, per token, its default gradient filter (filter_eps="high")."""
    from cut_cross_entropy import linear_cross_entropy

    return lambda: -linear_cross_entropy(hidden, weight, targets, reduction="none")


def _grpo_batch(hidden, targets):
    B = 8 if len(hidden) % 8 == 0 else 1
    dev = hidden.device
    g = torch.Generator(device=dev).manual_seed(13)
    T = len(hidden) // B
    ref = -4.0 * torch.rand(B, T, generator=g, device=dev)
    adv = torch.linspace(-1.0, 1.0, B, device=dev)
    return hidden.view(B, T, -1), targets.view(B, T), torch.ones(B, T, device=dev), adv, ref


def grpo(max_chunk_bytes):
    def make(hidden, weight, targets):
        module = fgrpo_kernels.FusedLinearGRPOLoss("dapo", 0.04, max_chunk_bytes=max_chunk_bytes)
        h, ids, mask, adv, ref = _grpo_batch(hidden, targets)
        return lambda: module(h, weight, ids, mask, adv, ref_per_token_logps=ref)[0]

    return make


def liger_grpo(hidden, weight, targets):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    module = LigerFusedLinearGRPOLoss(beta=0.04, loss_type="dapo")
    h, ids, mask, adv, ref = _grpo_batch(hidden, targets)
    return lambda: module(h, weight, ids, mask, adv, ref_per_token_logps=ref)[0]


IMPLS = {
    "ours": ours,
    "ours_grpo_single": grpo(None),
    "ours_grpo_two_pass": grpo(0),
    "liger_grpo": liger_grpo,
    "eager": eager,
    "liger": liger,
    "cut_cross_entropy": cut_cross_entropy,
    "torch_compile": compiled,
}
NEEDS_CUDA = ("liger", "liger_grpo", "cut_cross_entropy")
IMPORTS = {"liger": "liger_kernel", "liger_grpo": "liger_kernel",
           "cut_cross_entropy": "cut_cross_entropy"}  # fmt: skip


def _clock(dev: torch.device):
    """start() -> token, stop(token) -> ms: CUDA events on a GPU, perf_counter on a CPU."""
    if dev.type == "cuda":

        def start():
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev

        def stop(ev):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return ev.elapsed_time(end)

        return start, stop
    t0 = time.perf_counter
    return t0, lambda t: (time.perf_counter() - t) * 1e3


def measure(step, leaves, g_up, dev, iters: int, backward: bool) -> dict:
    """First call (compile, autotune) timed alone; then `iters` rounds of forward and backward,
    medians in ms; peak memory beyond what was allocated before the first timed round (GiB)."""
    start, stop = _clock(dev)

    def one():
        for t in leaves:
            t.grad = None
        t0 = start()
        logp = step()
        fwd = stop(t0)
        if not backward:
            return fwd, 0.0
        t1 = start()
        (logp if logp.dim() == 0 else (logp.float() * g_up).sum()).backward()
        return fwd, stop(t1)

    t0 = time.perf_counter()
    with torch.set_grad_enabled(backward):
        one()
        first_s = time.perf_counter() - t0
        if dev.type == "cuda":
            for t in leaves:
                t.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        runs = [one() for _ in range(iters)]
    row = {
        "first_call_s": first_s,
        "fwd_ms": statistics.median(r[0] for r in runs),
        "bwd_ms": statistics.median(r[1] for r in runs) if backward else "",
    }
    if dev.type == "cuda":
        row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return row


def gemm_ceiling(N, H, V, dev, iters: int) -> dict:
    """A plain cuBLAS bf16 [N, H] @ [H, V] (bf16 out): the practical rate of this shape."""
    g = torch.Generator(device=dev).manual_seed(7)
    a = torch.randn(N, H, generator=g, device=dev).to(torch.bfloat16)
    b = torch.randn(V, H, generator=g, device=dev).to(torch.bfloat16)
    start, stop = _clock(dev)
    torch.mm(a, b.T)
    times = []
    for _ in range(iters):
        t0 = start()
        torch.mm(a, b.T)
        times.append(stop(t0))
    ms = statistics.median(times)
    return {"fwd_ms": ms, "tflops": 2 * N * H * V / ms / 1e9}


def tuned_configs() -> str:
    """The tiles autotuning picked so far, one `kind:BNxBVxBK/warps/stages` per key."""
    out = []
    for key, c in autotune.chosen().items():
        out.append(f"{key[0]}:{c.block_n}x{c.block_v}x{c.block_k}/w{c.num_warps}/s{c.num_stages}")
    return " ".join(sorted(set(out)))


# (pass, FLOPs as a multiple of N·H·V, grads of (hidden, weight))
PASSES = {"fwd+bwd": (8, (True, True)), "fwd+bwd frozen_w": (6, (True, False)),
          "fwd no_grad": (2, None), "loss fwd+bwd": (6, (True, True))}  # fmt: skip
LOSS_IMPLS = ("ours_grpo_single", "ours_grpo_two_pass", "liger_grpo")
KEEPS_LOGITS = ("eager", "torch_compile")  # the backward reads the kept [N, V] logits
RECOMPUTES = ("ours_grpo_two_pass",)  # a loss whose backward recomputes the logits


def floor_k(impl: str, pass_: str) -> int:
    """k of the floor k·N·H·V: 2 per logits GEMM the impl must run (forward, a recompute in
    the backward, dhidden, dweight); the table's default for the pass otherwise."""
    k = PASSES[pass_][0]
    if impl in KEEPS_LOGITS and pass_ in ("fwd+bwd", "fwd+bwd frozen_w"):
        return k - 2
    if impl in RECOMPUTES and pass_ == "loss fwd+bwd":
        return k + 2
    return k


def timing_plan(tiny: bool) -> list[tuple[str, str, int]]:
    """(impl, pass, N) in priority order: what matters most runs first."""
    sizes = (8, 16) if tiny else (8192, 32768, 65536)
    plan = [("gemm_ceiling", "gemm", n) for n in sizes[:1]]
    plan += [
        (impl, "fwd+bwd", sizes[0]) for impl in ("ours", "eager", "liger", "cut_cross_entropy")
    ]
    plan += [(impl, "loss fwd+bwd", sizes[0]) for impl in LOSS_IMPLS]
    plan += [("ours", "fwd+bwd frozen_w", sizes[0]), ("ours", "fwd no_grad", sizes[0])]
    for n in sizes[1:]:
        plan += [("gemm_ceiling", "gemm", n), ("ours", "fwd+bwd", n)]
        plan += [(impl, "fwd+bwd", n) for impl in ("liger", "cut_cross_entropy", "eager")]
        plan += [(impl, "loss fwd+bwd", n) for impl in LOSS_IMPLS[:2]]
    plan += [("torch_compile", "fwd+bwd", sizes[0])]
    return plan


def time_row(impl: str, pass_: str, N: int, H: int, V: int, dev, iters: int, rates: dict,
             tiny: bool) -> list[dict]:  # fmt: skip
    if impl == "gemm_ceiling":
        row = gemm_ceiling(N, H, V, dev, iters)
        rates[N] = row["tflops"] * 1e12
        return [row | {"total_ms": row["fwd_ms"]}]
    g = torch.Generator(device=dev).manual_seed(11)
    hidden = torch.randn(N, H, generator=g, device=dev).to(torch.bfloat16)
    weight = (torch.randn(V, H, generator=g, device=dev) * (2.0 / H**0.5)).to(torch.bfloat16)
    targets = torch.randint(0, V, (N,), generator=g, device=dev)
    g_up = torch.randn(N, generator=g, device=dev)
    factor, grads = floor_k(impl, pass_), PASSES[pass_][1]
    leaves = [
        hidden.requires_grad_(grads is not None),
        weight.requires_grad_(bool(grads and grads[1])),
    ]
    # the dry run compiles with the eager backend: its control flow, not inductor's C++ build
    extra = {"backend": "eager"} if impl == "torch_compile" and tiny else {}
    step = IMPLS[impl](hidden, weight, targets, **extra)
    row = measure(step, [t for t in leaves if t.requires_grad], g_up, dev, iters,
                             backward=grads is not None)  # fmt: skip
    total = row["fwd_ms"] + (row["bwd_ms"] or 0.0)
    row["total_ms"] = total
    row["tflops"] = factor * N * H * V / total / 1e9
    if N in rates:
        row["floor_ms"] = factor * N * H * V / rates[N] * 1e3
        row["ratio_to_floor"] = total / row["floor_ms"]
    if impl.startswith("ours"):
        row["config"] = tuned_configs()
    return [row]


def unavailable(impl: str, dev) -> str | None:
    """Why a baseline cannot run here (a status), or None."""
    if impl in IMPORTS and importlib.util.find_spec(IMPORTS[impl]) is None:
        return "not installed"
    if impl in NEEDS_CUDA and dev.type != "cuda":
        return "skipped (needs CUDA)"
    return None
