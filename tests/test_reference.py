"""The reference against an independent float64 reading of docs/math.md (tests/naive.py),
invariances, special cases, and the GRPO family against Liger-Kernel's own fused loss."""

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fgrpo_kernels import reference as R
from fgrpo_kernels.divergences import NAMES
from fgrpo_kernels.testing import batches

from . import naive

DOUBLE = dict(dtypes=(torch.float64,))
# Pure-reference tests are cheap: draw more examples than the CI profile does.
MANY = settings(max_examples=60)


def _l(t):
    return t.tolist()


def _close(a, b, tol=1e-10):
    assert abs(float(a) - b) <= tol * max(1.0, abs(b)), (float(a), b)


@MANY
@given(
    b=batches(**DOUBLE),
    div=st.sampled_from(NAMES),
    beta=st.sampled_from([0.05, 0.1, 1.0]),
    red=st.sampled_from(["token_mean", "seq_mean", "sum"]),
)
def test_fgrpo_token_level_matches_naive(b, div, beta, red):
    m = b.mask.double()
    got = R.fgrpo_loss(b.logps, b.ref_logps, b.advantages, b.mask, div, beta, "token", red)
    want = naive.fgrpo(
        _l(b.logps), _l(b.ref_logps), _l(b.advantages), _l(m), div, beta, "token", red
    )
    _close(got, want)


@MANY
@given(
    b=batches(**DOUBLE),
    div=st.sampled_from(NAMES),
    beta=st.sampled_from([0.05, 1.0]),
    red=st.sampled_from(["seq_mean", "sum"]),
)
def test_fgrpo_sequence_level_matches_naive(b, div, beta, red):
    m = b.mask.double()
    got = R.fgrpo_loss(b.logps, b.ref_logps, b.advantages, b.mask, div, beta, "sequence", red)
    want = naive.fgrpo(
        _l(b.logps), _l(b.ref_logps), _l(b.advantages), _l(m), div, beta, "sequence", red
    )
    _close(got, want)


@MANY
@given(
    b=batches(**DOUBLE), div=st.sampled_from(NAMES), level=st.sampled_from(["token", "sequence"])
)
def test_fgrpo_group_is_weights_matches_naive(b, div, level):
    m = _l(b.mask.double())
    adv = R.group_normalize(b.rewards, b.num_generations)
    got = R.fgrpo_loss(
        b.logps,
        b.ref_logps,
        None,
        b.mask,
        div,
        0.1,
        level,
        group_is_weights=True,
        old_logps=b.old_logps,
        rewards=b.rewards,
        num_generations=b.num_generations,
    )
    w = naive.is_weights(_l(b.rewards), _l(adv), _l(b.old_logps), m, b.num_generations)
    red = "token_mean" if level == "token" else "seq_mean"
    want = naive.fgrpo(_l(b.logps), _l(b.ref_logps), _l(adv), m, div, 0.1, level, red, w)
    _close(got, want)


def test_is_weights_are_detached_and_average_one_per_group_and_sign():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2], dtype=torch.float64)
    old = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    w = R.importance_weights(rewards, adv, old, torch.ones(4, 3), 2)
    assert not w.requires_grad
    pos = R.importance_weights(
        rewards, torch.ones(4, dtype=torch.float64), old, torch.ones(4, 3), 2
    )
    torch.testing.assert_close(
        pos.reshape(2, 2).sum(-1), torch.full((2,), 2.0, dtype=torch.float64)
    )
    assert w[0] == pos[0] and w[1] != pos[1]


@MANY
@given(
    b=batches(**DOUBLE),
    loss_type=st.sampled_from(R.LOSS_TYPES),
    level=st.sampled_from(["token", "sequence"]),
    beta=st.sampled_from([0.0, 0.04]),
    eps=st.sampled_from([(0.2, 0.2), (0.1, 0.28)]),
    no_old=st.booleans(),
    n_items=st.sampled_from([None, 7]),
    max_len=st.sampled_from([None, 12]),
)
def test_grpo_matches_naive(b, loss_type, level, beta, eps, no_old, n_items, max_len):
    if loss_type in ("cispo", "sapo", "vespo"):  # token level only
        level = "token"
    old = None if no_old else b.old_logps
    got = R.grpo_loss(
        b.logps,
        old,
        b.ref_logps,
        b.advantages,
        b.mask,
        loss_type,
        beta,
        *eps,
        level,
        max_len,
        n_items,
    )
    want = naive.grpo(
        _l(b.logps),
        None if old is None else _l(old),
        _l(b.ref_logps),
        _l(b.advantages),
        _l(b.mask.double()),
        loss_type,
        beta,
        *eps,
        level,
        max_len,
        n_items,
    )
    _close(got, want)


@MANY
@given(
    b=batches(**DOUBLE),
    beta=st.sampled_from([0.5, 1.0, 3.0]),
    unbiased=st.booleans(),
    detach=st.booleans(),
)
def test_gift_matches_naive(b, beta, unbiased, detach):
    got = R.gift_loss(
        b.logps,
        b.ref_logps,
        b.rewards,
        b.mask,
        b.num_generations,
        beta,
        unbiased=unbiased,
        detach_stats=detach,
    )
    want = naive.gift(
        _l(b.logps),
        _l(b.ref_logps),
        _l(b.rewards),
        _l(b.mask.double()),
        b.num_generations,
        beta,
        unbiased=unbiased,
    )
    _close(got, want)


@MANY
@given(b=batches(**DOUBLE), div=st.sampled_from(NAMES), beta=st.sampled_from([0.1, 1.0]))
def test_fdo_matches_naive(b, div, beta):
    got = R.fdo_loss(b.logps, b.ref_logps, b.mask, b.chosen, div, beta)
    want = naive.fdo(_l(b.logps), _l(b.ref_logps), _l(b.mask.double()), _l(b.chosen), div, beta)
    _close(got, want)


def test_fhal_is_the_lambda_mix():
    torch.manual_seed(0)
    lp, ref = torch.randn(4, 3).double(), torch.randn(4, 3).double()
    mask, adv = torch.ones(4, 3), torch.tensor([1.0, -1.0, 0.5, -0.5]).double()
    chosen = torch.tensor([True, False, True, False])
    fdo = R.fdo_loss(lp, ref, mask, chosen, "js", 0.2)
    fg = R.fgrpo_loss(lp, ref, adv, mask, "js", 0.2)
    got = R.fhal_loss(lp, ref, adv, mask, lp, ref, mask, chosen, "js", 0.2, lam=0.3)
    torch.testing.assert_close(got, 0.3 * fdo + 0.7 * fg)


@MANY
@given(
    b=batches(**DOUBLE), scale=st.sampled_from(["group", "batch", "none"]), unbiased=st.booleans()
)
def test_group_normalize_matches_naive(b, scale, unbiased):
    got = R.group_normalize(b.rewards, b.num_generations, 1e-4, unbiased, scale)
    want = naive.group_normalize(_l(b.rewards), b.num_generations, 1e-4, unbiased, scale)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------- invariances


@MANY
@given(b=batches(**DOUBLE), a=st.floats(0.5, 20.0), c=st.floats(-5.0, 5.0))
def test_group_normalize_invariant_to_positive_affine_map_of_one_group(b, a, c):
    G = b.num_generations
    assume(float(b.rewards[:G].std(correction=0)) > 1e-3 or G == 1)
    before = R.group_normalize(b.rewards, G, eps=0.0)
    mapped = b.rewards.clone()
    mapped[:G] = a * mapped[:G] + c
    after = R.group_normalize(mapped, G, eps=0.0)
    torch.testing.assert_close(after, before, rtol=1e-9, atol=1e-9)
    with_eps = R.group_normalize(mapped, G, eps=1e-4)
    torch.testing.assert_close(with_eps[G:], R.group_normalize(b.rewards, G)[G:])


def _spread_rows(b, seed):
    """Per-row log-ratio sums that differ within each group (GIFT needs σ_k > 0)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones_like(b.mask)
    return b.logps + torch.randn(b.logps.shape, generator=g, dtype=torch.float64), mask


@MANY
@given(
    b=batches(**DOUBLE), shift=st.floats(-30, 30), c=st.floats(0.2, 5.0), seed=st.integers(0, 99)
)
def test_gift_invariant_to_group_shift_and_scale_of_log_ratio(b, shift, c, seed):
    lp, mask = _spread_rows(b, seed)
    T = lp.shape[1]
    G = b.num_generations

    def loss(x):
        return R.gift_loss(x, b.ref_logps, b.rewards, mask, G, beta=1.0, eps=0.0)

    base = loss(lp)
    lr = lp - b.ref_logps
    shifted = lp.clone()
    shifted[:G] += shift / T
    scaled = b.ref_logps + c * lr
    if G > 1:
        torch.testing.assert_close(loss(shifted), base, rtol=1e-8, atol=1e-8)
        torch.testing.assert_close(loss(scaled), base, rtol=1e-8, atol=1e-8)


@MANY
@given(b=batches(max_len=1, **DOUBLE), div=st.sampled_from(NAMES))
def test_fgrpo_one_token_sequences_token_level_equals_sequence_level(b, div):
    mask = torch.ones_like(b.mask)
    tok = R.fgrpo_loss(b.logps, b.ref_logps, b.advantages, mask, div, 0.3, "token", "token_mean")
    seq = R.fgrpo_loss(b.logps, b.ref_logps, b.advantages, mask, div, 0.3, "sequence", "seq_mean")
    torch.testing.assert_close(tok, seq, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- special cases


@pytest.mark.parametrize("unbiased,expected", [(True, 2**-0.5), (False, 1.0)])
def test_two_generations_binary_rewards(unbiased, expected):
    """2-GRPO: G = 2 with one right and one wrong answer gives ±1/√2 (Bessel) or ±1."""
    r = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    a = R.group_normalize(r, 2, eps=0.0, unbiased=unbiased)
    torch.testing.assert_close(a, torch.tensor([1, -1, -1, 1], dtype=torch.float64) * expected)
    a_eps = R.group_normalize(r, 2, unbiased=unbiased)
    torch.testing.assert_close(a_eps, a, rtol=2e-4, atol=0)


def test_group_of_one_and_flat_group_give_zero_advantage():
    r = torch.tensor([3.0, 1.0, 1.0], dtype=torch.float64)
    assert (R.group_normalize(r, 1) == 0).all()
    assert (R.group_normalize(r[1:], 2) == 0).all()


def test_gift_zero_variance_group_is_finite_in_both_modes():
    lp = torch.zeros(4, 3, dtype=torch.float64, requires_grad=True)
    for detach in (False, True):
        loss = R.gift_loss(
            lp,
            torch.zeros(4, 3, dtype=torch.float64),
            torch.ones(4).double(),
            torch.ones(4, 3),
            2,
            detach_stats=detach,
        )
        (g,) = torch.autograd.grad(loss, lp)
        assert torch.isfinite(loss) and torch.isfinite(g).all()


def test_gift_detach_stats_changes_the_gradient_not_the_value():
    torch.manual_seed(3)
    lp = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    ref, rw, mask = torch.randn(4, 5).double(), torch.rand(4).double(), torch.ones(4, 5)
    a = R.gift_loss(lp, ref, rw, mask, 4, detach_stats=False)
    b = R.gift_loss(lp, ref, rw, mask, 4, detach_stats=True)
    torch.testing.assert_close(a, b)
    ga, gb = (torch.autograd.grad(x, lp)[0] for x in (a, b))
    assert (ga - gb).abs().max() > 1e-3


def test_grpo_asymmetric_clip_by_hand():
    """DAPO clip-higher: ratio 1.25 under ε_high 0.28 is kept, 0.85 under ε_low 0.1 is clipped."""
    logps = torch.log(torch.tensor([[1.25], [0.85]], dtype=torch.float64))
    old, mask = torch.zeros(2, 1, dtype=torch.float64), torch.ones(2, 1)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss = R.grpo_loss(logps, old, None, adv, mask, "bnpo", 0.0, 0.1, 0.28)
    torch.testing.assert_close(loss, torch.tensor((-1.25 + 0.9) / 2, dtype=torch.float64))


def test_fgrpo_pearson_by_hand():
    """Two one-token rows: a = +2 costs 2·(−r); a = −1 costs r + r²/4 (r ≥ −2) or −1."""
    logps = torch.tensor([[0.0], [-30.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.0], [0.0]], dtype=torch.float64)
    adv, mask = torch.tensor([2.0, -1.0], dtype=torch.float64), torch.ones(2, 1)
    loss = R.fgrpo_loss(logps, ref, adv, mask, "pearson", 0.1, reduction="sum")
    torch.testing.assert_close(loss, torch.tensor(2 * -0.1 + -1.0, dtype=torch.float64))
