"""The Triton loss epilogue (interpreted) against the PyTorch path and the float64 reference.

Each case runs `fgrpo_kernels.losses.epilogue.<loss>` twice on the same fp32 log-probs, with
FGRPO_BACKEND=triton and =cpu, and the float64 reference's autograd on a float64 copy; the loss
and dL/dlogp must agree within 1e-5 relative (GIFT 1e-4). Shapes are tiny: the interpreter runs
every program in Python.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fgrpo_kernels import reference as R
from fgrpo_kernels.backends.triton import epilogue_common
from fgrpo_kernels.core import options as O
from fgrpo_kernels.divergences import Divergence
from fgrpo_kernels.losses import epilogue as E
from fgrpo_kernels.testing import batches

from .epilogue_cases import (
    DIVS,
    LEVEL_REDUCTIONS,
    QUICK,
    SOURCES,
    both,
    check,
    grpo_options,
    name_of,
    reference_grad,
    run_fgrpo,
    run_gift,
    run_grpo,
    side_inputs,
)


@pytest.mark.parametrize("level,reduction", LEVEL_REDUCTIONS, ids=lambda x: name_of(x))
@pytest.mark.parametrize("divergence", DIVS, ids=name_of)
@settings(max_examples=5, **QUICK)
@given(
    b=batches(),
    source=st.sampled_from(SOURCES),
    weights=st.booleans(),
    beta=st.sampled_from([0.1, 1.0]),
)
def test_fgrpo_matches(monkeypatch, divergence, level, reduction, b, source, weights, beta):
    run_fgrpo(monkeypatch, b, divergence, level, reduction, source, weights, beta)


@pytest.mark.parametrize("weights", [False, True], ids=["plain", "is_weights"])
@pytest.mark.parametrize("source", SOURCES)
@settings(max_examples=5, **QUICK)
@given(b=batches(), divergence=st.sampled_from(DIVS), lr=st.sampled_from(LEVEL_REDUCTIONS))
def test_fgrpo_every_source_and_weighting(monkeypatch, source, weights, b, divergence, lr):
    run_fgrpo(monkeypatch, b, divergence, *lr, source, weights, 0.5)


@pytest.mark.parametrize("loss_type", list(O.LossType), ids=name_of)
@settings(max_examples=10, **QUICK)
@given(
    b=batches(),
    data=st.data(),
    has_old=st.booleans(),
    has_ref=st.booleans(),
    n_items=st.sampled_from([None, 7, "tensor"]),
    max_len=st.sampled_from([None, 12]),
    ratio=st.sampled_from([None, "token", "row", "flat"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_grpo_matches(monkeypatch, loss_type, b, data, has_old, has_ref, n_items, max_len, ratio,
                      seed):  # fmt: skip
    """Every loss type with a draw of every option (level, β, ε, δ, dual clip, bias-corrected KL,
    entropy bonus and mask, off-policy mask, ρ of each shape, loss-type parameters)."""
    kwargs = data.draw(grpo_options(loss_type), label="options")
    opts = O.GRPOOptions.parse(max_completion_length=max_len, **kwargs)
    rho, entropy, sampling = side_inputs(b, ratio, seed)
    f32 = [None if t is None else t.float() for t in (rho, entropy, sampling)]
    run_grpo(monkeypatch, b, opts, has_old, has_ref, n_items, *f32)


@pytest.mark.parametrize("unbiased", [True, False], ids=["unbiased", "biased"])
@pytest.mark.parametrize("detach", [False, True], ids=["through_stats", "detach_stats"])
@settings(max_examples=10, **QUICK)
@given(b=batches(), beta=st.sampled_from([0.5, 1.0, 3.0]))
def test_gift_matches(monkeypatch, detach, unbiased, b, beta):
    run_gift(monkeypatch, b, detach, unbiased, beta)


@pytest.mark.parametrize("divergence", DIVS, ids=name_of)
@settings(max_examples=5, **QUICK)
@given(b=batches(), beta=st.sampled_from([0.1, 1.0]))
def test_fdo_matches(monkeypatch, divergence, b, beta):
    opts = O.FDOOptions(divergence, beta)
    args = (b.logps.float(), b.ref_logps, b.mask, b.chosen, opts)
    triton_out, cpu_out = both(monkeypatch, E.fdo, *args)
    want = reference_grad(
        R.fdo_loss,
        b.logps.float(),
        ref_logps=b.ref_logps,
        mask=b.mask,
        chosen=b.chosen,
        divergence=divergence,
        beta=beta,
    )
    check(f"fdo {name_of(divergence)}", triton_out, want, cpu_out)


# ----------------------------------------------------------------------------- loops over T


@pytest.mark.parametrize(
    "loss", ["fgrpo_token", "fgrpo_sequence", "grpo_token", "grpo_sequence", "gift"]
)
@settings(max_examples=3, **QUICK)
@given(b=batches(max_len=9))
def test_rows_longer_than_a_tile_are_walked_in_chunks(monkeypatch, loss, b):
    """With an 8-element tile, every pass over T takes several BLOCK_T chunks."""
    monkeypatch.setattr(epilogue_common, "TILE", 8)
    if loss.startswith("fgrpo"):
        level = O.Level.TOKEN if loss.endswith("token") else O.Level.SEQUENCE
        run_fgrpo(monkeypatch, b, Divergence.JS, level, O.Reduction.SUM, "rewards_group", True, 0.5)
    elif loss.startswith("grpo"):
        level = O.Level.TOKEN if loss.endswith("token") else O.Level.SEQUENCE
        opts = O.GRPOOptions(
            O.LossType.GRPO, 0.04, 0.2, 0.28, level, use_bias_correction_kl=True,
            entropy_coef=0.1, top_entropy_quantile=0.5,
        )  # fmt: skip
        rho, entropy, sampling = side_inputs(b, "token", 0)
        run_grpo(monkeypatch, b, opts, True, True, None, rho.float(), entropy.float(), None)
    else:
        run_gift(monkeypatch, b, False, True, 1.0)


@pytest.mark.parametrize("ratio", ["token", "row", "flat"])
@pytest.mark.parametrize("level", list(O.Level), ids=name_of)
@settings(max_examples=4, **QUICK)
@given(b=batches(), divergence=st.sampled_from(DIVS), seed=st.integers(0, 2**31 - 1))
def test_fgrpo_ratio_and_entropy_bonus(monkeypatch, level, ratio, b, divergence, seed):
    """f-GRPO with the rollout ratio ρ on each unit and an entropy bonus (dL/dentropy too)."""
    if level == O.Level.SEQUENCE and ratio == "token":
        ratio = "row"
    rho, entropy, _ = side_inputs(b, ratio, seed)
    rho, entropy = rho.float(), entropy.float()
    reduction = O.LEVEL_REDUCTIONS[level][0]
    opts = O.FGRPOOptions(divergence, 0.5, level, reduction, entropy_coef=0.1)
    args = (b.logps.float(), entropy, b.ref_logps, b.mask, b.advantages, None, None, rho, opts)
    triton_out, cpu_out = both(monkeypatch, E.fgrpo, *args)
    want = reference_grad(
        R.fgrpo_loss, b.logps.float(), entropy_grad=True, ref_logps=b.ref_logps,
        advantages=b.advantages, mask=b.mask, divergence=divergence, beta=0.5,
        level=name_of(level), vllm_is_ratio=rho, entropy=entropy, entropy_coef=0.1,
    )  # fmt: skip
    check(f"fgrpo {name_of(divergence)} {name_of(level)} rho {ratio}", triton_out, want, cpu_out)
