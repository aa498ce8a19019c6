"""Correctness half of bench/gpu_check.py: the cases, each checked against float64.

Every case is a `Problem` (shapes, dtypes, options) and a check returning rows of
(quantity, rel_err, floor, tol, ok). The reference runs on the same rounded inputs, upcast.
Tolerances: fp32 outputs (log-probs, entropy) 1e-5 relative and, per token, 1e-4 absolute or
1.5/τ times the measured accumulation floor of an H-long dot product (`ACCUMULATION_FLOOR`),
whichever is larger; a loss 1e-5 relative plus what that per-token tolerance allows it
(`loss_tolerance`); a bf16/fp16 gradient 4×/2× its floor (the exact gradient rounded to that
dtype; measured under the interpreter at H 4096: 2.4× for bf16, 1.0× for fp16); fp32 gradients
1e-5, or 1e-2 behind a bf16 dlogits strip; TF32 1e-2.

The `single_pass_*` cases run the fused GRPO loss (dapo, β 0.04, an entropy bonus so that
dL/dentropy reaches the row kernel) on the single pass — cuBLAS logits into the bounded buffer,
the row kernels, cuBLAS dh/dW — in several chunks (`chunk_rows`), against the float64 loss on
materialised logits, and check that the single pass ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

import fgrpo_kernels
from fgrpo_kernels import reference
from fgrpo_kernels.backends.triton import configs

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DT = {F32: "fp32", BF16: "bf16", F16: "fp16"}

# max |Δlogp| of bf16 logits accumulated in fp32 by tensor cores, modelled as 16-wide steps
# truncated toward zero (`bench/accumulation_floor.py`, rz_k16; N 64 × V 8192 × 2 seeds, τ 1):
#   python bench/accumulation_floor.py --H 520 4096 16384 --N 64 --V 8192 --seeds 2
# The IEEE floor (rne_k64: round to nearest per 64-wide block) is 1.1e-6, 1.4e-6, 1.9e-6; the
# 2026-12-04 H200 run measured 5e-6 (H 520), 4.7e-5 (H 4096, τ 1), 1.65e-4 (H 16384): the
# truncating model, not the IEEE floor, is what the hardware does.
ACCUMULATION_FLOOR = {520: 4.68e-6, 4096: 4.53e-5, 16384: 1.94e-4}


def accumulation_floor(H: int) -> float:
    """The measured floor at H, linear between (and beyond) the measured sizes."""
    keys = sorted(ACCUMULATION_FLOOR)
    lo = max([k for k in keys if k <= H] or keys[:1])
    hi = min([k for k in keys if k > lo] or keys[-1:])
    if hi == lo:
        return ACCUMULATION_FLOOR[lo] * H / lo
    f0, f1 = ACCUMULATION_FLOOR[lo], ACCUMULATION_FLOOR[hi]
    return f0 + (f1 - f0) * (H - lo) / (hi - lo)


def logp_abs_tolerance(p: Problem) -> float:
    """Per-token |Δlogp| allowed: 1e-4, or 1.5× the accumulation floor at H (logits scale 1/τ)."""
    return max(1e-4, 1.5 * accumulation_floor(p.H) / p.tau)


@dataclass(frozen=True)
class Problem:
    N: int
    H: int
    V: int
    dtype: torch.dtype = BF16
    wdtype: torch.dtype | None = None
    bias: bool = False
    tau: float = 1.0
    entropy: bool = True
    ignore_frac: float = 0.1
    g_scale: float = 1.0  # upstream gradients: g_scale · N(0, 1), or exactly g_scale if < 1e-3
    grads: tuple[bool, bool, bool] = (True, True, True)
    fast_fp32: bool = False
    batch: int = 0  # > 0: hidden [batch, N // batch, H], a strided (non-contiguous) view
    rows: int = 0  # > 0: compare only the first and last `rows` rows (N·H past 2^31)
    forced: dict = field(default_factory=dict)
    chunk_rows: int = 0  # single pass: rows per chunk (0: the default budget)

    def base(self, name: str) -> dict:
        wdt = self.wdtype or self.dtype
        return {"case": name, "dtype": DT[self.dtype], "weight_dtype": DT[wdt], "N": self.N,
                "H": self.H, "V": self.V, "bias": int(self.bias), "temperature": self.tau,
                "entropy": int(self.entropy)}  # fmt: skip


def make_inputs(p: Problem, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=dev)

    if p.batch:
        full = randn(p.batch, 2 * (p.N // p.batch), p.H).to(p.dtype)
        hidden = full[:, ::2]  # [B, T, H], every other position: not contiguous
    else:
        hidden = randn(p.N, p.H).to(p.dtype)
    weight = (randn(p.V, p.H) * (2.0 / p.H**0.5)).to(p.wdtype or p.dtype)
    bias = (randn(p.V) * 0.5).to(p.wdtype or p.dtype) if p.bias else None
    targets = torch.randint(0, p.V, hidden.shape[:-1], generator=g, device=dev)
    targets[torch.rand(targets.shape, generator=g, device=dev) < p.ignore_frac] = -100
    if p.g_scale < 1e-3:
        g_up = torch.full((2, *targets.shape), p.g_scale, device=dev)
    else:
        g_up = randn(2, *targets.shape) * p.g_scale
    return hidden, weight, bias, targets, g_up


def forward_backward(p: Problem, hidden, weight, bias, targets, g_up) -> dict:
    leaves = [None if t is None else t.detach().requires_grad_(r)
              for t, r in zip((hidden, weight, bias), p.grads, strict=True)]  # fmt: skip
    if hidden.dtype == torch.float64:
        fn, extra = reference.logprobs, {}
    else:
        fn, extra = fgrpo_kernels.fused_linear_logprobs, {"fast_fp32": p.fast_fp32}
    out = fn(leaves[0], leaves[1], targets, leaves[2], p.tau, return_entropy=p.entropy, **extra)
    logp, ent = out if p.entropy else (out, None)
    loss = (logp * g_up[0].to(logp.dtype)).sum()
    if p.entropy:
        loss = loss + (ent * g_up[1].to(ent.dtype)).sum()
    loss.backward()
    got = {"logp": logp, "entropy": ent}
    for name, t in zip(("d_hidden", "d_weight", "d_bias"), leaves, strict=True):
        got[name] = None if t is None or not t.requires_grad else t.grad
    return {k: v.detach() for k, v in got.items() if v is not None}


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def tolerance(p: Problem, quantity: str, dtype: torch.dtype, floor: float) -> float:
    if p.fast_fp32:
        return 1e-1 if quantity == "logp_max_abs" else 1e-2
    if quantity == "logp_max_abs":
        return logp_abs_tolerance(p)
    if dtype == F32:
        return 1e-5 if quantity in ("logp", "entropy", "loss") or p.dtype == F32 else 1e-2
    return (4.0 if dtype == BF16 else 2.0) * floor


def compare(p: Problem, got: dict, want: dict) -> list[dict]:
    rows = []
    for q, a in got.items():
        if q == "loss_kappa":
            continue
        b = want[q]
        if not float(b.double().norm()):  # all rows ignored: exactly zero
            err = float(a.double().abs().max()) if a.numel() else 0.0
            rows.append({"quantity": q, "rel_err": err, "floor": 0.0, "tol": 0.0,
                         "ok": int(err == 0.0)})  # fmt: skip
            continue
        floor = 0.0 if a.dtype == F32 else rel_err(b.to(a.dtype), b)
        err, tol = rel_err(a, b), tolerance(p, q, a.dtype, floor)
        rows.append({"quantity": q, "rel_err": err, "floor": floor, "tol": tol,
                     "ok": int(err <= tol)})  # fmt: skip
        if q == "loss" and "loss_kappa" in want:
            tol = loss_tolerance(p, float(want["loss_kappa"]))
            rows[-1] |= {"tol": tol, "ok": int(err <= tol)}
        if q == "logp":
            err = float((a.double() - b.double()).abs().max())
            tol = tolerance(p, "logp_max_abs", a.dtype, 0.0)
            floor = 0.0 if p.fast_fp32 else accumulation_floor(p.H) / p.tau
            rows.append({"quantity": "logp_max_abs", "rel_err": err, "floor": floor, "tol": tol,
                         "ok": int(err <= tol)})  # fmt: skip
    return rows


def check(p: Problem, dev) -> list[dict]:
    x = make_inputs(p, dev)
    with configs.forced(**p.forced):
        got = forward_backward(p, *x)
    hidden, weight, bias, targets, g_up = x
    if p.rows:  # N·H past 2^31: the float64 reference on the first and last rows only
        rows = []
        for label, sl in (("first", slice(0, p.rows)), ("last", slice(p.N - p.rows, p.N))):
            sub = replace(p, N=p.rows, grads=(True, False, False))
            ref = (hidden[sl].double(), weight.double(), None if bias is None else bias.double())
            want = forward_backward(sub, *ref, targets[sl], g_up[:, sl])
            part = {q: got[q][sl] for q in ("logp", "entropy", "d_hidden") if q in got}
            rows += [r | {"quantity": f"{r['quantity']}_{label}_rows"}
                     for r in compare(sub, part, want)]  # fmt: skip
        return rows
    ref = [hidden.double(), as_multiplied(weight, hidden.dtype, dev), bias]
    want = forward_backward(p, *[None if t is None else t.double() for t in ref], targets, g_up)
    return compare(p, got, want)


def loss_tolerance(p: Problem, kappa: float) -> float:
    """A loss's relative tolerance: 1e-5, plus κ times the per-token log-prob tolerance, κ =
    (Σ|∂L/∂logp| + Σ|∂L/∂entropy|) / |L| from the float64 reference: to first order an absolute
    error δ on every log-prob and entropy moves L by at most κ·δ relative. NB: a KL-dominated
    GRPO loss (β·e^(ref − logp), logp ≈ −14 at V 151936) has κ ≈ 1: its relative error is the
    log-probs' weighted mean absolute error, which 1e-5 alone does not allow."""
    return 1e-5 + kappa * logp_abs_tolerance(p)


def as_multiplied(weight, dtype: torch.dtype, dev):
    """The weight as the kernels multiply it: converted to hidden's dtype (as under autocast),
    rounding to nearest on a GPU. NB: the interpreter (Triton 3.9) truncates fp32 → bf16."""
    if weight.dtype == dtype or dtype == F32:
        return weight
    if dev.type == "cpu" and dtype == BF16:
        return (weight.float().view(torch.int32) & ~0xFFFF).view(torch.float32)
    return weight.to(dtype)


def grpo_single_pass(p: Problem, hidden, weight, bias, targets, max_chunk_bytes):
    """(outputs, module) of the fused GRPO loss fwd+bwd on hidden [N, H] as B = 8 rows (mask:
    the non-ignored targets); float64 inputs run the reference on materialised logits."""
    B = 8
    T = p.N // B
    dev = hidden.device
    g = torch.Generator(device=dev).manual_seed(5)
    mask = targets.reshape(B, T) != -100
    ids = torch.where(mask, targets.reshape(B, T), 0)
    ref = -4.0 * torch.rand(B, T, generator=g, device=dev)
    old = ref + 0.3 * torch.randn(B, T, generator=g, device=dev)
    adv = torch.linspace(-1.0, 1.0, B, device=dev)
    opts = {"loss_type": "dapo", "beta": 0.04, "entropy_coef": 0.01}
    leaves = [
        None if t is None else t.detach().requires_grad_(True) for t in (hidden, weight, bias)
    ]
    h = leaves[0].reshape(B, T, p.H)
    if hidden.dtype == torch.float64:
        logp, ent = reference.logprobs(h, leaves[1], ids, leaves[2], p.tau, return_entropy=True)
        logp.retain_grad()
        ent.retain_grad()
        loss = reference.grpo_loss(logp, old, ref, adv, mask, entropy=ent, **opts)
        module = None
    else:
        module = fgrpo_kernels.FusedLinearGRPOLoss(
            temperature=p.tau, max_chunk_bytes=max_chunk_bytes, **opts
        )
        loss, _ = module(h, leaves[1], ids, mask, adv, leaves[2], ref_per_token_logps=ref,
                         old_per_token_logps=old)  # fmt: skip
    loss.backward()
    got = {"loss": loss.detach()}
    for name, t in zip(("d_hidden", "d_weight", "d_bias"), leaves, strict=True):
        if t is not None:
            got[name] = t.grad
    if module is None:  # the loss's sensitivity to absolute log-prob errors (`loss_tolerance`)
        total = logp.grad.abs().sum() + ent.grad.abs().sum()
        got["loss_kappa"] = (total / loss.detach().abs().clamp_min(1e-30)).detach()
    return got, module


def single_pass(p: Problem, dev) -> list[dict]:
    hidden, weight, bias, targets, _ = make_inputs(p, dev)
    if p.chunk_rows:
        from fgrpo_kernels.backends.triton import bytes_per_row

        budget = p.chunk_rows * bytes_per_row(hidden, p.V)
    else:
        budget = None
    got, module = grpo_single_pass(p, hidden, weight, bias, targets, budget)
    ref = [hidden.double(), as_multiplied(weight, hidden.dtype, dev).double(),
           None if bias is None else bias.double()]  # fmt: skip
    want, _ = grpo_single_pass(p, *ref, targets, None)
    ran = module.last_pass == "single"
    return compare(p, got, want) + [{"quantity": "single_pass_ran", "rel_err": float(not ran),
                                     "floor": 0.0, "tol": 0.0, "ok": int(ran)}]  # fmt: skip


def determinism(p: Problem, dev) -> list[dict]:
    x = make_inputs(p, dev, seed=3)
    runs = [forward_backward(p, *x) for _ in range(2)]
    same = all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    return [{"quantity": "bitwise_equal", "rel_err": 0.0 if same else 1.0, "floor": 0.0,
             "tol": 0.0, "ok": int(same)}]  # fmt: skip


def cases(tiny: bool) -> dict:
    """name -> (Problem, check function). Full sizes on a GPU; toy sizes for the dry run."""
    mid = (37, 45, 301) if tiny else (333, 520, 5003)
    big = (24, 64, 300) if tiny else (4096, 4096, 151936)
    P = Problem
    out = {
        "realistic_bf16": P(*big, tau=0.7),
        "fp16_small_g": P(*((40, 33, 250) if tiny else (1024, 4096, 32000)), F16, g_scale=1e-5),
        "vh_past_2_31": P(*((3, 16, 290) if tiny else (64, 16384, 151936)), bias=True),
        "nh_past_2_31": P(*((40, 16, 64) if tiny else ((1 << 19) + 37, 4096, 8192)), bias=True,
                          grads=(True, False, False), rows=8 if tiny else 64),
        "single_token": P(1, *big[1:], bias=True),
        "all_ignored": P(*mid, bias=True, ignore_frac=1.0),
        "non_contiguous_3d": P(36 if tiny else 400, *mid[1:], tau=0.7, batch=4),
        "fp32": P(*mid, F32, bias=True, tau=0.7),
        "tf32": P(*mid, F32, bias=True, fast_fp32=True),
        "fp16": P(*mid, F16, tau=0.7),
        "bf16_fp32_weight": P(*mid, BF16, F32, bias=True),
        "bf16_frozen_weight": P(*mid, bias=True, grads=(True, False, True)),
    }  # fmt: skip
    tiles = {"chunk": 16 if tiny else 128, "wave": 64 if tiny else 1024}
    for order in (True, False):
        name = f"tiles_{'rows' if order else 'cols'}_outer"
        out[name] = P(*mid, bias=True, tau=1.3, forced=tiles | {"rows_outer": order})
    for c in configs.CANDIDATES[("fwd", "lowp")]:
        name = f"candidate_{c.block_n}x{c.block_v}x{c.block_k}_w{c.num_warps}_s{c.num_stages}"
        out[name] = P(*mid, bias=True, tau=0.9, forced={"config": c})
    checks = {name: (p, check) for name, p in out.items()}
    checks["determinism"] = (P(*mid, bias=True, tau=0.9), determinism)
    # the single pass: the realistic batch in the default ~1 GiB buffer (4 chunks of 1178 rows),
    # fp32 (in-place dlogits) and fp16 (scaled dlogits) in several small chunks
    mid8 = (40 if tiny else 336, *mid[1:])
    checks["single_pass_bf16"] = (P(*big, tau=0.7, chunk_rows=7 if tiny else 0), single_pass)
    checks["single_pass_fp32"] = (P(*mid8, F32, bias=True, chunk_rows=13 if tiny else 97),
                                  single_pass)  # fmt: skip
    checks["single_pass_fp16"] = (P(*mid8, F16, tau=1.3, chunk_rows=13 if tiny else 97),
                                  single_pass)  # fmt: skip
    return checks
