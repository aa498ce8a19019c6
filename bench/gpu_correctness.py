"""Correctness half of bench/gpu_check.py: the cases, each checked against float64.

Every case is a `Problem` (shapes, dtypes, options) and a check returning rows of
(quantity, rel_err, floor, tol, ok). The reference runs on the same rounded inputs, upcast.
Tolerances: fp32 outputs (log-probs, entropy) 1e-5 relative and 1e-4 absolute per token; a
bf16/fp16 gradient 4×/2× its floor (the exact gradient rounded to that dtype; measured under
the interpreter at H 4096: 2.4× for bf16, 1.0× for fp16); fp32 gradients 1e-5, or 1e-2 behind
a bf16 dlogits strip; TF32 1e-2.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

import fgrpo_kernels
from fgrpo_kernels import reference
from fgrpo_kernels.kernels import configs

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DT = {F32: "fp32", BF16: "bf16", F16: "fp16"}


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
        return 1e-4
    if dtype == F32:
        return 1e-5 if quantity in ("logp", "entropy") or p.dtype == F32 else 1e-2
    return (4.0 if dtype == BF16 else 2.0) * floor


def compare(p: Problem, got: dict, want: dict) -> list[dict]:
    rows = []
    for q, a in got.items():
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
        if q == "logp":
            err = float((a.double() - b.double()).abs().max())
            tol = tolerance(p, "logp_max_abs", a.dtype, 0.0)
            rows.append({"quantity": "logp_max_abs", "rel_err": err, "floor": 0.0, "tol": tol,
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


def as_multiplied(weight, dtype: torch.dtype, dev):
    """The weight as the kernels multiply it: converted to hidden's dtype (as under autocast),
    rounding to nearest on a GPU. NB: the interpreter (Triton 3.9) truncates fp32 → bf16."""
    if weight.dtype == dtype or dtype == F32:
        return weight
    if dev.type == "cpu" and dtype == BF16:
        return (weight.float().view(torch.int32) & ~0xFFFF).view(torch.float32)
    return weight.to(dtype)


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
    return checks
