"""The divergence table (docs/math.md §3): slopes, conjugacy, monotonicity, saturation, names,
docs."""

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fgrpo_kernels.divergences import (
    NAMES,
    TABLE,
    Divergence,
    dphi,
    get_divergence,
    markdown_table,
    phi,
)

SPECS = list(TABLE.values())
GRID = torch.cat([torch.linspace(-100, 100, 801), torch.tensor([-80.5, -79.5, 79.5, 80.5, 81.5])])
GRID = GRID.double()


def _autograd_slope(fn, r):
    r = r.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(fn(r).sum(), r)
    return g


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_closed_form_slopes_equal_autograd_on_grid(spec):
    for fn, dfn in ((spec.phi_pos, spec.dphi_pos), (spec.phi_neg, spec.dphi_neg)):
        torch.testing.assert_close(dfn(GRID), _autograd_slope(fn, GRID), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@given(r=st.floats(-120, 120, allow_nan=False))
def test_closed_form_slopes_equal_autograd_on_drawn_r(spec, r):
    x = torch.tensor([r], dtype=torch.float64)
    for fn, dfn in ((spec.phi_pos, spec.dphi_pos), (spec.phi_neg, spec.dphi_neg)):
        torch.testing.assert_close(dfn(x), _autograd_slope(fn, x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_phi_pos_is_minus_link_and_phi_neg_is_conjugate_of_link(spec):
    r = torch.linspace(-15, 15, 301, dtype=torch.float64)
    t = spec.g(r)
    torch.testing.assert_close(spec.phi_pos(r), -t, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(spec.phi_neg(r), spec.conjugate(t), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@given(r=st.floats(-6, 6), u=st.floats(0, 50))
def test_fenchel_young(spec, r, u):
    """f*(t) ≥ t·u − f(u) for every u ≥ 0, with equality at the maximiser u*(t)."""
    t = spec.g(torch.tensor(r, dtype=torch.float64))
    u = torch.tensor(u, dtype=torch.float64)
    conj = spec.conjugate(t)
    assert conj >= t * u - spec.f(u) - 1e-9 * (1 + abs(float(t * u)))
    u_star = spec.maximiser(t)
    torch.testing.assert_close(t * u_star - spec.f(u_star), conj, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_monotone(spec):
    """φ₊ strictly decreasing (a good answer costs less as r grows), φ₋ non-decreasing."""
    r = torch.linspace(-10, 10, 2001, dtype=torch.float64)
    assert (spec.phi_pos(r).diff() < 0).all()
    assert (spec.phi_neg(r).diff() >= 0).all()
    wide = torch.linspace(-300, 300, 6001, dtype=torch.float64)
    assert (spec.phi_pos(wide).diff() <= 0).all()
    assert (spec.phi_neg(wide).diff() >= 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_saturation_finite_value_and_slope(spec, dtype):
    r = torch.tensor([-1e6, -1e4, -500.0, -81.0, 81.0, 500.0, 1e4, 1e6], dtype=dtype)
    for fn, dfn in ((spec.phi_pos, spec.dphi_pos), (spec.phi_neg, spec.dphi_neg)):
        assert torch.isfinite(fn(r)).all() and torch.isfinite(dfn(r)).all()
        assert torch.isfinite(_autograd_slope(fn, r)).all()


def test_exp_clamp_holds_value_and_slope_at_80():
    kl = TABLE[Divergence.KL]
    r = torch.tensor([81.0, 200.0], dtype=torch.float64)
    torch.testing.assert_close(kl.phi_neg(r), torch.full_like(r, math.exp(80.0)))
    torch.testing.assert_close(_autograd_slope(kl.phi_neg, r), torch.full_like(r, math.exp(80.0)))


def test_pearson_uses_the_exact_conjugate_below_minus_two():
    p = TABLE[Divergence.PEARSON]
    r = torch.tensor([-2.0, -3.0, -10.0], dtype=torch.float64)
    torch.testing.assert_close(p.phi_neg(r), torch.tensor([-1.0, -1.0, -1.0], dtype=torch.float64))
    torch.testing.assert_close(p.dphi_neg(r), torch.zeros(3, dtype=torch.float64))


def test_reverse_kl_link_is_minus_exp():
    rk = TABLE[Divergence.REVERSE_KL]
    r = torch.tensor([-3.0, 0.0, 2.0], dtype=torch.float64)
    torch.testing.assert_close(rk.g(r), -torch.exp(-r))
    torch.testing.assert_close(rk.phi_neg(r), r - 1.0)


def test_phi_picks_branch_by_sign():
    r = torch.tensor([0.5, 0.5], dtype=torch.float64)
    pos = torch.tensor([True, False])
    for name in NAMES:
        spec = TABLE[get_divergence(name)]
        torch.testing.assert_close(
            phi(r, pos, name), torch.stack([spec.phi_pos(r[0]), spec.phi_neg(r[1])])
        )
        torch.testing.assert_close(
            dphi(r, pos, name), torch.stack([spec.dphi_pos(r[0]), spec.dphi_neg(r[1])])
        )


SHIPPED = ("kl", "reverse_kl", "pearson", "hellinger", "js", "tv")


def test_names_and_enum():
    # the six public names and their enum values are fixed; a new divergence is appended
    assert NAMES[: len(SHIPPED)] == SHIPPED
    assert [get_divergence(n) for n in NAMES] == list(Divergence)
    assert get_divergence("Pearson") is Divergence.PEARSON
    assert get_divergence(Divergence.TV) is Divergence.TV


@pytest.mark.parametrize("bad", ["chi2", "", None, 3])
def test_unknown_divergence_lists_the_valid_names(bad):
    with pytest.raises(ValueError, match=r"divergence: expected one of kl, reverse_kl, pearson"):
        get_divergence(bad)


def test_readme_table_is_generated_from_the_table():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert markdown_table() in readme
