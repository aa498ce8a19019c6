"""Every fused module equals the reference on the same inputs: loss and d/d(hidden, weight, bias).

Run on the CPU path and, where the Triton kernels are present, on the interpreted Triton path.
The reference runs in float64 on the inputs upcast (bf16 inputs: the same rounded values).
"""

import importlib.util

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import fgrpo_kernels as fk
from fgrpo_kernels import reference as R
from fgrpo_kernels.divergences import NAMES
from fgrpo_kernels.testing import linear_batches, rel_error

from .epilogue_cases import grpo_options, side_inputs

HAS_TRITON_PATH = importlib.util.find_spec("fgrpo_kernels.backends.triton.epilogue") is not None
BACKENDS = [
    "cpu",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            not HAS_TRITON_PATH, reason="Triton kernels not built in this checkout"
        ),
    ),
]
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("FGRPO_BACKEND", request.param)
    return request.param


def _compare(lb, module_fn, reference_fn, tol, label, tau=1.0, grad_floor=1e-6, entropy=False):
    """module_fn(hidden, weight, bias) and reference_fn(logps64) → loss; compare values/grads.
    With `entropy`, reference_fn(logps64, entropy64) gets the float64 entropies too."""
    leaves = [lb.hidden, lb.weight] + ([] if lb.bias is None else [lb.bias])
    ours_in = [t.clone().requires_grad_(True) for t in leaves]
    ref_in = [t.double().requires_grad_(True) for t in leaves]
    loss, metrics = module_fn(ours_in[0], ours_in[1], ours_in[2] if lb.bias is not None else None)
    ref_bias = ref_in[2] if lb.bias is not None else None
    out = R.logprobs(ref_in[0], ref_in[1], lb.completion_ids, ref_bias, tau, return_entropy=entropy)
    want = reference_fn(*out) if entropy else reference_fn(out)
    grads = torch.autograd.grad(loss, ours_in)
    want_grads = torch.autograd.grad(want, ref_in)
    # A loss whose terms cancel (FDO's two pools, ±advantages) keeps fp32's absolute error of
    # the summed log-ratios: compared absolutely below 0.1.
    errs = {"loss": rel_error(loss, want, 0.1)}
    for name, g, w in zip(("hidden", "weight", "bias"), grads, want_grads):
        assert torch.isfinite(g).all(), f"{label}: d/d{name} not finite"
        errs[f"d/d{name}"] = rel_error(g, w, grad_floor)
    assert max(errs.values()) <= tol, f"{label}: {errs}"
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())
    return metrics


EXAMPLES = settings(max_examples=6)


@EXAMPLES
@given(
    lb=linear_batches(),
    div=st.sampled_from(NAMES),
    level=st.sampled_from(R.LEVELS),
    data=st.data(),
    tau=st.sampled_from([1.0, 0.7]),
    rewards_in=st.booleans(),
    is_weights=st.booleans(),
    ratio=st.sampled_from([None, "row", "token"]),
    coef=st.sampled_from([0.0, 0.1]),
)
def test_fgrpo_module(backend, lb, div, level, data, tau, rewards_in, is_weights, ratio, coef):
    b = lb.batch
    ratio = "row" if level == "sequence" and ratio == "token" else ratio
    rho = side_inputs(b, ratio, 0)[0]
    rho = None if rho is None else rho.float()
    red = data.draw(st.sampled_from(R.REDUCTIONS[level]), label="reduction")
    scale = data.draw(st.sampled_from(R.SCALES), label="scale") if rewards_in else "group"
    G = b.num_generations
    module = fk.FusedLinearFGRPOLoss(
        div,
        0.2,
        level,
        red,
        num_generations=G,
        temperature=tau,
        scale_rewards=scale,
        group_is_weights=is_weights,
        entropy_coef=coef,
    )
    adv = R.group_normalize(b.rewards.double(), G, scale=scale) if rewards_in else b.advantages
    kwargs = {"rewards": b.rewards} if rewards_in else {"advantages": b.advantages}
    if is_weights:
        kwargs.update(rewards=b.rewards, old_per_token_logps=b.old_logps)

    def ours(h, w, bias):
        return module(
            h, w, lb.completion_ids, b.mask, ref_per_token_logps=b.ref_logps, bias=bias,
            vllm_is_ratio=rho, **kwargs,
        )  # fmt: skip

    def ref(lp, entropy):
        return R.fgrpo_loss(
            lp,
            b.ref_logps.double(),
            adv.double(),
            b.mask,
            div,
            0.2,
            level,
            red,
            group_is_weights=is_weights,
            old_logps=b.old_logps.double(),
            rewards=b.rewards.double() if is_weights else None,
            num_generations=G,
            vllm_is_ratio=rho,
            entropy=entropy,
            entropy_coef=coef,
        )

    label = f"f-GRPO {div} {level} {red} rho {ratio} c {coef} {backend}"
    m = _compare(lb, ours, ref, TOL[lb.hidden.dtype], label, tau, entropy=True)
    assert {"loss", "kl", "implicit_reward"} <= m.keys()


@settings(max_examples=12)
@given(
    lb=linear_batches(),
    data=st.data(),
    tau=st.sampled_from([1.0, 0.7]),
    no_old=st.booleans(),
    n_items=st.sampled_from([None, 9]),
    ratio=st.sampled_from([None, "token", "row", "flat"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_grpo_module(backend, lb, data, tau, no_old, n_items, ratio, seed):
    """Every loss type with a draw of every option; the entropy (mask, bonus) and its gradient
    come from the same fused kernel as the log-probs."""
    b = lb.batch
    kwargs = data.draw(grpo_options(), label="options")
    if kwargs["top_entropy_quantile"] < 1.0:
        # NB: a quantile between two entropies: at an exact order statistic the threshold is
        # one token's own entropy, which fp32 and float64 round differently.
        kwargs["top_entropy_quantile"] = 0.37
    T = b.logps.shape[1]
    module = fk.FusedLinearGRPOLoss(temperature=tau, max_completion_length=T + 2, **kwargs)
    old = None if no_old else b.old_logps
    rho, _, sampling = side_inputs(b, ratio, seed)
    rho = None if rho is None else rho.float()

    def ours(h, w, bias):
        return module(
            h, w, lb.completion_ids, b.mask, b.advantages, bias, ref_per_token_logps=b.ref_logps,
            old_per_token_logps=old, num_items_in_batch=n_items, vllm_is_ratio=rho,
            sampling_per_token_logps=sampling.float(),
        )  # fmt: skip

    def ref(lp, entropy):
        return R.grpo_loss(
            lp, None if old is None else old.double(), b.ref_logps.double(),
            b.advantages.double(), b.mask, max_completion_length=T + 2, num_items_in_batch=n_items,
            vllm_is_ratio=rho, entropy=entropy, sampling_logps=sampling, **kwargs,
        )  # fmt: skip

    label = f"GRPO {kwargs} {backend}"
    m = _compare(lb, ours, ref, TOL[lb.hidden.dtype], label, tau, entropy=True)
    clipped = kwargs["loss_type"] in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
    assert ({"clip_ratio/low_mean", "clip_ratio/region_mean"} <= m.keys()) == clipped
    assert ("kl" in m) == (kwargs["beta"] != 0.0)


@EXAMPLES
@given(
    lb=linear_batches(),
    detach=st.booleans(),
    unbiased=st.booleans(),
    beta=st.sampled_from([0.5, 1.0]),
)
def test_gift_module(backend, lb, detach, unbiased, beta):
    """GIFT's z-score Jacobian scales as 1/σ_k: fp32 log-probs cannot give 1e-4 on gradients of
    groups whose summed log-ratios nearly coincide, so such draws are skipped; and a saturated
    z-score (G = 2) leaves a gradient made of eps alone, compared absolutely below 1e-3."""
    b = lb.batch
    G = b.num_generations
    lp64 = R.logprobs(
        lb.hidden.double(),
        lb.weight.double(),
        lb.completion_ids,
        None if lb.bias is None else lb.bias.double(),
    )
    k = torch.where(b.mask, lp64 - b.ref_logps.double(), 0.0).sum(-1).reshape(-1, G)
    assume(G == 1 or float(k.std(-1, correction=0).min()) > 1e-2)
    module = fk.FusedLinearGIFTLoss(G, beta, detach_stats=detach, unbiased=unbiased)

    def ours(h, w, bias):
        return module(h, w, lb.completion_ids, b.mask, b.rewards, b.ref_logps, bias=bias)

    def ref(lp):
        return R.gift_loss(
            lp,
            b.ref_logps.double(),
            b.rewards.double(),
            b.mask,
            G,
            beta,
            unbiased=unbiased,
            detach_stats=detach,
        )

    tol = max(1e-4, TOL[lb.hidden.dtype])
    _compare(lb, ours, ref, tol, f"GIFT detach={detach} {backend}", grad_floor=1e-3)


@EXAMPLES
@given(lb=linear_batches(), div=st.sampled_from(NAMES), lam=st.sampled_from([0.0, 0.3, 1.0]))
def test_fdo_and_fhal_modules(backend, lb, div, lam):
    b = lb.batch
    fdo = fk.FusedLinearFDOLoss(div, 0.1)

    def ours_fdo(h, w, bias):
        return fdo(h, w, lb.completion_ids, b.mask, b.chosen, b.ref_logps, bias=bias)

    def ref_fdo(lp):
        return R.fdo_loss(lp, b.ref_logps.double(), b.mask, b.chosen, div, 0.1)

    _compare(lb, ours_fdo, ref_fdo, TOL[lb.hidden.dtype], f"FDO {div} {backend}")
    fhal = fk.FusedLinearFHALLoss(div, 0.1, lam=lam)

    def ours_fhal(h, w, bias):
        return fhal(
            h,
            w,
            lb.completion_ids,
            b.mask,
            h,
            lb.completion_ids,
            b.mask,
            b.chosen,
            advantages=b.advantages,
            ref_per_token_logps=b.ref_logps,
            pref_ref_per_token_logps=b.ref_logps,
            bias=bias,
        )

    def ref_fhal(lp):
        ref = b.ref_logps.double()
        return R.fhal_loss(
            lp, ref, b.advantages.double(), b.mask, lp, ref, b.mask, b.chosen, div, 0.1, lam
        )

    _compare(lb, ours_fhal, ref_fhal, TOL[lb.hidden.dtype], f"f-HAL {div} {backend}")


def test_in_call_reference_logprobs_equal_passed_ones(backend):
    """ref_hidden/ref_weight/ref_bias computed forward-only give the same loss as passing them."""
    torch.manual_seed(0)
    B, T, H, V = 4, 5, 8, 23
    h, rh = torch.randn(B, T, H), torch.randn(B, T, H)
    w, rw, rb = torch.randn(V, H), torch.randn(V, H), torch.randn(V)
    ids, mask, adv = torch.randint(0, V, (B, T)), torch.rand(B, T) > 0.3, torch.randn(B)
    ref = fk.fused_linear_logprobs(rh, rw, ids, rb)
    for module in (fk.FusedLinearFGRPOLoss(), fk.FusedLinearGRPOLoss()):
        kw = {"advantages": adv} if isinstance(module, fk.FusedLinearFGRPOLoss) else {}
        args = () if kw else (adv,)
        a, _ = module(h, w, ids, mask, *args, ref_per_token_logps=ref, **kw)
        name = "ref_hidden" if kw else "ref_input"
        b, _ = module(h, w, ids, mask, *args, ref_weight=rw, ref_bias=rb, **{name: rh}, **kw)
        torch.testing.assert_close(a, b)


def test_frozen_lm_head_gives_no_weight_gradient(backend):
    torch.manual_seed(1)
    h = torch.randn(2, 3, 8, requires_grad=True)
    w = torch.randn(11, 8)
    loss, _ = fk.FusedLinearGRPOLoss(beta=0.0)(
        h, w, torch.randint(0, 11, (2, 3)), torch.ones(2, 3), torch.tensor([1.0, -1.0])
    )
    loss.backward()
    assert h.grad is not None and torch.isfinite(h.grad).all() and w.grad is None


def test_entropy_metric(backend):
    torch.manual_seed(2)
    h, w = torch.randn(2, 4, 6), torch.randn(9, 6)
    ids, mask = torch.randint(0, 9, (2, 4)), torch.ones(2, 4)
    _, m = fk.FusedLinearGRPOLoss(beta=0.0, compute_entropy=True)(
        h, w, ids, mask, torch.tensor([1.0, -1.0])
    )
    want = R.logprobs(h, w, ids, return_entropy=True)[1].mean()
    torch.testing.assert_close(m["entropy"], want, rtol=1e-5, atol=1e-6)
