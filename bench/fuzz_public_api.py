"""Fuzz the public API with bad or extreme inputs and classify what each one gets.

    python bench/fuzz_public_api.py [--backend cpp|torch|triton] [--out table.md] [-k SUBSTR]

~110 cases through `fused_linear_logprobs`, every `FusedLinear*` module, the `reference`
functions and the raw ops `torch.ops.fgrpo.*`. Each outcome is one of

- `error`: a ValueError or TypeError whose message starts with an argument's name (or, where a
  case says so, another clear message, e.g. "higher-order gradients are not supported");
- `correct`: the values and the gradients of hidden, weight and bias match a float64 oracle
  (materialised logits, written here independently of the package) within the dtype's
  tolerance; non-finite oracle entries must be matched exactly;
- `nan`: NaN or inf where the oracle is finite (including the metrics of a module);
- `wrong`: finite but off, or a value where an error was due;
- `crash`: any other exception (an unnamed message, a RuntimeError from deep inside).

Each case also states what it expects (`error`, `value`, or `any` of the two), and the table
marks the outcomes that miss it. `--backend` picks the path of the primitive and the modules
(`cpp` and `torch` are the CPU backends, `triton` the Triton kernels under TRITON_INTERPRET=1);
the reference cases and the raw ops do not depend on it.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field


def _set_backend(argv: list[str]) -> str:
    """Environment before torch/triton are imported (TRITON_INTERPRET is read at import)."""
    backend = "cpp"
    for i, arg in enumerate(argv):
        if arg == "--backend" and i + 1 < len(argv):
            backend = argv[i + 1]
        elif arg.startswith("--backend="):
            backend = arg.split("=", 1)[1]
    os.environ["FGRPO_BACKEND"] = "triton" if backend == "triton" else "cpu"
    os.environ["FGRPO_CPU_BACKEND"] = "torch" if backend == "torch" else "cpp"
    if backend == "triton":
        os.environ["TRITON_INTERPRET"] = "1"
    return backend


BACKEND = _set_backend(sys.argv) if __name__ == "__main__" else None

import torch  # noqa: E402

import fgrpo_kernels as fk  # noqa: E402
from fgrpo_kernels import reference  # noqa: E402

INF = float("inf")
NAMED = re.compile(r"^[A-Za-z_][\w.]*(, [A-Za-z_][\w.]*)*:")
TOL = {torch.float32: 1e-5, torch.float64: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


@dataclass
class Outcome:
    kind: str  # error | correct | nan | wrong | crash
    detail: str = ""


@dataclass
class Case:
    name: str
    group: str
    what: str
    expect: str  # error | value | any
    run: Callable[[], Outcome]
    error_ok: str | None = None  # another accepted error message (regex)


@dataclass
class Result:
    case: Case
    outcome: Outcome
    seconds: float = 0.0
    as_expected: bool = field(init=False)

    def __post_init__(self):
        kind, expect = self.outcome.kind, self.case.expect
        self.as_expected = (
            (expect == "error" and kind == "error")
            or (expect == "value" and kind == "correct")
            or (expect == "any" and kind in ("error", "correct"))
        )


def classify_exception(error: BaseException, error_ok: str | None) -> Outcome:
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    detail = f"{type(error).__name__}: {message}"[:160]
    if isinstance(error, (ValueError, TypeError)) and NAMED.match(message):
        return Outcome("error", detail)
    if error_ok is not None and re.search(error_ok, str(error)):
        return Outcome("error", detail)
    return Outcome("crash", detail)


# ----------------------------------------------------------------------------- comparison


def compare(name: str, got, want, tol: float) -> Outcome | None:
    """None when `got` matches `want`; else the outcome ("nan" or "wrong") and why."""
    if got is None and want is None:
        return None
    if want is None:
        want = torch.zeros_like(got)
    if got is None:
        got = torch.zeros_like(want)
    if tuple(got.shape) != tuple(want.shape):
        return Outcome("wrong", f"{name}: shape {list(got.shape)} vs {list(want.shape)}")
    g, w = got.detach().double(), want.detach().double()
    w_fin, g_fin = torch.isfinite(w), torch.isfinite(g)
    if bool((w_fin & ~g_fin).any()):
        n = int((w_fin & ~g_fin).sum())
        return Outcome("nan", f"{name}: {n}/{g.numel()} non-finite where the oracle is finite")
    odd = ~w_fin
    if bool(odd.any()):
        same = (g[odd] == w[odd]) | (torch.isnan(g[odd]) & torch.isnan(w[odd]))
        if not bool(same.all()):
            return Outcome("wrong", f"{name}: differs where the oracle is not finite")
    g, w = g[w_fin], w[w_fin]
    if g.numel() == 0:
        return None
    floor = 0.1 * math.sqrt(g.numel())
    err = float((g - w).norm() / max(float(w.norm()), floor))
    if not err <= tol:
        return Outcome("wrong", f"{name}: rel err {err:.2e}")
    return None


def compare_all(pairs, tol: float) -> Outcome:
    worst = None
    for name, got, want in pairs:
        out = compare(name, got, want, tol)
        if out is not None and (worst is None or (out.kind == "nan" and worst.kind != "nan")):
            worst = out
    return worst or Outcome("correct")


# ----------------------------------------------------------------------------- the oracle


def oracle_logprobs(h, w, y, b, tau, ignore_index, entropy):
    """float64 logp (and entropy) through the full logits; p = 0 tokens contribute 0."""
    z = h.double() @ w.double().T
    if b is not None:
        z = z + b.double()
    z = z / tau
    logp_all = z - torch.logsumexp(z, -1, keepdim=True)
    valid = y != ignore_index
    idx = torch.where(valid, y, 0).long().clamp(0, w.shape[0] - 1)
    logp = torch.where(valid, logp_all.gather(-1, idx[..., None])[..., 0], 0.0)
    if not entropy:
        return logp, None
    p = logp_all.exp()
    ent = -(p * torch.where(p > 0, logp_all, 0.0)).sum(-1)
    return logp, torch.where(valid, ent, 0.0)


def _leaves(tensors, dtype=None):
    out = []
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or not t.is_floating_point():
            out.append(t)
            continue
        t = t.detach().clone() if dtype is None else t.detach().to(dtype)
        out.append(t.requires_grad_())
    return out


def _grads(leaves):
    return [None if t is None or not isinstance(t, torch.Tensor) else t.grad for t in leaves]


def _tol(*tensors) -> float:
    dts = [t.dtype for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return max([TOL.get(d, 1e-5) for d in dts] or [1e-5])


def primitive_case(
    fn, h, w, y, b=None, tau=1.0, ignore_index=-100, entropy=False, grad=True, seed=0
) -> Callable[[], Outcome]:
    """Run fn(h, w, y, b, tau, ignore_index, entropy) with gradients of Σ g·logp + Σ g_H·H
    and compare with the oracle."""

    def run() -> Outcome:
        gen = torch.Generator().manual_seed(seed)
        lead = y.shape if isinstance(y, torch.Tensor) else ()
        up = torch.randn(2, *lead, generator=gen, dtype=torch.float64)
        leaves = _leaves((h, w, b)) if grad else [h, w, b]
        out = fn(leaves[0], leaves[1], y, leaves[2], tau, ignore_index, entropy)
        logp, ent = out if entropy else (out, None)
        if grad:
            total = (up[0].to(logp.dtype) * logp).sum()
            if ent is not None:
                total = total + (up[1].to(ent.dtype) * ent).sum()
            if total.requires_grad:
                total.backward()
        refs = _leaves((h, w, b), torch.float64)
        r_logp, r_ent = oracle_logprobs(refs[0], refs[1], y, refs[2], tau, ignore_index, entropy)
        if grad:
            r_total = (up[0] * r_logp).sum() + (0.0 if r_ent is None else (up[1] * r_ent).sum())
            r_total.backward()
        pairs = [("logp", logp, r_logp), ("entropy", ent, r_ent)]
        if grad:
            for name, g, r in zip(("dhidden", "dweight", "dbias"), _grads(leaves), _grads(refs)):
                pairs.append((name, g, r))
        return compare_all(pairs, _tol(h, w, b))

    return run


def fused(h, w, y, b, tau, ignore_index, entropy):
    return fk.fused_linear_logprobs(h, w, y, b, tau, ignore_index, entropy)


def ref_logprobs(h, w, y, b, tau, ignore_index, entropy):
    return reference.logprobs(h, w, y, b, tau, ignore_index, entropy)


def raw_op(h, w, y, b, tau, ignore_index, entropy):
    """torch.ops.fgrpo.logprob_fwd, then logprob_bwd by hand for the gradients."""

    class Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h, w, b):
            logp, lse, ent = torch.ops.fgrpo.logprob_fwd(h, w, y, b, tau, ignore_index, entropy)
            ctx.save_for_backward(h, w, b, lse, ent if entropy else None)
            return logp, ent

        @staticmethod
        def backward(ctx, g, g_ent):
            h, w, b, lse, ent = ctx.saved_tensors
            g_ent = g_ent if entropy else None
            dh, dw, db = torch.ops.fgrpo.logprob_bwd(
                h, w, y, b, lse, ent, g, g_ent, tau, ignore_index, True, True, b is not None
            )
            return dh, dw, db if b is not None else None

    logp, ent = Op.apply(h, w, b)
    return (logp, ent) if entropy else logp


# ----------------------------------------------------------------------------- inputs

N_, H_, V_ = 6, 8, 50


def data(N=N_, H=H_, V=V_, dtype=torch.float32, bias=False, seed=0, w_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=gen).to(dtype)
    w = (torch.randn(V, H, generator=gen) * 2 / max(H, 1) ** 0.5).to(w_dtype or dtype)
    y = torch.randint(0, max(V, 1), (N,), generator=gen)
    b = torch.randn(V, generator=gen).to(w_dtype or dtype) if bias else None
    return h, w, y, b


def banned_bias(V=V_, banned=slice(0, 5), seed=1):
    b = torch.randn(V, generator=torch.Generator().manual_seed(seed))
    b[banned] = -INF
    return b


def guard(run, error_ok=None) -> Callable[[], Outcome]:
    def wrapped() -> Outcome:
        try:
            return run()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as error:  # noqa: BLE001 - every failure is classified
            return classify_exception(error, error_ok)

    return wrapped


def collector(cases: list[Case], prefix: str, group: str):
    """add(name, what, expect, run, error_ok=None) appending a guarded case to `cases`."""

    def add(name, what, expect, run, error_ok=None):
        cases.append(Case(f"{prefix}{name}", group, what, expect, guard(run, error_ok), error_ok))

    return add


def double_backward_case(fn_loss, leaves_fn, oracle_loss) -> Callable[[], Outcome]:
    """d/dθ of <dL/dhidden, v>: create_graph through the first gradient."""

    def run() -> Outcome:
        leaves = leaves_fn(None)
        loss = fn_loss(*leaves)
        (gh,) = torch.autograd.grad(loss, leaves[0], create_graph=True)
        v = torch.randn(gh.shape, generator=torch.Generator().manual_seed(5), dtype=gh.dtype)
        (gh * v).sum().backward()
        refs = leaves_fn(torch.float64)
        r_loss = oracle_loss(*refs)
        (r_gh,) = torch.autograd.grad(r_loss, refs[0], create_graph=True)
        (r_gh * v.double()).sum().backward()
        pairs = [(f"d2/d{i}", a, b) for i, (a, b) in enumerate(zip(_grads(leaves), _grads(refs)))]
        return compare_all(pairs, 1e-4)

    return run


# ----------------------------------------------------------------------------- primitive


def primitive_cases(fn, group: str, prefix: str) -> list[Case]:
    h, w, y, b = data(bias=True)
    hb, wb, yb, bb = data(dtype=torch.bfloat16, bias=True)
    hh, wh, yh, bh = data(dtype=torch.float16, bias=True)
    C = []
    add = collector(C, prefix, group)

    def val(name, what, *args, expect="value", **kw):
        add(name, what, expect, primitive_case(fn, *args, **kw))

    val("fp32", "fp32, bias", h, w, y, b)
    val("fp32_entropy", "fp32, bias, entropy", h, w, y, b, entropy=True)
    val("bf16", "bf16, entropy", hb, wb, yb, bb, entropy=True)
    val("fp16", "fp16", hh, wh, yh, bh)
    val("bf16_fp32w", "bf16 hidden, fp32 weight", hb, w, y, b)
    val("fp64", "fp64 inputs", h.double(), w.double(), y, b.double(), expect="any")
    val("fp16_bf16", "fp16 hidden, bf16 weight", hh, wb, y, None, expect="error")
    val("hidden_int", "hidden int64", h.long(), w, y, expect="error")
    val("hidden_0d", "hidden 0-D", torch.tensor(1.0), w, torch.tensor(1), expect="error")
    h3, w3, _, _ = data(N=6)
    val("hidden_3d", "hidden [2, 3, H]", h3.reshape(2, 3, H_), w3, y.reshape(2, 3))
    val("weight_H", "weight [V, H+1]", h, torch.randn(V_, H_ + 1), y, expect="error")
    val("weight_1d", "weight 1-D", h, torch.randn(V_), y, expect="error")
    val("targets_shape", "targets [N+1]", h, w, torch.zeros(N_ + 1, dtype=torch.long),
        expect="error")  # fmt: skip
    val("targets_float", "targets float", h, w, y.float(), expect="error")
    val("targets_int32", "targets int32", h, w, y.int(), b)
    val("targets_int8", "targets int8", h, w, y.to(torch.int8), b)
    val("targets_uint8", "targets uint8", h, w, y.to(torch.uint8), b)
    val("targets_bool", "targets bool", h, w, y > 20, expect="error")
    for t, label in ((V_, "V"), (-5, "-5"), (2**40, "2^40")):
        yy = y.clone()
        yy[2] = t
        val(f"target_{label}", f"a target = {label} (V = {V_})", h, w, yy, b, expect="error")
    y0 = y.clone()
    y0[::2] = 0
    val("ignore_0", "ignore_index = 0, half the targets 0", h, w, y0, b, ignore_index=0,
        entropy=True)  # fmt: skip
    val("all_ignored", "every target ignore_index", h, w, torch.full((N_,), -100), b,
        entropy=True)  # fmt: skip
    h0, w0, _, _ = data(N=0)
    val("N0", "N = 0", h0, w0, torch.zeros(0, dtype=torch.long), entropy=True)
    val("lead0", "hidden [2, 0, H]", h0.reshape(2, 0, H_), w0,
        torch.zeros(2, 0, dtype=torch.long))  # fmt: skip
    val("H0", "H = 0", torch.randn(N_, 0), torch.randn(V_, 0), y, expect="error")
    val("V0", "V = 0", h, torch.randn(0, H_), torch.zeros(N_, dtype=torch.long), expect="error")
    val("V1", "V = 1", h, torch.randn(1, H_), torch.zeros(N_, dtype=torch.long), entropy=True)
    val("bias_shape", "bias [V+1]", h, w, y, torch.randn(V_ + 1), expect="error")
    val("bias_int", "bias int64", h, w, y, torch.zeros(V_, dtype=torch.long), expect="error")
    yk = torch.randint(5, V_, (N_,), generator=torch.Generator().manual_seed(3))
    val("ban", "bias -inf on tokens 0-4 (banned), targets not banned", h, w, yk, banned_bias())
    val("ban_entropy", "banned tokens, entropy", h, w, yk, banned_bias(), entropy=True)
    hv, wv, _, _ = data(N=9, V=2100, seed=4)
    yv = torch.randint(1200, 2100, (9,), generator=torch.Generator().manual_seed(4))
    val("ban_block", "V 2100, tokens 0-1099 banned (whole tiles), entropy", hv, wv, yv,
        banned_bias(2100, slice(0, 1100)), entropy=True)  # fmt: skip
    yt = yk.clone()
    yt[1] = 2
    val("ban_target", "a target on a banned token (logp = -inf)", h, w, yt, banned_bias(),
        entropy=True)  # fmt: skip
    val("ban_all", "bias all -inf", h, w, y, torch.full((V_,), -INF), expect="error")
    bp = torch.zeros(V_)
    bp[3] = INF
    val("bias_posinf", "bias +inf entry", h, w, y, bp, expect="error")
    bn = torch.zeros(V_)
    bn[3] = float("nan")
    val("bias_nan", "bias NaN entry", h, w, y, bn, expect="error")
    for tau, label in ((0.0, "0"), (-1.0, "neg"), (float("nan"), "nan"), (INF, "inf")):
        val(f"tau_{label}", f"temperature {tau}", h, w, y, b, tau=tau, expect="error")
    val("tau_str", "temperature '1'", h, w, y, b, tau="1", expect="error")
    val("tau_1e-20", "temperature 1e-20, entropy", h, w, y, b, tau=1e-20, entropy=True)
    val("tau_1e-30", "temperature 1e-30, entropy", h, w, y, b, tau=1e-30, entropy=True,
        expect="any")  # fmt: skip
    val("tau_1e-45", "temperature 1e-45 (1/τ overflows fp32)", h, w, y, b, tau=1e-45,
        entropy=True, expect="error")  # fmt: skip
    val("tau_1e6", "temperature 1e6, entropy", h, w, y, b, tau=1e6, entropy=True)
    val("ignore_bool", "ignore_index True", h, w, y, b, ignore_index=True, expect="error")
    val("ignore_float", "ignore_index 1.5", h, w, y, b, ignore_index=1.5, expect="error")
    hn = h.clone()
    hn[1, 2] = float("nan")
    val("hidden_nan", "a NaN in hidden (NaN in, NaN out, same places)", hn, w, y, b,
        entropy=True)  # fmt: skip
    val("large_logits", "hidden x 1e4 (near-certain rows), entropy", h * 1e4, w, y, b,
        entropy=True)  # fmt: skip
    val("weight_1e18", "weight x 1e18", h, w * 1e18, y, b)
    hT = torch.randn(H_, N_).T
    val("noncontig", "hidden a transposed view", hT, w, y, b, entropy=True)
    val("meta_hidden", "hidden on meta", h.to("meta"), w, y, b, grad=False, expect="error")
    val("meta_all", "every tensor on meta", h.to("meta"), w.to("meta"), y.to("meta"),
        b.to("meta"), grad=False, expect="error")  # fmt: skip
    val("targets_list", "targets a list", h, w, y.tolist(), b, grad=False, expect="error")

    def leaves_fn(dtype):
        return _leaves((h, w, b), dtype)

    up = torch.randn(N_, generator=torch.Generator().manual_seed(6))

    def cand(hh_, ww_, bb_):
        return (up * fn(hh_, ww_, y, bb_, 1.3, -100, False)).sum()

    def orac(hh_, ww_, bb_):
        return (up.double() * oracle_logprobs(hh_, ww_, y, bb_, 1.3, -100, False)[0]).sum()

    add("double_backward", "d/dθ <dlogp/dhidden, v> (create_graph=True)", "any",
        double_backward_case(cand, leaves_fn, orac), error_ok="higher-order gradients")  # fmt: skip
    return C


# ----------------------------------------------------------------------------- modules

B_, T_, G_ = 4, 5, 2


def batch(B=B_, T=T_, H=H_, V=V_, dtype=torch.float32, seed=10, mask="ragged"):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=gen).to(dtype)
    weight = (torch.randn(V, H, generator=gen) * 2 / max(H, 1) ** 0.5).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=gen)
    if mask == "ragged":
        lengths = torch.tensor([T, 2, T - 1, 1] * B)[:B]
        m = torch.arange(T)[None, :] < lengths[:, None]
    elif mask == "none":
        m = torch.zeros(B, T, dtype=torch.bool)
    else:
        m = torch.ones(B, T, dtype=torch.bool)
    ref = -torch.rand(B, T, generator=gen) * 3
    old = -torch.rand(B, T, generator=gen) * 3
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, -1.0] * B)[:B]
    adv = torch.tensor([0.7, -0.7, 1.2, -0.3, 0.0, 0.4] * B)[:B]
    chosen = torch.arange(B) % 2 == 0
    return dict(
        hidden=hidden, weight=weight, ids=ids, mask=m, ref=ref, old=old, rewards=rewards,
        adv=adv, chosen=chosen,
    )  # fmt: skip


def logps64(h, w, b, ids, mask, tau=1.0):
    B, T, H = h.shape
    lp, _ = oracle_logprobs(h.reshape(B * T, H), w, ids.reshape(-1), b, tau, -100, False)
    return torch.where(mask.bool(), lp.reshape(B, T), 0.0)


def module_case(call, oracle, d, bias=None, zero=False) -> Callable[[], Outcome]:
    """call(h, w, b) → (loss, metrics); oracle(h64, w64, b64) → float64 loss, or zero=True:
    loss 0 and zero gradients expected."""

    def run() -> Outcome:
        leaves = _leaves((d["hidden"], d["weight"], bias))
        loss, metrics = call(*leaves)
        for name, value in metrics.items():
            if isinstance(value, torch.Tensor) and not bool(torch.isfinite(value).all()):
                return Outcome("nan", f"metric {name} = {value.tolist()}")
        if loss.requires_grad:
            loss.backward()
        tol = _tol(d["hidden"], d["weight"])
        if zero:
            want_loss = torch.zeros((), dtype=torch.float64)
            refs = [None if t is None else torch.zeros(t.shape, dtype=torch.float64)
                    for t in (d["hidden"], d["weight"], bias)]  # fmt: skip
            ref_grads = refs
        else:
            refs = _leaves((d["hidden"], d["weight"], bias), torch.float64)
            want_loss = oracle(*refs)
            want_loss.backward()
            ref_grads = _grads(refs)
        pairs = [("loss", loss, want_loss)]
        for name, g, r in zip(("dhidden", "dweight", "dbias"), _grads(leaves), ref_grads):
            pairs.append((name, g, r))
        return compare_all(pairs, max(tol, 1e-5))

    return run


def lazy(build: Callable[[], Callable[[], Outcome]]) -> Callable[[], Outcome]:
    """A case whose module is built when it runs (constructor errors are outcomes too)."""
    return lambda: build()()


def module_cases() -> list[Case]:
    C = []
    add = collector(C, "M.", "modules")

    def fgrpo(d, bias=None, div="pearson", level="token", rewards=False, zero=False, **opts):
        return lazy(lambda: _fgrpo(d, bias, div, level, rewards, zero, **opts))

    def _fgrpo(d, bias=None, div="pearson", level="token", rewards=False, zero=False, **opts):
        mod = fk.FusedLinearFGRPOLoss(div, level=level, num_generations=G_, **opts)
        kw = {"rewards": d["rewards"]} if rewards else {"advantages": d["adv"]}

        def call(h, w, b):
            return mod(h, w, d["ids"], d["mask"], ref_per_token_logps=d["ref"], bias=b, **kw)

        def oracle(h, w, b):
            lp = logps64(h, w, b, d["ids"], d["mask"], mod.temperature)
            extra = {"rewards": d["rewards"].double(), "num_generations": G_} if rewards else {}
            adv = None if rewards else d["adv"].double()
            return reference.fgrpo_loss(lp, d["ref"].double(), adv, d["mask"], div,
                                        mod.opts.beta, level, **extra)  # fmt: skip

        return module_case(call, oracle, d, bias, zero)

    def grpo(d, loss_type="dapo", bias=None, zero=False, n_items=None, level="token", **opts):
        return lazy(lambda: _grpo(d, loss_type, bias, zero, n_items, level, **opts))

    def _grpo(d, loss_type="dapo", bias=None, zero=False, n_items=None, level="token", **opts):
        mod = fk.FusedLinearGRPOLoss(loss_type, importance_sampling_level=level, **opts)

        def call(h, w, b):
            return mod(h, w, d["ids"], d["mask"], d["adv"], b, ref_per_token_logps=d["ref"],
                       old_per_token_logps=d["old"], num_items_in_batch=n_items)  # fmt: skip

        def oracle(h, w, b):
            lp = logps64(h, w, b, d["ids"], d["mask"], mod.temperature)
            o = mod.opts
            return reference.grpo_loss(
                lp, d["old"].double(), d["ref"].double(), d["adv"].double(), d["mask"],
                loss_type, o.beta, o.epsilon_low, o.epsilon_high, level,
                num_items_in_batch=n_items,
            )  # fmt: skip

        return module_case(call, oracle, d, bias, zero)

    def gift(d, bias=None, zero=False, **opts):
        return lazy(lambda: _gift(d, bias, zero, **opts))

    def _gift(d, bias=None, zero=False, **opts):
        mod = fk.FusedLinearGIFTLoss(G_, **opts)

        def call(h, w, b):
            return mod(h, w, d["ids"], d["mask"], d["rewards"], d["ref"], bias=b)

        def oracle(h, w, b):
            lp = logps64(h, w, b, d["ids"], d["mask"], mod.temperature)
            return reference.gift_loss(lp, d["ref"].double(), d["rewards"].double(), d["mask"],
                                       G_, mod.opts.beta)  # fmt: skip

        return module_case(call, oracle, d, bias, zero)

    def fdo(d, zero=False, **opts):
        return lazy(lambda: _fdo(d, zero, **opts))

    def _fdo(d, zero=False, **opts):
        mod = fk.FusedLinearFDOLoss("js", **opts)

        def call(h, w, b):
            return mod(h, w, d["ids"], d["mask"], d["chosen"], d["ref"])

        def oracle(h, w, b):
            lp = logps64(h, w, b, d["ids"], d["mask"], mod.temperature)
            return reference.fdo_loss(lp, d["ref"].double(), d["mask"], d["chosen"], "js",
                                      mod.opts.beta)  # fmt: skip

        return module_case(call, oracle, d, None, zero)

    def fhal(d, p):
        return lazy(lambda: _fhal(d, p))

    def _fhal(d, p):
        mod = fk.FusedLinearFHALLoss("js", lam=0.3, num_generations=G_)

        def call(h, w, b):
            return mod(h, w, d["ids"], d["mask"], p["hidden"], p["ids"], p["mask"], p["chosen"],
                       advantages=d["adv"], ref_per_token_logps=d["ref"],
                       pref_ref_per_token_logps=p["ref"])  # fmt: skip

        def oracle(h, w, b):
            lp = logps64(h, w, b, d["ids"], d["mask"], mod.temperature)
            plp = logps64(p["hidden"].double(), w, b, p["ids"], p["mask"])
            pref = reference.fdo_loss(plp, p["ref"].double(), p["mask"], p["chosen"], "js", 0.1)
            if d["mask"].numel() == 0 or not bool(d["mask"].any()):
                return 0.3 * pref + 0.0 * lp.sum()
            on = reference.fgrpo_loss(lp, d["ref"].double(), d["adv"].double(), d["mask"],
                                      "js", 0.1)  # fmt: skip
            return 0.3 * pref + 0.7 * on

        return module_case(call, oracle, d, None)

    d = batch()
    unused = [v for v in range(V_) if not bool((d["ids"] == v).any())]
    bias = banned_bias(banned=unused[:5])  # no completion id is banned
    add("fgrpo", "f-GRPO pearson, token level, advantages", "value", fgrpo(d))
    add("fgrpo_rewards", "f-GRPO, rewards (group z-score inside)", "value", fgrpo(d, rewards=True))
    add("fgrpo_seq", "f-GRPO kl, sequence level", "value", fgrpo(d, div="kl", level="sequence"))
    for lt in ("dapo", "grpo", "dr_grpo", "bnpo"):
        add(f"grpo_{lt}", f"GRPO {lt}", "value", grpo(d, lt))
    add("grpo_gspo", "GRPO dapo, sequence level (GSPO)", "value", grpo(d, level="sequence"))
    add("gift", "GIFT", "value", gift(d))
    add("fdo", "FDO js", "value", fdo(d))
    p = batch(seed=11)
    add("fhal", "f-HAL js", "value", fhal(d, p))
    add("bf16", "GRPO dapo on bf16 hidden and weight", "value", grpo(batch(dtype=torch.bfloat16)))

    e = batch(B=0)
    add("empty_fgrpo", "B = 0: f-GRPO token level", "value", fgrpo(e, zero=True))
    add("empty_fgrpo_seq", "B = 0: f-GRPO kl sequence level", "value",
        fgrpo(e, div="kl", level="sequence", zero=True))  # fmt: skip
    add("empty_fgrpo_rewards", "B = 0: f-GRPO with rewards", "value",
        fgrpo(e, rewards=True, zero=True))  # fmt: skip
    for lt in ("dapo", "grpo", "dr_grpo", "bnpo"):
        add(f"empty_grpo_{lt}", f"B = 0: GRPO {lt}", "value", grpo(e, lt, zero=True))
    add("empty_grpo_gspo", "B = 0: GRPO sequence level", "value",
        grpo(e, level="sequence", zero=True))  # fmt: skip
    add("empty_gift", "B = 0: GIFT", "value", gift(e, zero=True))
    add("empty_fdo", "B = 0: FDO (both pools must be non-empty)", "error", fdo(e, zero=True))
    add("empty_fhal", "B = 0 on-policy batch: f-HAL = lam·FDO", "value", fhal(e, p))

    z = batch(mask="none")
    add("masked_fgrpo", "fully masked: f-GRPO token level", "value", fgrpo(z, zero=True))
    add("masked_fgrpo_seq", "fully masked: f-GRPO kl sequence level (φ₋(0) ≠ 0)", "value",
        fgrpo(z, div="kl", level="sequence", zero=True))  # fmt: skip
    for lt in ("dapo", "grpo", "dr_grpo"):
        add(f"masked_grpo_{lt}", f"fully masked: GRPO {lt}", "value", grpo(z, lt, zero=True))
    add("masked_gift", "fully masked: GIFT", "value", gift(z, zero=True))
    add("masked_fdo", "fully masked: FDO", "value", fdo(z, zero=True))

    add("ban_fgrpo", "banned tokens in the bias: f-GRPO", "value", fgrpo(d, bias))
    add("ban_grpo_entropy", "banned tokens: GRPO with compute_entropy", "value",
        grpo(d, bias=bias, compute_entropy=True))  # fmt: skip
    add("ban_gift", "banned tokens: GIFT", "value", gift(d, bias))

    for n, label in ((0, "0"), (-5, "-5"), (torch.tensor(0.0), "tensor0"), (True, "True")):
        add(f"n_items_{label}", f"num_items_in_batch = {label}", "error", grpo(d, n_items=n))
    add("n_items_7", "num_items_in_batch = 7", "value", grpo(d, n_items=7))
    add("n_items_t7", "num_items_in_batch = tensor(7.)", "value",
        grpo(d, n_items=torch.tensor(7.0)))  # fmt: skip
    add("grpo_beta_neg", "GRPO beta = -0.1", "error", grpo(d, beta=-0.1))
    add("grpo_eps_low_1.5", "GRPO epsilon_low = 1.5", "error", grpo(d, epsilon_low=1.5))
    add("grpo_eps_low_1", "GRPO epsilon_low = 1 (lower clip bound 0)", "error",
        grpo(d, epsilon_low=1.0))  # fmt: skip
    add("grpo_eps_high_neg", "GRPO epsilon_high = -0.1", "error", grpo(d, epsilon_high=-0.1))
    add("fgrpo_beta_neg", "f-GRPO beta = -1", "error", fgrpo(d, beta=-1.0))
    add("gift_beta_neg", "GIFT beta = -1", "error", gift(d, beta=-1.0))
    add("fdo_beta_neg", "FDO beta = -1", "error", fdo(d, beta=-1.0))
    add("grpo_loss_type", "GRPO loss_type 'ppo'", "error", grpo(d, "ppo"))
    add("tau_1e-20", "f-GRPO temperature 1e-20, compute_entropy", "value",
        fgrpo(d, temperature=1e-20, compute_entropy=True))  # fmt: skip
    add("tau_1e-20_kl", "GRPO beta 0.04, temperature 1e-20 (k3 saturated: |dhidden| ~ 1e52)",
        "value", grpo(d, temperature=1e-20))  # fmt: skip
    add("tau_0", "GRPO temperature 0", "error", grpo(d, temperature=0.0))

    def bad(**changes):
        dd = dict(d)
        dd.update(changes)
        return grpo(dd)

    ids_bad = d["ids"].clone()
    ids_bad[0, 0] = V_
    add("ids_oob", "completion id = V where the mask is set", "error", bad(ids=ids_bad))
    ids_pad = d["ids"].clone()
    ids_pad[1, 4] = -1  # row 1 has length 2: position 4 is padding
    add("ids_oob_masked", "completion id = -1 where the mask is 0 (padding)", "value",
        bad(ids=ids_pad))  # fmt: skip
    add("mask_float", "completion_mask float 0/1", "value", bad(mask=d["mask"].float()))
    add("mask_shape", "completion_mask [B, T+1]", "error",
        bad(mask=torch.ones(B_, T_ + 1, dtype=torch.bool)))  # fmt: skip
    add("hidden_2d", "hidden [B·T, H]", "error", bad(hidden=d["hidden"].reshape(-1, H_)))
    add("H0", "H = 0", "error", bad(hidden=torch.randn(B_, T_, 0), weight=torch.randn(V_, 0)))
    add("meta", "hidden and weight on meta", "error",
        bad(hidden=d["hidden"].to("meta"), weight=d["weight"].to("meta")))  # fmt: skip
    add("gift_G", "GIFT, B not a multiple of num_generations", "error", gift(batch(B=3)))
    dc = dict(d)
    dc["chosen"] = torch.ones(B_, dtype=torch.bool)
    add("fdo_all_chosen", "FDO, every row chosen", "error", fdo(dc))
    add("fgrpo_both", "f-GRPO with advantages and rewards", "error",
        module_case(lambda h, w, b: fk.FusedLinearFGRPOLoss(num_generations=G_)(
            h, w, d["ids"], d["mask"], advantages=d["adv"], rewards=d["rewards"],
            ref_per_token_logps=d["ref"]), None, d))  # fmt: skip

    mod = fk.FusedLinearGRPOLoss("dapo")

    def cand(h, w, b):
        return mod(h, w, d["ids"], d["mask"], d["adv"], ref_per_token_logps=d["ref"],
                   old_per_token_logps=d["old"])[0]  # fmt: skip

    def orac(h, w, b):
        return reference.grpo_loss(logps64(h, w, b, d["ids"], d["mask"]), d["old"].double(),
                                   d["ref"].double(), d["adv"].double(), d["mask"])  # fmt: skip

    add("double_backward", "GRPO: d/dθ <dL/dhidden, v> (create_graph=True)", "any",
        double_backward_case(cand, lambda dt: _leaves((d["hidden"], d["weight"], None), dt),
                             orac), error_ok="higher-order gradients")  # fmt: skip
    return C


# ----------------------------------------------------------------------------- reference


def value_case(fn, want, grads=()) -> Callable[[], Outcome]:
    """fn() → loss (0-d); compared with `want` (a float), its gradients with zeros."""

    def run() -> Outcome:
        loss = fn()
        pairs = [("loss", loss, torch.tensor(want, dtype=torch.float64))]
        if loss.requires_grad:
            loss.backward()
        for i, leaf in enumerate(grads):
            pairs.append((f"grad{i}", leaf.grad, torch.zeros(leaf.shape, dtype=torch.float64)))
        return compare_all(pairs, 1e-6)

    return run


def reference_cases() -> list[Case]:
    C = []
    add = collector(C, "R.", "reference")

    h, w, y, b = data(bias=True)
    for dt in (torch.int8, torch.uint8, torch.int32, torch.int16):
        name = str(dt).split(".")[1]
        add(f"logprobs_{name}", f"reference.logprobs, targets {name}", "value",
            primitive_case(ref_logprobs, h, w, y.to(dt), b, entropy=True))  # fmt: skip
    yk = torch.randint(5, V_, (N_,), generator=torch.Generator().manual_seed(3))
    add("logprobs_ban", "reference.logprobs, banned tokens, entropy", "value",
        primitive_case(ref_logprobs, h, w, yk, banned_bias(), entropy=True))  # fmt: skip
    add("logprobs_H0", "reference.logprobs, H = 0", "error",
        primitive_case(ref_logprobs, torch.randn(N_, 0), torch.randn(V_, 0), y))  # fmt: skip
    add(
        "logprobs_meta",
        "reference.logprobs, meta tensors",
        "error",
        primitive_case(ref_logprobs, h.to("meta"), w.to("meta"), y.to("meta"), grad=False),
    )
    yy = y.clone()
    yy[0] = V_
    add("logprobs_oob", "reference.logprobs, a target = V", "error",
        primitive_case(ref_logprobs, h, w, yy))  # fmt: skip

    gen = torch.Generator().manual_seed(20)
    B, T = 4, 5
    lp = -torch.rand(B, T, generator=gen) * 3
    old = -torch.rand(B, T, generator=gen) * 3
    ref = -torch.rand(B, T, generator=gen) * 3
    adv = torch.tensor([0.5, -1.0, 2.0, 0.0])
    mask = torch.arange(T)[None, :] < torch.tensor([5, 3, 1, 4])[:, None]

    def grpo_with(**kw):
        return lambda: reference.grpo_loss(lp, old, ref, adv, mask, **kw)

    for n in (0, -5, torch.tensor(0.0), True):
        add(f"n_items_{n}", f"grpo_loss num_items_in_batch = {n}", "error",
            value_case(grpo_with(num_items_in_batch=n), 0.0))  # fmt: skip
    # dapo with num_items_in_batch: Σ mask·pt / n, pt = −min(c1·a, clip(c1)·a) + β·k3
    c1 = torch.exp(lp.double() - old.double())
    a = adv.double()[:, None]
    pt = -torch.minimum(c1 * a, c1.clamp(0.8, 1.2) * a)
    d = ref.double() - lp.double()
    pt = pt + 0.04 * (d.exp() - d - 1)
    want = float((pt * mask).sum() / 7)
    add("n_items_7", "grpo_loss dapo, num_items_in_batch = 7 (by hand)", "value",
        value_case(grpo_with(num_items_in_batch=7), want))  # fmt: skip
    add("grpo_beta_neg", "grpo_loss beta = -0.1", "error", value_case(grpo_with(beta=-0.1), 0))
    add("grpo_eps_low_1.5", "grpo_loss epsilon_low = 1.5", "error",
        value_case(grpo_with(epsilon_low=1.5), 0))  # fmt: skip
    add("grpo_loss_type", "grpo_loss loss_type 'ppo'", "error",
        value_case(grpo_with(loss_type="ppo"), 0))  # fmt: skip
    add("fgrpo_beta_neg", "fgrpo_loss beta = -1", "error",
        value_case(lambda: reference.fgrpo_loss(lp, ref, adv, mask, beta=-1.0), 0))  # fmt: skip
    add("fgrpo_div", "fgrpo_loss divergence 'l2'", "error",
        value_case(lambda: reference.fgrpo_loss(lp, ref, adv, mask, "l2"), 0))  # fmt: skip
    rw = torch.tensor([1.0, 0.0, 0.3, 0.3])
    add("gift_beta_neg", "gift_loss beta = -1", "error",
        value_case(lambda: reference.gift_loss(lp, ref, rw, mask, 2, beta=-1.0), 0))  # fmt: skip
    chosen = torch.tensor([True, False, True, False])
    add("fdo_beta_neg", "fdo_loss beta = -1", "error",
        value_case(lambda: reference.fdo_loss(lp, ref, mask, chosen, beta=-1.0), 0))  # fmt: skip
    add("fhal_lam", "fhal_loss lam = 2", "error",
        value_case(lambda: reference.fhal_loss(lp, ref, adv, mask, lp, ref, mask, chosen,
                                               lam=2.0), 0))  # fmt: skip
    add(
        "mask_shape",
        "grpo_loss mask [B, T+1]",
        "error",
        value_case(lambda: reference.grpo_loss(lp, old, ref, adv, torch.ones(B, T + 1)), 0),
    )
    add("meta", "grpo_loss on meta tensors", "error",
        value_case(lambda: reference.grpo_loss(lp.to("meta"), None, None, adv.to("meta"),
                                               mask.to("meta")), 0))  # fmt: skip

    e = torch.zeros(0, T, requires_grad=True)
    e_m, e_a = torch.zeros(0, T, dtype=torch.bool), torch.zeros(0)
    for lt in ("dapo", "grpo", "dr_grpo", "bnpo"):
        add(
            f"empty_grpo_{lt}",
            f"grpo_loss B = 0, {lt}",
            "value",
            value_case(lambda lt=lt: reference.grpo_loss(e, e, e, e_a, e_m, lt), 0.0, (e,)),
        )
    for level in ("token", "sequence"):
        add(
            f"empty_fgrpo_{level}",
            f"fgrpo_loss B = 0, kl, {level} level",
            "value",
            value_case(
                lambda level=level: reference.fgrpo_loss(e, e, e_a, e_m, "kl", level=level),
                0.0,
                (e,),
            ),
        )
    add("empty_gift", "gift_loss B = 0", "value",
        value_case(lambda: reference.gift_loss(e, e, e_a, e_m, 2), 0.0, (e,)))  # fmt: skip
    add("empty_group_normalize", "group_normalize of 0 rewards", "value",
        lambda: compare_all([("adv", reference.group_normalize(torch.zeros(0), 2),
                              torch.zeros(0))], 1e-6))  # fmt: skip
    x = lp.clone().requires_grad_()
    none = torch.zeros(B, T, dtype=torch.bool)
    add("masked_grpo", "grpo_loss fully masked", "value",
        value_case(lambda: reference.grpo_loss(x, old, ref, adv, none), 0.0, (x,)))  # fmt: skip
    add("masked_fgrpo_seq", "fgrpo_loss fully masked, kl sequence level", "value",
        value_case(lambda: reference.fgrpo_loss(x, ref, adv, none, "kl", level="sequence"),
                   0.0, (x,)))  # fmt: skip
    add("masked_gift", "gift_loss fully masked", "value",
        value_case(lambda: reference.gift_loss(x, ref, rw, none, 2), 0.0, (x,)))  # fmt: skip
    add(
        "masked_fdo",
        "fdo_loss fully masked",
        "value",
        value_case(lambda: reference.fdo_loss(x, ref, none, chosen, "kl"), 0.0, (x,)),
    )
    add(
        "G0",
        "group_normalize num_generations 0",
        "error",
        lambda: compare_all([("adv", reference.group_normalize(rw, 0), rw)], 1e-6),
    )
    return C


# ----------------------------------------------------------------------------- raw ops


def op_cases() -> list[Case]:
    C = []
    add = collector(C, "O.", "raw ops")

    h, w, y, b = data(bias=True)
    add("fwd", "fgrpo.logprob_fwd/bwd, fp32, bias, entropy", "value",
        primitive_case(raw_op, h, w, y, b, entropy=True))  # fmt: skip
    for t in (V_, 10**6, 2**40, -5):
        yy = y.clone()
        yy[3] = t
        add(f"target_{t}", f"logprob_fwd, a target = {t} (V = {V_})", "error",
            primitive_case(raw_op, h, w, yy, b, grad=False))  # fmt: skip
    yy = y.clone()
    yy[3] = -100
    add("target_ignored", "logprob_fwd, a target = ignore_index", "value",
        primitive_case(raw_op, h, w, yy, b, entropy=True))  # fmt: skip

    def bwd_oob():
        logp, lse, ent = torch.ops.fgrpo.logprob_fwd(h, w, y, b, 1.0, -100, False)
        yy = y.clone()
        yy[0] = V_
        g = torch.ones(N_)
        torch.ops.fgrpo.logprob_bwd(h, w, yy, b, lse, None, g, None, 1.0, -100, True, True, True)
        return Outcome("wrong", "returned gradients for a target = V")

    add("bwd_target_V", "logprob_bwd, a target = V", "error", bwd_oob)
    add("targets_int32", "logprob_fwd, int32 targets", "error",
        primitive_case(raw_op, h, w, y.int(), b, grad=False))  # fmt: skip
    add("hidden_1d", "logprob_fwd, hidden 1-D", "error",
        primitive_case(raw_op, h[0], w, y, b, grad=False))  # fmt: skip
    add("tau_0", "logprob_fwd, temperature 0", "error",
        primitive_case(raw_op, h, w, y, b, tau=0.0, grad=False))  # fmt: skip
    yk = torch.randint(5, V_, (N_,), generator=torch.Generator().manual_seed(3))
    add("ban", "fwd/bwd, banned tokens, entropy", "value",
        primitive_case(raw_op, h, w, yk, banned_bias(), entropy=True))  # fmt: skip
    add("N0", "fwd/bwd, N = 0", "value",
        primitive_case(raw_op, h[:0], w, y[:0], b, entropy=True))  # fmt: skip
    add("tau_1e-20", "fwd/bwd, temperature 1e-20, entropy", "value",
        primitive_case(raw_op, h, w, y, b, tau=1e-20, entropy=True))  # fmt: skip
    return C


# ----------------------------------------------------------------------------- main


def all_cases() -> list[Case]:
    return (
        primitive_cases(fused, "fused_linear_logprobs", "P.")
        + module_cases()
        + reference_cases()
        + op_cases()
    )


def run_cases(cases: list[Case], verbose: bool = False) -> list[Result]:
    if any(c.group == "raw ops" for c in cases):
        from fgrpo_kernels.backends.cpu import cpp

        if not cpp.available():
            print(f"raw ops unavailable: {cpp.build_error()}", file=sys.stderr)
    results = []
    for case in cases:
        t0 = time.perf_counter()
        outcome = case.run()
        results.append(Result(case, outcome, time.perf_counter() - t0))
        if verbose:
            r = results[-1]
            flag = "" if r.as_expected else "  <-- expected " + case.expect
            print(f"{case.name:28s} {outcome.kind:8s} {outcome.detail[:90]}{flag}", flush=True)
    return results


KINDS = ("error", "correct", "nan", "wrong", "crash")


def summary(results: list[Result]) -> str:
    groups = list(dict.fromkeys(r.case.group for r in results))
    head = "| group | cases | " + " | ".join(KINDS) + " | as expected |"
    lines = [head, "|" + "---|" * (len(KINDS) + 3)]
    for group in groups + ["all"]:
        rs = [r for r in results if group in ("all", r.case.group)]
        count = Counter(r.outcome.kind for r in rs)
        ok = sum(r.as_expected for r in rs)
        cells = " | ".join(str(count.get(k, 0)) for k in KINDS)
        label = f"**{group}**" if group == "all" else group
        lines.append(f"| {label} | {len(rs)} | {cells} | {ok} |")
    return "\n".join(lines)


def table(results: list[Result]) -> str:
    lines = ["| case | input | expects | got | detail |", "|---|---|---|---|---|"]
    for r in results:
        got = r.outcome.kind if r.as_expected else f"**{r.outcome.kind}**"
        what, detail = (x.replace("|", "\\|") for x in (r.case.what, r.outcome.detail))
        lines.append(f"| {r.case.name} | {what} | {r.case.expect} | {got} | {detail} |")
    return "\n".join(lines)


def source_version() -> str:
    """The commit of the fgrpo_kernels under test (+ "modified" for uncommitted changes)."""
    import subprocess
    from pathlib import Path

    where = Path(fk.__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(where), "status", "--porcelain", "--", ".", "../csrc"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return f"version {fk.__version__} (not a git checkout)"
    return f"commit {commit}" + (" + uncommitted changes" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("cpp", "torch", "triton"), default="cpp")
    parser.add_argument("--out", help="write the markdown tables here")
    parser.add_argument("-k", dest="filter", help="only cases whose name contains this")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    cases = all_cases()
    if args.filter:
        cases = [c for c in cases if args.filter in c.name]
    results = run_cases(cases, args.verbose)
    backend = fk.cpu_backend() if args.backend != "triton" else "triton (interpreter)"
    title = (
        f"Fuzz of the public API (`python bench/fuzz_public_api.py --backend {args.backend}`): "
        f"backend {backend}, torch {torch.__version__}, fgrpo_kernels at {source_version()}\n\n"
    )
    text = title + summary(results) + "\n\n" + table(results) + "\n"
    print(summary(results))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
