"""Shared cases of the epilogue tests: run a loss on the Triton and the PyTorch path, take the
float64 reference's autograd, and compare (loss, dL/dlogp) with a labelled relative error."""

import dataclasses

import torch
from hypothesis import HealthCheck
from hypothesis import strategies as st

from fgrpo_kernels import reference as R
from fgrpo_kernels.core import grpo_math
from fgrpo_kernels.core import options as O
from fgrpo_kernels.divergences import TABLE, Divergence
from fgrpo_kernels.losses import epilogue as E
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
            result = fn(*args)
            out.append(result[:2] if len(result) > 2 and result[2] is None else result)
    return out


def f64(x):
    return x.detach().double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def reference_grad(loss_fn, logps, entropy_grad=False, **kwargs):
    """(loss, dloss/dlogps[, dloss/dentropy]) of a reference loss on float64 copies of every
    floating input."""
    x = logps.detach().double().requires_grad_(True)
    kwargs = {k: f64(v) for k, v in kwargs.items()}
    leaves = [x]
    if entropy_grad:
        kwargs["entropy"] = kwargs["entropy"].requires_grad_(True)
        leaves.append(kwargs["entropy"])
    loss = loss_fn(x, **kwargs)
    return (loss.detach(), *torch.autograd.grad(loss, leaves))


def rel_errors(got, want, loss_floor):
    errors = {
        "loss": rel_error(got[0], want[0], loss_floor),
        "dL/dlogp": rel_error(got[1], want[1], GRAD_FLOOR),
    }
    if len(want) > 2:
        errors["dL/dentropy"] = rel_error(got[2], want[2], GRAD_FLOOR)
    return errors


def check(label, got, want, cpu=None, rtol=1e-5, loss_floor=1.0):
    """`got` (Triton) against the float64 reference `want`, and against the PyTorch path `cpu`
    wherever that path is itself within rtol/2 of the float64 truth. Its fp32 is not, in cases
    the epilogue handles in float64: flat fp32 reward groups (an ulp-off group mean becomes
    a = ±1e-3), GIFT's through-σ slope at G = 2, sums of T log-probs in IS weights (3e-5)."""
    loss, grad = got[:2]
    assert len(got) == len(want), f"{label}: dL/dentropy returned {len(got) > 2}"
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
    args = (b.logps.float(), None, b.ref_logps, b.mask, adv, rewards, b.old_logps, None, opts)
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


@st.composite
def grpo_options(draw, loss_type=None):
    """Public keyword options of `reference.grpo_loss`: a loss type (drawn unless given) with a
    valid importance-sampling level and a draw of every option."""
    if loss_type is None:
        loss_type = draw(st.sampled_from(list(O.LossType)), label="loss_type")
    spec = O.LOSS_TYPE_SPECS[loss_type]
    clipped = spec.objective == O.Objective.CLIPPED
    levels = ["token"] if spec.token_level_only else ["token", "sequence"]
    opts = dict(
        loss_type=O.name_of(loss_type),
        importance_sampling_level=draw(st.sampled_from(levels), label="level"),
        beta=draw(st.sampled_from([0.0, 0.04, 0.5]), label="beta"),
        epsilon_low=0.2,
        epsilon_high=draw(st.sampled_from([0.2, 0.28, 5.0]), label="epsilon_high"),
        delta=draw(st.sampled_from([None, 1.3, 3.0]), label="delta") if clipped else None,
        clip_ratio_c=draw(st.sampled_from([None, 1.5, 3.0]), label="clip_c") if clipped else None,
        use_bias_correction_kl=draw(st.booleans(), label="bias_kl"),
        entropy_coef=draw(st.sampled_from([0.0, 0.05]), label="entropy_coef"),
        top_entropy_quantile=draw(st.sampled_from([1.0, 0.5, 0.2, 0.0]), label="top_q"),
        off_policy_mask_threshold=draw(st.sampled_from([None, 0.0, 0.3]), label="off_policy"),
    )
    if loss_type == O.LossType.SAPO and draw(st.booleans(), label="sapo_params"):
        opts.update(sapo_temperature_pos=0.5, sapo_temperature_neg=2.0)
    if loss_type == O.LossType.VESPO and draw(st.booleans(), label="vespo_params"):
        opts.update(vespo_k_pos=1.0, vespo_lambda_pos=0.5, vespo_k_neg=4.0, vespo_lambda_neg=5.0)
    return opts


def side_inputs(b, kind, seed):
    """ρ of the drawn kind ([B, T], [B, 1], [B] or None), entropies exactly representable in
    fp32 (the entropy mask's quantile is taken in fp32, as TRL does) and sampling log-probs."""
    gen = torch.Generator().manual_seed(seed)
    B, T = b.logps.shape
    rho = (0.2 + 1.5 * torch.rand(B, T, generator=gen, dtype=torch.float64)) * b.mask
    rho = {"token": rho, "row": rho[:, :1] + 0.2, "flat": rho[:, 0] + 0.2, None: None}[kind]
    entropy = (3 * torch.rand(B, T, generator=gen)).double() * b.mask
    sampling = b.old_logps + 0.4 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    return rho, entropy, sampling


def grpo_kwargs(opts: O.GRPOOptions) -> dict:
    """The public spelling of parsed GRPO options (for `reference.grpo_loss`)."""
    kwargs = {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)}
    kwargs["loss_type"] = name_of(kwargs["loss_type"])
    kwargs["importance_sampling_level"] = name_of(kwargs.pop("level"))
    own = dict(opts.spec.params)
    return {k: v for k, v in kwargs.items() if k not in O.LOSS_TYPE_PARAMS or k in own}


def run_grpo(monkeypatch, b, opts, has_old, has_ref, n_items, ratio=None, entropy=None,
             sampling=None):  # fmt: skip
    old = b.old_logps if has_old else None
    ref = b.ref_logps if has_ref else None
    n_items = torch.tensor(10) if n_items == "tensor" else n_items
    norms = grpo_math.normalisers(b.mask, opts, n_items, entropy)
    args = (b.logps.float(), entropy, old, ref, b.mask, b.advantages, ratio, sampling, norms, opts)
    triton_out, cpu_out = both(monkeypatch, E.grpo, *args)
    want = reference_grad(
        R.grpo_loss, b.logps.float(), entropy_grad=opts.entropy_coef != 0.0, old_logps=old,
        ref_logps=ref, advantages=b.advantages, mask=b.mask, num_items_in_batch=n_items,
        vllm_is_ratio=ratio, entropy=entropy, sampling_logps=sampling, **grpo_kwargs(opts),
    )  # fmt: skip
    label = (
        f"grpo {name_of(opts.loss_type)} {name_of(opts.level)} {opts} old={has_old} ref={has_ref}"
    )
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
