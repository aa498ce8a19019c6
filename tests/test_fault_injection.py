"""Fault injection: no silent NaN, no silent garbage.

One named case per failure mode that `bench/fuzz_public_api.py` found, on the C++, chunked-PyTorch
and Triton-interpreter backends wherever a kernel is involved, plus hypothesis over random masks
of banned (−inf bias) tokens and over random empty or fully masked batches. The C++ build
directory (keyed by sources and install location) is tested in `test_cpp_build.py`.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fgrpo_kernels as fk
from fgrpo_kernels import reference
from fgrpo_kernels.backends.cpu import chunked, cpp
from fgrpo_kernels.core.validation import MIN_TEMPERATURE
from fgrpo_kernels.divergences import sat_exp

INF = float("inf")
BACKENDS = ("cpp", "torch", "triton")
NAMED = r"^{}: "  # an error message that starts with the argument's name


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """The log-prob kernels (and the loss epilogue) of one backend."""
    if request.param == "triton":
        monkeypatch.setenv("FGRPO_BACKEND", "triton")
    else:
        monkeypatch.setenv("FGRPO_BACKEND", "cpu")
        monkeypatch.setenv("FGRPO_CPU_BACKEND", request.param)
        # several vocab chunks on the chunked path, so that whole chunks can be banned
        monkeypatch.setattr(chunked, "VOCAB_CHUNK", 16)
    return request.param


# ----------------------------------------------------------------------------- helpers


def oracle(h, w, y, b, tau=1.0, ignore_index=-100):
    """float64 (logp, entropy) through the full logits; p = 0 tokens contribute 0."""
    z = h.double() @ w.double().T
    if b is not None:
        z = z + b.double()
    logp_all = torch.log_softmax(z / tau, -1)
    valid = y != ignore_index
    logp = torch.where(valid, logp_all.gather(-1, torch.where(valid, y, 0)[:, None])[:, 0], 0.0)
    p = logp_all.exp()
    ent = -(p * torch.where(p > 0, logp_all, 0.0)).sum(-1)
    return logp, torch.where(valid, ent, 0.0)


def outputs(fn, h, w, y, b, up, tau=1.0, dtype=None):
    """(logp, entropy, dhidden, dweight, dbias) of Σ up[0]·logp + Σ up[1]·entropy."""
    leaves = [None if t is None else t.detach().to(dtype or t.dtype).requires_grad_() for t in
              (h, w, b)]  # fmt: skip
    logp, ent = fn(leaves[0], leaves[1], y, leaves[2], tau)
    ((up[0] * logp).sum() + (up[1] * ent).sum()).backward()
    return logp, ent, *(None if t is None else t.grad for t in leaves)


def fused(h, w, y, b, tau):
    return fk.fused_linear_logprobs(h, w, y, b, tau, return_entropy=True)


def assert_matches_oracle(h, w, y, b, tau=1.0, tol=1e-5, seed=0):
    up = torch.randn(2, y.shape[0], generator=torch.Generator().manual_seed(seed))
    got = outputs(fused, h, w, y, b, up, tau)
    want = outputs(oracle, h, w, y, b, up.double(), tau, torch.float64)
    names = ("logp", "entropy", "dhidden", "dweight", "dbias")
    for name, g, r in zip(names, got, want, strict=True):
        if r is None:
            continue
        g, r = g.detach().double(), r.detach().double()
        fin = torch.isfinite(r)
        assert torch.isfinite(g[fin]).all(), f"{name}: NaN/inf where the reference is finite"
        assert torch.equal(g[~fin], r[~fin]), f"{name}: differs where the reference is ±inf"
        err = float((g[fin] - r[fin]).norm() / max(float(r[fin].norm()), 0.1 * fin.sum() ** 0.5))
        assert err <= tol, f"{name}: relative error {err:.2e}"
    return got


def data(N, H, V, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=gen) * scale
    w = torch.randn(V, H, generator=gen) * 2 / H**0.5
    return h, w, gen


def banned_bias(V, banned, seed=1):
    b = torch.randn(V, generator=torch.Generator().manual_seed(seed))
    b[banned] = -INF
    return b


# ----------------------------------------------------------------------------- banned tokens


def test_banned_tokens_issue_reproducer(backend):
    """The issue's reproducer: on the C++ backend all of dhidden was NaN."""
    torch.manual_seed(0)
    h = torch.randn(4, 8, requires_grad=True)
    b = torch.zeros(20)
    b[:5] = -INF
    logp = fk.fused_linear_logprobs(h, torch.randn(20, 8), torch.randint(5, 20, (4,)), b)
    logp.sum().backward()
    assert torch.isfinite(logp).all() and torch.isfinite(h.grad).all()


def test_banned_tokens_with_entropy_match_float64(backend):
    """Entropy was NaN on every backend: p·log p of a banned token is 0, not 0·(−inf)."""
    h, w, gen = data(7, 9, 77)
    banned = torch.rand(77, generator=gen) < 0.3
    y = torch.multinomial((~banned).float(), 7, replacement=True, generator=gen)
    y[2] = -100
    _, ent, dh, dw, db = assert_matches_oracle(h, w, y, banned_bias(77, banned), tau=0.7)
    assert (db[banned] == 0).all() and (dw[banned] == 0).all()


def test_whole_tiles_of_banned_tokens(backend):
    """A vocab tile (C++: 1024, Triton: 32 and whole vocab splits, chunked: 16) holding only
    banned tokens, the first one included: the running max stays −inf through it."""
    h, w, gen = data(5, 8, 2100, seed=4)
    y = torch.randint(1200, 2100, (5,), generator=gen)
    assert_matches_oracle(h, w, y, banned_bias(2100, slice(0, 1100)))


def test_banned_target_has_logp_minus_inf_and_finite_gradients(backend):
    """log p = −inf is the exact answer for a banned target; its gradient is finite."""
    h, w, gen = data(6, 8, 50)
    y = torch.randint(5, 50, (6,), generator=gen)
    y[1] = 2
    logp, *_, dh, dw, db = assert_matches_oracle(h, w, y, banned_bias(50, slice(0, 5)))
    assert logp[1] == -INF and torch.isfinite(logp[[0, 2, 3, 4, 5]]).all()


def test_fused_losses_with_banned_tokens(backend):
    """A fused loss returned a finite loss with NaN gradients."""
    B, T, H, V = 4, 5, 8, 40
    hb, w, gen = data(B * T, H, V, seed=7)
    h = hb.reshape(B, T, H)
    ids = torch.randint(10, V, (B, T), generator=gen)
    mask = torch.arange(T)[None, :] < torch.tensor([5, 2, 4, 1])[:, None]
    b = banned_bias(V, slice(0, 10))
    for loss_fn in losses_of_every_kind(B, T):
        hh, ww, bb = (t.clone().requires_grad_() for t in (h, w, b))
        loss, metrics = loss_fn(hh, ww, ids, mask, bb)
        loss.backward()
        assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
        for g in (hh.grad, ww.grad, bb.grad):
            assert torch.isfinite(g).all()
        assert (bb.grad[:10] == 0).all() and (ww.grad[:10] == 0).all()


@pytest.mark.parametrize(
    "bias, message",
    [
        (torch.tensor([0.0, float("nan"), 1.0]), "bias: expected finite entries or -inf"),
        (torch.tensor([0.0, INF, 1.0]), "bias: expected finite entries or -inf"),
        (torch.full((3,), -INF), "bias: expected at least one entry above -inf"),
    ],
    ids=["nan", "plus_inf", "all_banned"],
)
def test_meaningless_bias_is_refused(bias, message):
    h, w, y = torch.randn(2, 4), torch.randn(3, 4), torch.tensor([0, 1])
    for fn in (fk.fused_linear_logprobs, reference.logprobs):
        with pytest.raises(ValueError, match=message):
            fn(h, w, y, bias)
    with pytest.raises(ValueError, match=message):
        fk.FusedLinearGRPOLoss()(h[None], w, y[None], torch.ones(1, 2), torch.ones(1), bias)


# ----------------------------------------------------------------------------- temperature


@pytest.mark.parametrize("tau", [1e-20, MIN_TEMPERATURE])
def test_tiny_temperature_with_entropy_gradient(backend, tau):
    """C++ gave NaN gradients at τ ≤ 1e-20: e^u·(a + c·u) with e^u = 0 and c·u = ∞."""
    h, w, gen = data(6, 8, 50)
    b = torch.randn(50, generator=gen)
    assert_matches_oracle(h, w, torch.randint(0, 50, (6,), generator=gen), b, tau=tau)


def test_temperature_below_the_floor_is_refused():
    h, w, y = torch.randn(2, 4), torch.randn(3, 4), torch.tensor([0, 1])
    with pytest.raises(ValueError, match=NAMED.format("temperature")):
        fk.fused_linear_logprobs(h, w, y, temperature=MIN_TEMPERATURE / 10)
    with pytest.raises(ValueError, match=NAMED.format("temperature")):
        fk.FusedLinearGRPOLoss(temperature=1e-45)


# ----------------------------------------------------------------------------- double backward


def test_double_backward_is_a_clear_error(backend):
    """Was: wrong values (chunked), "differentiated Tensor not used" (C++), an addmm out= error
    (Triton). First-order gradients under create_graph=True stay exact."""
    h, w, gen = data(5, 6, 30)
    y = torch.randint(0, 30, (5,), generator=gen)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    (plain,) = torch.autograd.grad(fk.fused_linear_logprobs(hh, ww, y).sum(), hh)
    (gh,) = torch.autograd.grad(fk.fused_linear_logprobs(hh, ww, y).sum(), hh, create_graph=True)
    assert torch.equal(gh, plain)
    with pytest.raises(RuntimeError, match="higher-order gradients are not supported"):
        gh.sum().backward()
    hb = torch.randn(2, 3, 6, generator=gen).requires_grad_()
    ids = torch.randint(0, 30, (2, 3), generator=gen)
    loss, _ = fk.FusedLinearGRPOLoss(beta=0.0)(
        hb, ww, ids, torch.ones(2, 3), torch.tensor([1.0, -1.0])
    )
    (g,) = torch.autograd.grad(loss, hb, create_graph=True)
    with pytest.raises(RuntimeError, match="higher-order gradients are not supported"):
        torch.autograd.grad(g.sum(), ww)


# ----------------------------------------------------------------------------- empty batches

G = 2
KINDS = [
    "fgrpo_token",
    "fgrpo_token_seq_mean",
    "fgrpo_sequence",
    "fgrpo_rewards",
    "grpo_grpo",
    "grpo_bnpo",
    "grpo_dr_grpo",
    "grpo_dapo",
    "grpo_sequence",
    "gift",
    "gift_detach",
    "fdo",
    "fhal",
]


def loss_of_kind(kind: str, B: int, T: int):
    """loss_fn(hidden, weight, ids, mask, bias) → (loss, metrics) for one module and option."""
    gen = torch.Generator().manual_seed(3)
    ref = -torch.rand(B, T, generator=gen) * 3
    old = -torch.rand(B, T, generator=gen) * 3
    adv = torch.linspace(-1.0, 1.0, B) + 0.1
    rewards = torch.arange(B, dtype=torch.float32) % 3
    chosen = torch.arange(B) % 2 == 0
    ref_kw = {"ref_per_token_logps": ref}
    if kind.startswith("fgrpo"):
        opts = {
            "fgrpo_token": {},
            "fgrpo_token_seq_mean": {"reduction": "seq_mean"},
            "fgrpo_sequence": {"divergence": "kl", "level": "sequence"},
            "fgrpo_rewards": {},
        }[kind]
        mod = fk.FusedLinearFGRPOLoss(num_generations=G, **opts)
        kw = {"rewards": rewards} if kind == "fgrpo_rewards" else {"advantages": adv}
        return lambda h, w, ids, m, b: mod(h, w, ids, m, bias=b, **kw, **ref_kw)
    if kind.startswith("grpo"):
        lt = "dapo" if kind == "grpo_sequence" else kind[len("grpo_") :]
        level = "sequence" if kind == "grpo_sequence" else "token"
        mod = fk.FusedLinearGRPOLoss(lt, importance_sampling_level=level)
        return lambda h, w, ids, m, b: mod(h, w, ids, m, adv, b, old_per_token_logps=old, **ref_kw)
    if kind.startswith("gift"):
        mod = fk.FusedLinearGIFTLoss(G, detach_stats=kind == "gift_detach")
        return lambda h, w, ids, m, b: mod(h, w, ids, m, rewards, ref, bias=b)
    if kind == "fdo":
        mod = fk.FusedLinearFDOLoss("kl")
        return lambda h, w, ids, m, b: mod(h, w, ids, m, chosen, ref, bias=b)
    mod = fk.FusedLinearFHALLoss("kl", num_generations=G)

    def fhal(h, w, ids, m, b):
        # the preference half: a fully masked batch of B rows (B ≥ 2), or two masked rows
        n = max(B, 2)
        ph, pids = torch.zeros(n, T, h.shape[-1]), torch.zeros(n, T, dtype=torch.long)
        pm, pc = torch.zeros(n, T), torch.arange(n) % 2 == 0
        return mod(h, w, ids, m, ph, pids, pm, pc, advantages=adv, bias=b, **ref_kw,
                   pref_ref_per_token_logps=torch.zeros(n, T))  # fmt: skip

    return fhal


def losses_of_every_kind(B, T):
    return [loss_of_kind(kind, B, T) for kind in KINDS]


def assert_zero_loss_and_gradients(kind, B, T, H, V, seed=0, with_bias=True):
    hb, w, gen = data(max(B * T, 1), H, V, seed=seed)
    h = hb[: B * T].reshape(B, T, H).clone().requires_grad_()
    w = w.requires_grad_()
    b = torch.randn(V, generator=gen).requires_grad_() if with_bias else None
    ids = torch.randint(0, V, (B, T), generator=gen)
    loss, metrics = loss_of_kind(kind, B, T)(h, w, ids, torch.zeros(B, T), b)
    loss.backward()
    assert loss.item() == 0.0, f"{kind}: loss {loss.item()}"
    bad = {k: v for k, v in metrics.items() if not torch.isfinite(v).all()}
    assert not bad, f"{kind}: non-finite metrics {bad}"
    for name, t in (("hidden", h), ("weight", w), ("bias", b)):
        if t is not None:
            assert t.grad is None or (t.grad == 0).all(), f"{kind}: d{name} is not 0"


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "fdo"])
def test_empty_batch_gives_zero_loss_and_gradients(backend, kind):
    """B = 0 (a data-parallel rank with nothing left): GRPO grpo / dr_grpo, GIFT and
    sequence-level f-GRPO returned NaN (Triton: a ZeroDivisionError)."""
    assert_zero_loss_and_gradients(kind, 0, 5, 8, 30)


def test_empty_fdo_batch_is_an_error():
    """FDO needs a chosen and a rejected completion: B = 0 has neither (a named error)."""
    with pytest.raises(ValueError, match=NAMED.format("chosen")):
        assert_zero_loss_and_gradients("fdo", 0, 5, 8, 30)


@pytest.mark.parametrize("kind", KINDS)
def test_fully_masked_batch_gives_zero_loss_and_gradients(backend, kind):
    """No token counted: sequence-level f-GRPO, FDO and GIFT returned a constant (φ(0), R̂²)."""
    assert_zero_loss_and_gradients(kind, 4, 3, 8, 30)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_reference_losses_without_tokens_are_zero(level):
    for B in (0, 4):
        lp = torch.zeros(B, 3, requires_grad=True)
        m = torch.zeros(B, 3)
        adv, rw = torch.linspace(-1, 1, B), torch.arange(B, dtype=torch.float32)
        losses = [
            reference.fgrpo_loss(lp, lp.detach() - 1, adv, m, "kl", level=level),
            reference.grpo_loss(
                lp, None, lp.detach() - 1, adv, m, "grpo", importance_sampling_level=level
            ),
            reference.gift_loss(lp, lp.detach() - 1, rw, m, 2),
        ]
        if B:
            losses.append(reference.fdo_loss(lp, lp.detach() - 1, m, torch.arange(B) % 2 == 0))
        for loss in losses:
            (g,) = torch.autograd.grad(loss, lp)
            assert loss.item() == 0.0 and (g == 0).all()


# ----------------------------------------------------------------------------- named errors


@pytest.mark.parametrize("n", [0, -5, 0.0, torch.tensor(0), torch.tensor([3.0, 4.0]), True])
def test_num_items_in_batch_must_be_a_positive_count(n):
    """0 and −5 were silently clamped to 1."""
    B, T, H, V = 2, 3, 4, 7
    h, w, ids = torch.randn(B, T, H), torch.randn(V, H), torch.randint(0, V, (B, T))
    lp, m, adv = -torch.rand(B, T), torch.ones(B, T), torch.tensor([1.0, -1.0])
    err = (TypeError, ValueError)
    with pytest.raises(err, match=NAMED.format("num_items_in_batch")):
        fk.FusedLinearGRPOLoss()(h, w, ids, m, adv, num_items_in_batch=n)
    with pytest.raises(err, match=NAMED.format("num_items_in_batch")):
        reference.grpo_loss(lp, None, lp, adv, m, num_items_in_batch=n)


def test_num_items_in_batch_number_or_tensor():
    lp, m, adv = -torch.rand(2, 3), torch.ones(2, 3), torch.tensor([1.0, -1.0])
    ref = reference.grpo_loss(lp, None, lp - 1, adv, m, num_items_in_batch=7)
    for n in (7.0, torch.tensor(7), torch.tensor([7.0])):
        got = reference.grpo_loss(lp, None, lp - 1, adv, m, num_items_in_batch=n)
        assert torch.equal(got, ref)


def test_meta_tensors_are_named_errors():
    """Was: "Tensor.item() cannot be called on meta tensors"."""
    h, w, y = torch.randn(2, 4), torch.randn(3, 4), torch.tensor([0, 1])
    for fn in (fk.fused_linear_logprobs, reference.logprobs):
        with pytest.raises(ValueError, match=NAMED.format("hidden") + ".*meta"):
            fn(h.to("meta"), w.to("meta"), y.to("meta"))
        with pytest.raises(ValueError, match=NAMED.format("weight") + ".*meta"):
            fn(h, w.to("meta"), y)
    with pytest.raises(ValueError, match=NAMED.format("hidden") + ".*meta"):
        fk.FusedLinearGRPOLoss()(h[None].to("meta"), w, y[None], torch.ones(1, 2), torch.ones(1))
    with pytest.raises(ValueError, match=NAMED.format("logps") + ".*meta"):
        reference.grpo_loss(h.to("meta"), None, None, torch.ones(2), torch.ones(2, 4))


def test_empty_hidden_size_or_vocabulary_is_a_named_error():
    """H = 0 was a reshape error; V = 0 a message about targets."""
    y = torch.tensor([0, 1])
    for fn in (fk.fused_linear_logprobs, reference.logprobs):
        with pytest.raises(ValueError, match=NAMED.format("hidden") + ".*H >= 1"):
            fn(torch.randn(2, 0), torch.randn(3, 0), y)
        with pytest.raises(ValueError, match=NAMED.format("weight") + ".*V >= 1"):
            fn(torch.randn(2, 4), torch.randn(0, 4), y)
    with pytest.raises(ValueError, match=NAMED.format("hidden") + ".*H >= 1"):
        fk.FusedLinearGRPOLoss()(
            torch.randn(1, 2, 0), torch.randn(3, 0), y[None], torch.ones(1, 2), torch.ones(1)
        )


@pytest.mark.parametrize(
    "make",
    [
        lambda: fk.FusedLinearFGRPOLoss(beta=-0.1),
        lambda: fk.FusedLinearGRPOLoss(beta=-0.1),
        lambda: fk.FusedLinearGIFTLoss(2, beta=-1.0),
        lambda: fk.FusedLinearFDOLoss(beta=-1.0),
        lambda: fk.FusedLinearFHALLoss(beta=-1.0),
        lambda: reference.fgrpo_loss(*_per_token(), beta=-0.1),
        lambda: reference.grpo_loss(*_per_token(old=True), beta=-0.1),
        lambda: reference.gift_loss(*_per_token(gift=True), beta=-1.0),
    ],
    ids=["fgrpo", "grpo", "gift", "fdo", "fhal", "ref_fgrpo", "ref_grpo", "ref_gift"],
)
def test_negative_beta_is_refused(make):
    """β < 0 would reward moving away from the reference policy (GRPO: a negative KL weight;
    f-GRPO, FDO, GIFT: an implicit reward of the opposite sign). β = 0 stays allowed."""
    with pytest.raises(ValueError, match=NAMED.format("beta") + ".*>= 0"):
        make()


def _per_token(old=False, gift=False):
    lp, m = -torch.rand(2, 3), torch.ones(2, 3)
    if gift:
        return lp, lp - 1, torch.tensor([1.0, 0.0]), m, 2
    adv = torch.tensor([1.0, -1.0])
    return (lp, None, lp - 1, adv, m) if old else (lp, lp - 1, adv, m)


@pytest.mark.parametrize("eps", [1.0, 1.5])
def test_epsilon_low_of_one_or_more_is_refused(eps):
    """1 − ε_low ≤ 0 is no lower clip bound at all (a ratio is positive)."""
    with pytest.raises(ValueError, match=NAMED.format("epsilon_low") + r".*\[0, 1\)"):
        fk.FusedLinearGRPOLoss(epsilon_low=eps)
    with pytest.raises(ValueError, match=NAMED.format("epsilon_low")):
        reference.grpo_loss(*_per_token(old=True), epsilon_low=eps)
    fk.FusedLinearGRPOLoss(beta=0.0, epsilon_low=0.0, epsilon_high=5.0)  # the edges stay valid


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32])
def test_reference_logprobs_takes_every_integer_target_dtype(dtype):
    """The validator accepted int8 targets, then gather() refused them."""
    h, w, gen = data(5, 4, 9)
    y = torch.randint(0, 9, (5,), generator=gen)
    want = reference.logprobs(h, w, y, return_entropy=True)
    got = reference.logprobs(h, w, y.to(dtype), return_entropy=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(
        fk.fused_linear_logprobs(h, w, y.to(dtype)), fk.fused_linear_logprobs(h, w, y)
    )


# ----------------------------------------------------------------------------- raw ops


@pytest.fixture
def ops():
    if not cpp.available():
        pytest.skip(f"C++ backend not built: {cpp.build_error()}")
    return torch.ops.fgrpo


@pytest.mark.parametrize("target", [50, 10**6, 2**40, -5])
def test_raw_ops_check_target_bounds(ops, target):
    """logprob_fwd returned a plausible −9.2 for targets 50, 1e6, 2^40 or −5 with V = 50."""
    h, w, gen = data(6, 8, 50)
    y = torch.randint(0, 50, (6,), generator=gen)
    _, lse, _ = ops.logprob_fwd(h, w, y, None, 1.0, -100, False)
    y[3] = target
    message = rf"^targets: expected ids in \[0, 50\) or ignore_index=-100; got {target} at"
    with pytest.raises(ValueError, match=message):
        ops.logprob_fwd(h, w, y, None, 1.0, -100, False)
    with pytest.raises(ValueError, match=message):
        ops.logprob_bwd(h, w, y, None, lse, None, torch.ones(6), None, 1.0, -100, True, True, False)
    y[3] = -100
    logp, _, _ = ops.logprob_fwd(h, w, y, None, 1.0, -100, False)
    assert logp[3] == 0


def test_raw_op_errors_are_value_and_type_errors(ops):
    h, w, y = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])
    with pytest.raises(TypeError, match="^targets: expected int64"):
        ops.logprob_fwd(h, w, y.int(), None, 1.0, -100, False)
    with pytest.raises(ValueError, match=r"^hidden: expected shape \[N, H\]"):
        ops.logprob_fwd(h[0], w, y, None, 1.0, -100, False)
    with pytest.raises(ValueError, match="^temperature: expected > 0"):
        ops.logprob_fwd(h, w, y, None, 0.0, -100, False)


# ----------------------------------------------------------------------------- regressions


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_saturated_exponential_is_exact_for_huge_arguments(dtype):
    """Found by the fuzz: x − (x − 80).detach() rounds to 0 once the spacing of x passes 80,
    so sat_exp(1e20) was e^0 = 1 and its slope 1 (a GRPO k3 gradient of 0 at τ = 1e-20)."""
    x = torch.tensor([1e20, 1e12, 81.0, 80.0, 3.0, -1e20], dtype=dtype, requires_grad=True)
    y = sat_exp(x)
    (g,) = torch.autograd.grad(y.sum(), x)
    want = torch.tensor([math.exp(80)] * 4 + [math.exp(3), 0.0], dtype=dtype)
    assert torch.allclose(y, want, rtol=1e-6) and torch.allclose(g, want, rtol=1e-6)


# ----------------------------------------------------------------------------- hypothesis


@given(
    seed=st.integers(0, 2**31 - 1),
    N=st.integers(1, 12),
    H=st.integers(1, 20),
    V=st.integers(2, 300),
    frac=st.sampled_from([0.05, 0.5, 0.95]),
    tau=st.sampled_from([1.0, 0.3, 1e-20]),
    on_target=st.booleans(),
)
def test_random_banned_masks_match_float64(backend, seed, N, H, V, frac, tau, on_target):
    """Any subset of banned tokens (not all), targets on banned tokens or not: logp, entropy
    and every gradient equal the float64 reference (−inf exactly where it is −inf)."""
    h, w, gen = data(N, H, V, seed=seed)
    banned = torch.rand(V, generator=gen) < frac
    banned[int(torch.randint(0, V, (1,), generator=gen))] = False
    pool = torch.ones(V) if on_target else (~banned).float()
    y = torch.multinomial(pool, N, replacement=True, generator=gen)
    y[torch.rand(N, generator=gen) < 0.2] = -100
    assert_matches_oracle(h, w, y, banned_bias(V, banned, seed), tau=tau)


@given(
    kind=st.sampled_from(KINDS),
    empty=st.booleans(),
    groups=st.integers(1, 3),
    T=st.integers(1, 6),
    H=st.integers(1, 12),
    V=st.integers(2, 60),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_empty_or_fully_masked_batches(
    backend, kind, empty, groups, T, H, V, with_bias, seed
):
    """Loss 0, zero gradients and finite metrics on every module and loss type."""
    if kind == "fdo" and empty:
        kind = "fgrpo_sequence"  # FDO refuses B = 0 (empty chosen and rejected pools)
    assert_zero_loss_and_gradients(kind, 0 if empty else 2 * groups, T, H, V, seed, with_bias)
