"""Shared cases of the epilogue tests: run a loss on the Triton and the PyTorch path, take the
float64 reference's autograd, and compare (loss, dL/dlogp) with a labelled relative error."""

import torch
from hypothesis import HealthCheck

from fgrpo_kernels import epilogue as E
from fgrpo_kernels import options as O
from fgrpo_kernels import reference as R
from fgrpo_kernels.divergences import TABLE, Divergence
from fgrpo_kernels.testing import Batch, rel_error

# Errors are ||got − want|| / max(||want||, floor). The losses are means of O(1) unit costs
# |a|·φ(r) whose signs cancel (advantages are centred per group), so a loss is compared
# absolutely below 1 (times the number of units for "sum"); dL/dlogp below 1e-2.
GRAD_FLOOR = 1e-2
QUICK = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
LEVEL_REDUCTIONS = [
    (O.Level.TOKEN, O.Reduction.TOKEN_MEAN),
    (O.Level.TOKEN, O.Reduction.SEQ_MEAN),
    (O.Level.TOKEN, O.Reduction.SUM),
    (O.Level.SEQUENCE, O.Reduction.SEQ_MEAN),
    (O.Level.SEQUENCE, O.Reduction.SUM),
]
SOURCES = ["advantages", "rewards_group", "rewards_batch", "rewards_none"]
DIVS = list(Divergence)


def name_of(x):
    return TABLE[x].name if isinstance(x, Divergence) else getattr(x, "name", str(x)).lower()


def both(monkeypatch, fn, *args):
    """fn(*args) on the Triton path and on the PyTorch path."""
    out = []
    for backend in ("triton", "cpu"):
        with monkeypatch.context() as mp:
            mp.setenv("FGRPO_BACKEND", backend)
            out.append(fn(*args))
    return out


def f64(x):
    return x.detach().double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def reference_grad(loss_fn, logps, **kwargs):
    """(loss, dloss/dlogps) of a reference loss on float64 copies of every floating input."""
    x = logps.detach().double().requires_grad_(True)
    loss = loss_fn(x, **{k: f64(v) for k, v in kwargs.items()})
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad


def rel_errors(got, want, loss_floor):
    return {
        "loss": rel_error(got[0], want[0], loss_floor),
        "dL/dlogp": rel_error(got[1], want[1], GRAD_FLOOR),
    }


def check(label, got, want, cpu=None, rtol=1e-5, loss_floor=1.0):
    """`got` (Triton) against the float64 reference `want`, and against the PyTorch path `cpu`
    wherever that path is itself within rtol/2 of the float64 truth. Its fp32 is not, in cases
    the epilogue handles in float64: flat fp32 reward groups (an ulp-off group mean becomes
    a = ±1e-3), GIFT's through-σ slope at G = 2, sums of T log-probs in IS weights (3e-5)."""
    loss, grad = got
    assert loss.dtype == torch.float32 and loss.dim() == 0, f"{label}: loss {loss.dtype}"
    assert grad.dtype == torch.float32, f"{label}: dL/dlogp {grad.dtype}"
    assert grad.shape == want[1].shape, f"{label}: dL/dlogp shape {tuple(grad.shape)}"
    assert torch.isfinite(loss) and torch.isfinite(grad).all(), f"{label}: not finite"
    judges = [("float64 reference", want)]
    if cpu is not None and max(rel_errors(cpu, want, loss_floor).values()) <= rtol / 2:
        judges.append(("cpu", cpu))
    for name, judge in judges:
        errors = rel_errors(got, judge, loss_floor)
        assert max(errors.values()) <= rtol, (
            f"{label} vs {name}: "
            + ", ".join(f"{k} rel err {v:.3g}" for k, v in errors.items())
            + f"; loss {float(loss):.7g} vs {float(judge[0]):.7g}"
        )


def fgrpo_case(b: Batch, divergence, level, reduction, source, weights, beta):
    G = b.num_generations
    scale = O.Scale.GROUP if source == "advantages" else O.parse(O.Scale, "scale", source[8:])
    opts = O.FGRPOOptions(divergence, beta, level, reduction, G, scale, 1e-4, True, weights)
    adv = b.advantages if source == "advantages" else None
    rewards = b.rewards if (adv is None or weights) else None
    args = (b.logps.float(), b.ref_logps, b.mask, adv, rewards, b.old_logps, opts)
    if adv is None:
        adv = R.group_normalize(f64(b.rewards), G, opts.eps, opts.unbiased, name_of(scale))
    want = reference_grad(
        R.fgrpo_loss,
        b.logps.float(),
        ref_logps=b.ref_logps,
        advantages=adv,
        mask=b.mask,
        divergence=divergence,
        beta=beta,
        level=name_of(level),
        reduction=name_of(reduction),
        group_is_weights=weights,
        old_logps=b.old_logps,
        rewards=b.rewards if weights else None,
        num_generations=G,
    )
    return args, want


def run_fgrpo(monkeypatch, b, divergence, level, reduction, source, weights, beta):
    args, want = fgrpo_case(b, divergence, level, reduction, source, weights, beta)
    triton_out, cpu_out = both(monkeypatch, E.fgrpo, *args)
    label = (
        f"fgrpo {name_of(divergence)} {name_of(level)} {name_of(reduction)} {source} IS={weights}"
    )
    units = b.mask.sum() if level == O.Level.TOKEN else b.mask.shape[0]
    floor = max(float(units), 1.0) if reduction == O.Reduction.SUM else 1.0
    check(label, triton_out, want, cpu_out, loss_floor=floor)


def run_grpo(monkeypatch, b, loss_type, level, beta, eps, has_old, has_ref, n_items, max_len):
    opts = O.GRPOOptions(loss_type, beta, *eps, level, max_len)
    old = b.old_logps if has_old else None
    ref = b.ref_logps if has_ref else None
    n_items = torch.tensor(10) if n_items == "tensor" else n_items
    args = (b.logps.float(), old, ref, b.mask, b.advantages, n_items, opts)
    triton_out, cpu_out = both(monkeypatch, E.grpo, *args)
    want = reference_grad(
        R.grpo_loss,
        b.logps.float(),
        old_logps=old,
        ref_logps=ref,
        advantages=b.advantages,
        mask=b.mask,
        loss_type=name_of(loss_type),
        beta=beta,
        epsilon_low=eps[0],
        epsilon_high=eps[1],
        importance_sampling_level=name_of(level),
        max_completion_length=max_len,
        num_items_in_batch=n_items,
    )
    label = f"grpo {name_of(loss_type)} {name_of(level)} beta={beta} old={has_old} ref={has_ref}"
    check(label, triton_out, want, cpu_out)


def run_gift(monkeypatch, b, detach, unbiased, beta):
    G = b.num_generations
    opts = O.GIFTOptions(G, beta, 1e-4, unbiased, detach)
    triton_out, cpu_out = both(
        monkeypatch, E.gift, b.logps.float(), b.ref_logps, b.mask, b.rewards, opts
    )
    want = reference_grad(
        R.gift_loss,
        b.logps.float(),
        ref_logps=b.ref_logps,
        rewards=b.rewards,
        mask=b.mask,
        num_generations=G,
        beta=beta,
        unbiased=unbiased,
        detach_stats=detach,
    )
    check(f"gift detach={detach} unbiased={unbiased}", triton_out, want, cpu_out, rtol=1e-4)


def make_batch(logps, ref, mask, advantages, rewards, G, old=None):
    B = logps.shape[0]
    chosen = torch.arange(B) % 2 == 0
    old = logps if old is None else old
    return Batch(logps, ref, old, mask, advantages, rewards, chosen, G)
