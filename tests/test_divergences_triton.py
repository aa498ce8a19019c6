"""The Triton twins of the divergence table against its PyTorch entries, for every member."""

import pytest
import torch
import triton
import triton.language as tl

from fgrpo_kernels.backends.triton import tl_divergences
from fgrpo_kernels.backends.triton.tl_divergences import TWINS, phi_constexprs, tl_phi
from fgrpo_kernels.divergences import TABLE, Divergence

BLOCK = 1024
GRID = torch.cat(
    [
        torch.linspace(-100, 100, 801),
        torch.linspace(-1, 1, 401),
        torch.tensor([-80.5, -80.0, -79.5, 79.5, 80.0, 80.5, -2.0, -2.001, -1.999, 1e-6, -1e-6]),
    ]
).float()
# NB: the table's own fp32 forms cancel (softplus(r) − ln 2 near 0, 1 − tanh² r near saturation),
# so a few ulp of an O(1) quantity are allowed absolutely; everything else is held at 1e-6.
RTOL, ATOL = 1e-6, 2.5e-7


@triton.jit
def _sweep_kernel(
    r_ptr, value_ptr, slope_ptr, n, PHI_POS: tl.constexpr, PHI_NEG: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    r = tl.load(r_ptr + offs, mask=ok, other=0.0)
    positive = tl.program_id(1) == 0
    value, slope = tl_phi(r, positive, PHI_POS, PHI_NEG)
    out = tl.program_id(1).to(tl.int64) * n + offs
    tl.store(value_ptr + out, value, mask=ok)
    tl.store(slope_ptr + out, slope, mask=ok)


@triton.jit
def _twin_kernel(r_ptr, value_ptr, slope_ptr, n, TWIN: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    value, slope = TWIN(tl.load(r_ptr + offs, mask=ok, other=0.0))
    tl.store(value_ptr + offs, value, mask=ok)
    tl.store(slope_ptr + offs, slope, mask=ok)


def _dispatch(divergence, r):
    """(value, slope) [2, n] of tl_phi: row 0 with positive=True (φ₊), row 1 with False (φ₋)."""
    value, slope = torch.empty(2, r.numel()), torch.empty(2, r.numel())
    _sweep_kernel[(triton.cdiv(r.numel(), BLOCK), 2)](
        r, value, slope, r.numel(), **phi_constexprs(divergence), BLOCK=BLOCK
    )
    return value, slope


@pytest.mark.parametrize("divergence", list(Divergence), ids=lambda d: TABLE[d].name)
def test_every_divergence_has_a_twin_equal_to_its_table_entry(divergence):
    assert divergence in TWINS, f"{divergence!r} has no Triton twin in tl_divergences.TWINS"
    spec = TABLE[divergence]
    value, slope = _dispatch(divergence, GRID)
    expected = (
        ("φ₊", value[0], spec.phi_pos(GRID)),
        ("dφ₊", slope[0], spec.dphi_pos(GRID)),
        ("φ₋", value[1], spec.phi_neg(GRID)),
        ("dφ₋", slope[1], spec.dphi_neg(GRID)),
    )
    for label, got, want in expected:
        assert torch.isfinite(got).all(), f"{spec.name} {label}: not finite"
        torch.testing.assert_close(
            got, want, rtol=RTOL, atol=ATOL, msg=lambda m, s=spec.name, x=label: f"{s} {x}: {m}"
        )
    for (got_v, got_s), twin in zip(
        ((value[0], slope[0]), (value[1], slope[1])), TWINS[divergence]
    ):
        want_v, want_s = torch.empty_like(GRID), torch.empty_like(GRID)
        _twin_kernel[(triton.cdiv(GRID.numel(), BLOCK),)](
            GRID, want_v, want_s, GRID.numel(), TWIN=twin, BLOCK=BLOCK
        )
        assert torch.equal(got_v, want_v) and torch.equal(got_s, want_s), "tl_phi ≠ TWINS entry"


def test_twins_cover_exactly_the_enum():
    assert set(TWINS) == set(Divergence)


def test_exp_clamp_holds_value_and_slope_beyond_80():
    r = torch.tensor([80.0, 80.5, 200.0, 1e4])
    value, slope = _dispatch(Divergence.HELLINGER, r)
    e80 = torch.tensor(80.0).exp()
    torch.testing.assert_close(value[1], torch.full_like(r, float(e80 - 1)))
    torch.testing.assert_close(slope[1], torch.full_like(r, float(e80)))
    value, slope = _dispatch(Divergence.REVERSE_KL, -r)
    torch.testing.assert_close(value[0], torch.full_like(r, float(e80)))
    torch.testing.assert_close(slope[0], torch.full_like(r, -float(e80)))


def test_a_member_without_a_twin_is_rejected_by_the_dispatcher(monkeypatch):
    entry = TABLE[Divergence.KL]
    monkeypatch.setitem(
        tl_divergences.TABLE, Divergence.KL, type(entry)(**{**vars(entry), "name": "nameless"})
    )
    with pytest.raises(Exception, match="no Triton twin"):
        phi_constexprs(Divergence.KL)
