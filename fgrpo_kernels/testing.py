"""Check your own GRPO-family loss against ours: hypothesis strategies and a comparison helper.

    from hypothesis import given
    from fgrpo_kernels import reference
    from fgrpo_kernels.testing import batches, assert_loss_close

    @given(batches())
    def test_my_loss(batch):
        assert_loss_close(my_fgrpo_loss, reference.fgrpo_loss, batch.kwargs("logps", "ref_logps",
                          "advantages", "mask"), wrt=("logps",))

`batches()` draws B = groups × G contiguous completions with ragged masks (empty rows too),
zero-variance reward groups, binary or continuous rewards, extreme log-probs and fp32/bf16
tensors. `assert_loss_close` runs the candidate on the inputs as drawn and the reference on a
float64 copy, compares the loss and the gradients of the `wrt` inputs, and reports a labelled
relative error for each. Needs the `hypothesis` package (in the `dev` extra).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields

import torch
from hypothesis import strategies as st

__all__ = ["Batch", "LinearBatch", "assert_loss_close", "batches", "linear_batches", "rel_error"]


@dataclass
class Batch:
    """One drawn batch of per-token log-probs. Shapes: [B, T] per token, [B] per row."""

    logps: torch.Tensor
    ref_logps: torch.Tensor
    old_logps: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    chosen: torch.Tensor
    num_generations: int

    def kwargs(self, *names: str) -> dict:
        """The named fields as a dict (all fields when no name is given)."""
        names = names or tuple(f.name for f in fields(self))
        return {n: getattr(self, n) for n in names}


@dataclass
class LinearBatch:
    """A batch for the fused modules: hidden [B, T, H], lm_head weight [V, H], ids [B, T]."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    completion_ids: torch.Tensor
    batch: Batch


def _rewards(gen, n_groups, G, binary, flat_groups):
    if binary:
        r = (torch.rand(n_groups, G, generator=gen, dtype=torch.float64) > 0.5).double()
    else:
        r = torch.randn(n_groups, G, generator=gen, dtype=torch.float64)
    flat = torch.rand(n_groups, 1, generator=gen, dtype=torch.float64) < flat_groups
    return torch.where(flat, r[:, :1], r).reshape(-1)


def _mask(gen, B, T, holes):
    """Right-padded rows of random length (0 included), optional holes; one row stays full."""
    lengths = torch.randint(0, T + 1, (B,), generator=gen)
    full = int(torch.randint(0, B, (1,), generator=gen))
    lengths[full] = T
    m = torch.arange(T)[None, :] < lengths[:, None]
    if holes:
        m &= torch.rand(B, T, generator=gen) > 0.2
        m[full] = True
    return m


@st.composite
def batches(
    draw,
    *,
    max_groups: int = 3,
    max_generations: int = 4,
    max_len: int = 9,
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
    extreme: bool = True,
) -> Batch:
    """Draw a `Batch`: contiguous groups of G rows, ragged masks, awkward rewards."""
    G = draw(st.integers(1, max_generations), label="num_generations")
    n_groups = draw(st.integers(1, max_groups), label="groups")
    if n_groups * G < 2:
        n_groups = 2
    T = draw(st.integers(1, max_len), label="T")
    dtype = draw(st.sampled_from(list(dtypes)), label="dtype")
    spread = draw(st.sampled_from([0.05, 1.0, 4.0] + ([40.0] if extreme else [])), label="spread")
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1), label="seed"))
    B = n_groups * G

    def logps():
        return -(torch.rand(B, T, generator=gen, dtype=torch.float64) * spread)

    rewards = _rewards(gen, n_groups, G, draw(st.booleans(), label="binary"), 0.3)
    chosen = torch.rand(B, generator=gen) > 0.5
    chosen[0], chosen[1] = True, False
    centred = (rewards.reshape(-1, G) - rewards.reshape(-1, G).mean(-1, keepdim=True)).reshape(-1)
    mask = _mask(gen, B, T, draw(st.booleans(), label="holes"))
    return Batch(
        logps=logps().to(dtype),
        ref_logps=logps().to(dtype),
        old_logps=logps().to(dtype),
        mask=mask,
        advantages=centred.to(dtype),
        rewards=rewards.to(dtype),
        chosen=chosen,
        num_generations=G,
    )


@st.composite
def linear_batches(
    draw,
    *,
    max_hidden: int = 24,
    max_vocab: int = 70,
    with_bias: bool | None = None,
    **batch_kwargs,
) -> LinearBatch:
    """Draw a `LinearBatch`: a `Batch` plus hidden states, an lm_head and completion ids."""
    batch = draw(batches(**batch_kwargs))
    B, T = batch.logps.shape
    H = draw(st.integers(1, max_hidden), label="H")
    V = draw(st.integers(2, max_vocab), label="V")
    bias_on = draw(st.booleans(), label="bias") if with_bias is None else with_bias
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1), label="seed"))
    dtype = batch.logps.dtype
    hidden = torch.randn(B, T, H, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(V, H, generator=gen, dtype=torch.float64) / H**0.5).to(dtype)
    bias = torch.randn(V, generator=gen, dtype=torch.float64).to(dtype) if bias_on else None
    ids = torch.randint(0, V, (B, T), generator=gen)
    return LinearBatch(hidden, weight, bias, ids, batch)


def rel_error(actual: torch.Tensor, expected: torch.Tensor, floor: float = 1e-12) -> float:
    """||actual − expected|| / max(||expected||, floor), in float64."""
    a, e = actual.detach().double(), expected.detach().double()
    return float((a - e).norm() / max(float(e.norm()), floor))


def _leaves(inputs: Mapping, wrt: Sequence[str], dtype: torch.dtype | None):
    out = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if dtype is not None and value.is_floating_point():
                value = value.to(dtype)
            if name in wrt:
                value = value.clone().requires_grad_(True)
        out[name] = value
    return out


def assert_loss_close(
    candidate: Callable,
    reference: Callable,
    inputs: Mapping,
    wrt: Sequence[str] = ("logps",),
    rtol: float = 1e-5,
    floor: float = 1e-2,
    label: str = "",
) -> dict[str, float]:
    """Compare candidate(**inputs) with reference(**inputs in float64), loss and gradients.

    The candidate sees the inputs in their own dtypes, the reference a float64 copy. Errors are
    ||candidate − reference|| / max(||reference||, floor): quantities smaller than `floor` are
    compared absolutely (a loss that cancels to ~0 has no meaningful relative error). Raises an
    AssertionError listing the error of the loss and of d loss / d x for x in `wrt` when any
    exceeds `rtol`; returns the errors otherwise.
    """
    cand_in, ref_in = _leaves(inputs, wrt, None), _leaves(inputs, wrt, torch.float64)
    cand_loss, ref_loss = candidate(**cand_in), reference(**ref_in)
    if isinstance(cand_loss, tuple):
        cand_loss = cand_loss[0]
    errors = {"loss": rel_error(cand_loss, ref_loss, floor)}
    cand_grads = torch.autograd.grad(cand_loss, [cand_in[n] for n in wrt], allow_unused=True)
    ref_grads = torch.autograd.grad(ref_loss, [ref_in[n] for n in wrt], allow_unused=True)
    for name, gc, gr in zip(wrt, cand_grads, ref_grads):
        gc = torch.zeros_like(cand_in[name]) if gc is None else gc
        gr = torch.zeros_like(ref_in[name]) if gr is None else gr
        if not torch.isfinite(gc).all():
            errors[f"d/d{name}"] = float("inf")
        else:
            errors[f"d/d{name}"] = rel_error(gc, gr, floor)
    bad = {k: v for k, v in errors.items() if not v <= rtol}
    if bad or not torch.isfinite(cand_loss).all():
        desc = ", ".join(f"{k}: rel err {v:.3g}" for k, v in errors.items())
        raise AssertionError(
            f"{label or 'loss'} differs from the reference (rtol {rtol:g}): {desc}; "
            f"loss {float(cand_loss.detach()):.6g} vs {float(ref_loss.detach()):.6g}"
        )
    return errors
