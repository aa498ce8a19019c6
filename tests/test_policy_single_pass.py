"""The policy variants' single pass (losses/policy.py, `PolicyStep.chunked`) against their
two-pass path on every backend, with chunks small enough to split sequences (token-local
variants) or to hold several whole ones (sequence-local): the loss, the gradients in hidden
and weight, and the metrics. The variants that need the whole batch's log-probs first, and the
option sets that make a variant batch-wide, say why they take the two-pass path."""

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fgrpo_kernels.backends import phases
from fgrpo_kernels.head.autograd import select_backend
from fgrpo_kernels.losses import single_pass
from fgrpo_kernels.losses.policy import VARIANTS, FusedLinearPolicyLoss, PolicyStep

B, T, H, V = 4, 5, 8, 23
LOCAL = sorted(n for n, v in VARIANTS.items() if not isinstance(v.locality, str))
OPTIONS = {
    "dro": {"dro_beta": 0.1},
    "gmpo": {"beta": 0.05},
    "gspo_token": {"beta": 0.05, "entropy_coef": 0.01, "compute_entropy": True},
}


def inputs(seed=0, T=T, H=H):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=gen)
    w = torch.randn(V, H, generator=gen)
    ids = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    mask[2] = 0  # an empty row
    adv = torch.tensor([1.0, -0.7, 0.4, 0.0])
    old = -3.0 + torch.randn(B, T, generator=gen)
    old[0, 1] += 30.0  # an extreme log-ratio
    ref = old + 0.3 * torch.randn(B, T, generator=gen)
    rollout = old + 0.4 * torch.randn(B, T, generator=gen)
    keep = torch.rand(B, T, generator=gen) > 0.3
    return h, w, ids, mask, adv, old, ref, rollout, keep


def rows_of_bytes(rows: int, H=H, dtype=torch.float32) -> int:
    """max_chunk_bytes for chunks of `rows` rows on the backend in use."""
    row = select_backend(torch.device("cpu")).bytes_per_row(torch.empty(1, H, dtype=dtype), V)
    return rows * row


def run(name, max_chunk_bytes, seed=0, shape=(T, H), on_policy=False, forward=None, **options):
    """`on_policy`: no old log-probs (the current ones, detached); `forward`: more per-call
    inputs."""
    h, w, ids, mask, adv, old, ref, rollout, keep = inputs(seed, *shape)
    old = None if on_policy else old
    opts = {**OPTIONS.get(name, {}), **options}
    module = FusedLinearPolicyLoss(name, max_chunk_bytes=max_chunk_bytes, **opts)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    forward = {**({"clip_cov_keep": keep} if name == "clip_cov" else {}), **(forward or {})}
    if module.rollout_correction is not None:
        forward["rollout_per_token_logps"] = rollout
    loss, metrics = module(
        hh, ww, ids, mask, adv, old_per_token_logps=old, ref_per_token_logps=ref, **forward
    )
    gh, gw = torch.autograd.grad(loss, (hh, ww))
    return module.last_pass, loss, gh, gw, metrics


def assert_same(single, two):
    for got, want in zip(single[1:4], two[1:4]):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)
    assert set(single[4]) == set(two[4])
    for key, value in two[4].items():
        torch.testing.assert_close(single[4][key], value, rtol=2e-5, atol=2e-6, equal_nan=True)


@pytest.mark.parametrize("name", LOCAL)
def test_single_pass_equals_two_pass(backend, name):
    token = VARIANTS[name].locality == single_pass.Locality.TOKEN
    rows = 3 if token else 6  # a token-local chunk splits sequences; others hold whole ones
    single = run(name, rows_of_bytes(rows))
    two = run(name, 0)
    assert single[0] == "single" and two[0] == "two-pass: max_chunk_bytes=0"
    assert_same(single, two)


RC_TOKEN_IS_RS = {
    "rollout_is": "token",
    "rollout_is_batch_normalize": True,
    "rollout_rs": "token_k1",
    "rollout_rs_threshold": "0.6_1.6",
}
OPTION_SETS = [
    (
        "vanilla",
        {"kl_coef": 0.2, "kl_penalty": "low_var_kl", "loss_agg_mode": "seq-mean-token-mean"},
    ),
    ("vanilla", {"loss_agg_mode": "seq-mean-token-sum-norm", "clip_ratio_c": 2.0}),
    ("gpg", {"loss_agg_mode": "seq-mean-token-sum"}),
    ("dppo_kl", {"rollout_correction": {"rollout_is": "sequence", "rollout_is_threshold": 2.0}}),
    ("vanilla", {"rollout_correction": RC_TOKEN_IS_RS}),
    ("gspo", {"rollout_correction": {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.5}}),
    ("gspo_token", {"loss_type": "grpo", "delta": 2.0}),
    ("gmpo", {"epsilon_high": 0.3, "gradient_accumulation_steps": 2}),
]


@pytest.mark.parametrize("name, options", OPTION_SETS)
def test_single_pass_with_options(backend, name, options):
    token = VARIANTS[name].locality == single_pass.Locality.TOKEN
    single = run(name, rows_of_bytes(2 if token else 5), seed=1, **options)
    two = run(name, 0, seed=1, **options)
    assert single[0] == "single"
    assert_same(single, two)


@pytest.mark.parametrize(
    "name, options, reason",
    [
        ("gmpo", {"top_entropy_quantile": 0.5}, "top_entropy_quantile < 1"),
        ("vanilla", {"rollout_correction": {"rollout_is": "token", "bypass_mode": True}}, "bypass"),
    ],
)
def test_batch_wide_option_sets_say_why_they_take_two_passes(name, options, reason):
    last_pass, loss, gh, gw, _ = run(name, None, **options)
    assert last_pass.startswith(f"two-pass: loss_mode={name!r}: ") and reason in last_pass
    assert torch.isfinite(loss) and torch.isfinite(gh).all() and torch.isfinite(gw).all()


def test_a_sequence_longer_than_the_chunk_takes_two_passes():
    """Where the open row's dW would take more than half of the budget (`open_rows`), and for a
    variant whose gradient a row's number does not scale (GMPO with a KL term)."""
    last_pass = run("gspo", rows_of_bytes(3))[0]
    assert last_pass == (
        "two-pass: a sequence holds 5 tokens, more than a chunk of 3 rows, and the open row's dW "
        f"({V * H * 4} bytes) would take more than half of max_chunk_bytes={rows_of_bytes(3)}"
    )
    last_pass = run("gmpo", open_row_bytes(3), shape=OPEN, beta=0.05)[0]
    assert last_pass == "two-pass: a sequence holds 13 tokens, more than a chunk of 6 rows"


# ----------------------------------------------------------------------------- open rows

SCALED = sorted(n for n, v in VARIANTS.items() if v.locality == single_pass.Locality.ROW)
OPEN = (13, 3)  # T, H: sequences of up to 13 tokens, an open row's dW the size of 4 logit rows
# without the KL term and entropy bonus that OPTIONS gives them (a token's own term: no open rows)
UNSCALED = {"gmpo": {"beta": 0.0}, "gspo_token": {"beta": 0.0, "entropy_coef": 0.0}}


def open_row_bytes(rows: int, dtype=torch.float32, bias=False) -> int:
    """max_chunk_bytes for an open row's dW (and db) plus chunks of `rows` rows, at H = OPEN[1]."""
    H = OPEN[1]
    acc = torch.promote_types(dtype, torch.float32).itemsize
    return V * (H + bias) * acc + rows_of_bytes(rows, H, dtype)


def earlier_pieces(mask, rows: int) -> int:
    """How many chunks of `rows` rows are an open row's earlier pieces: each takes the variant's
    token part (`Variant.token_part`) in place of a gradient call on the row so far."""
    chunks, pieces = single_pass.plan_pieces(mask.sum(-1).int().tolist(), rows)
    return sum(p is not None and c[1] < p[1] for c, p in zip(chunks, pieces))


def phase_calls(fn):
    """(fn(), {phase: calls}) with a CPU phase recorder installed."""
    rec = phases.Recorder(cuda=False)
    with phases.recording(rec):
        out = fn()
    return out, dict(rec.calls)


@pytest.mark.parametrize("name", SCALED)
@pytest.mark.parametrize("rows", [4, 6])
def test_open_rows_equal_two_pass(backend, name, rows):
    """Rows of 13 and 3 tokens in chunks of 4 or 6 rows: each long row's earlier pieces go into
    the open row's dW on the scale of the variant's token part and are folded in at its end; no
    piece runs twice, and the variant's gradient runs once a row, not once a piece."""
    opts = UNSCALED.get(name, {})
    single, calls = phase_calls(lambda: run(name, open_row_bytes(rows), shape=OPEN, **opts))
    assert single[0] == "single"
    assert calls.get("open_row_fold", 0) == 2 and "open_row_rerun" not in calls, calls
    parts = earlier_pieces(inputs(0, *OPEN)[3], rows)
    chunks = len(single_pass.plan_pieces([13, 3, 0, 13], rows)[0])
    assert (calls.get("open_row_part"), calls.get("epilogue")) == (parts, chunks - parts), calls
    assert_same(single, run(name, 0, shape=OPEN, **opts))


OPEN_ROW_OPTIONS = [
    ("gspo", {"rollout_correction": {"rollout_is": "token", "rollout_is_threshold": 2.0}}),
    ("gspo_token", {"loss_type": "grpo", "delta": 1.2}),
    ("gspo_token", {"loss_type": "dr_grpo", "max_completion_length": 13}),
    ("gmpo", {"epsilon_high": 0.3, "gradient_accumulation_steps": 2}),
    ("geo_mean", {"clip_ratio_low": 0.1, "clip_ratio_high": 0.3}),
    ("gspo", {"loss_agg_mode": "seq-mean-token-sum", "clip_ratio": 0.1}),
]


@pytest.mark.parametrize("name, options", OPEN_ROW_OPTIONS)
def test_open_rows_with_options(backend, name, options):
    options = {**UNSCALED.get(name, {}), **options}
    for seed in (0, 1):
        single, calls = phase_calls(
            functools.partial(run, name, open_row_bytes(4), seed=seed, shape=OPEN, **options)
        )
        assert single[0] == "single" and "open_row_rerun" not in calls, calls
        assert_same(single, run(name, 0, seed=seed, shape=OPEN, **options))


@pytest.mark.parametrize("token_part", [True, False])
def test_regression_an_open_row_whose_gradient_is_not_scaled_runs_again(monkeypatch, token_part):
    """The open row's fold is checked at the row's end: GMPO with a KL term (dL/dlogp = c_i·u_t
    plus each token's own k3 term) flagged as scaled gets its earlier pieces run again with the
    true gradient instead of a wrong fold. GMPO's token part (u_t without the k3 term) misses
    on both long rows; without it, each piece's gradient with the row so far live: row 3 has
    advantage 0, its gradient is the k3 term alone, unchanged as the row goes on (r = 1), and
    is folded."""
    monkeypatch.setattr(PolicyStep, "_row_scaled", lambda self: True)
    if not token_part:
        monkeypatch.setattr(PolicyStep, "_token_part", lambda self, corrected, old: None)
    single, calls = phase_calls(lambda: run("gmpo", open_row_bytes(4), shape=OPEN, beta=0.05))
    assert single[0] == "single"
    want = (2, 0) if token_part else (1, 1)
    assert (calls.get("open_row_rerun", 0), calls.get("open_row_fold", 0)) == want, calls
    assert_same(single, run("gmpo", 0, shape=OPEN, beta=0.05))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_open_rows_in_other_dtypes(backend, dtype):
    """float64 (the open row's dW in float64) and bf16 (fp32 dW, bf16 dh scaled at the fold)."""
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("the Triton path takes float32, bfloat16 and float16")
    h, w, ids, mask, adv, old, *_ = inputs(2, *OPEN)
    out = []
    for max_chunk_bytes in (open_row_bytes(4, dtype), 0):
        module = FusedLinearPolicyLoss("gspo", max_chunk_bytes=max_chunk_bytes)
        hh = h.to(dtype).requires_grad_()
        ww = w.to(dtype).requires_grad_()
        loss, _ = module(hh, ww, ids, mask, adv, old_per_token_logps=old.to(dtype))
        out.append((module.last_pass, loss, *torch.autograd.grad(loss, (hh, ww))))
    assert out[0][0] == "single" and out[1][0].startswith("two-pass")
    tol = {torch.float64: 1e-12, torch.bfloat16: 2e-2}[dtype]
    for got, want in zip(out[0][1:], out[1][1:]):
        torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)


# rows of up to 13 tokens (OPEN), a sequence-local variant, a seed
DRAWN = dict(
    lengths=st.lists(st.integers(0, 13), min_size=4, max_size=4),
    name=st.sampled_from(SCALED),
    seed=st.integers(0, 2**16),
)


@given(rows=st.integers(4, 9), **DRAWN)
def test_open_rows_on_drawn_lengths(lengths, rows, name, seed):
    """Any mix of row lengths (empty, shorter and longer than a chunk) and chunk sizes: the
    single pass with open rows equals the two-pass path."""
    old = inputs(seed, *OPEN)[5]
    assert_drawn_same(name, lengths, open_row_bytes(rows), seed, UNSCALED.get(name, {}),
                      old_per_token_logps=old)  # fmt: skip


def assert_drawn_same(name, lengths, max_chunk_bytes, seed, options, **forward):
    """The single pass (chunks of `max_chunk_bytes`) runs and equals the two-pass path on rows of
    `lengths` tokens (at the OPEN shape)."""
    h, w, ids, _, adv, *_ = inputs(seed, *OPEN)
    mask = (torch.arange(OPEN[0]) < torch.tensor(lengths)[:, None]).float()
    out = []
    for budget in (max_chunk_bytes, 0):
        module = FusedLinearPolicyLoss(name, max_chunk_bytes=budget, **options)
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        (loss, _), calls = phase_calls(functools.partial(module, hh, ww, ids, mask, adv, **forward))
        out.append((module.last_pass, loss, *torch.autograd.grad(loss, (hh, ww)), calls))
    # the token parts hold: no open row runs again
    assert out[0][0] == "single" and "open_row_rerun" not in out[0][-1], out[0][-1]
    out = [o[:-1] for o in out]
    for got, want in zip(out[0][1:], out[1][1:]):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


def test_open_rows_with_a_bias(backend):
    """The open row keeps db too (its bytes charged to the budget): the bias's gradient folds
    like the weight's, and a budget without room for it takes the two-pass path."""
    h, w, ids, mask, adv, old, *_ = inputs(3, *OPEN)
    bias = torch.randn(V)
    out = []
    for max_chunk_bytes in (open_row_bytes(4, bias=True), 0, 2 * open_row_bytes(0) + 1):
        module = FusedLinearPolicyLoss("geo_mean", max_chunk_bytes=max_chunk_bytes)
        hh, ww, bb = (t.clone().requires_grad_() for t in (h, w, bias))
        loss, _ = module(hh, ww, ids, mask, adv, bb, old_per_token_logps=old)
        out.append((module.last_pass, loss, *torch.autograd.grad(loss, (hh, ww, bb))))
    assert out[0][0] == "single" and out[1][0].startswith("two-pass")
    assert "the open row's dW" in out[2][0], out[2][0]
    for got, want in zip(out[0][1:], out[1][1:]):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


# ----------------------------------------------------------------------------- batch-wide

BATCH_OPTIONS = [
    ("kl_cov", {}),
    ("kl_cov", {"kl_cov_ratio": 0.3, "ppo_kl_coef": 2.0}),
    ("m2po", {}),
    ("m2po", {"M2_budget": 0.01, "clip_loss": "vanilla"}),
    ("m2po", {"M2_budget": 0.01, "clip_loss": "gspo"}),
]


@pytest.mark.parametrize("name, options", BATCH_OPTIONS)
@pytest.mark.parametrize("rows", [2, 5])
def test_batch_wide_variants_correct_their_tokens(backend, name, options, rows):
    """kl_cov and M2PO in chunks cut anywhere: the provisional gradients (the rest of the batch
    at its old log-probs) corrected at the sweep's end equal the two-pass path."""
    single, calls = phase_calls(lambda: run(name, rows_of_bytes(rows), **options))
    assert single[0] == "single"
    assert_same(single, run(name, 0, **options))
    if name == "kl_cov" and options:
        assert calls.get("batch_correction", 0) >= 1, calls  # 30% of the tokens in its top-k


@given(seed=st.integers(0, 2**16), rows=st.integers(1, 7), case=st.sampled_from(BATCH_OPTIONS))
def test_batch_wide_variants_on_drawn_inputs(seed, rows, case):
    name, options = case
    single = run(name, rows_of_bytes(rows), seed=seed, **options)
    assert single[0] == "single"
    assert_same(single, run(name, 0, seed=seed, **options))


# ----------------------------------------------------------------------------- on-policy


@pytest.mark.parametrize("name", SCALED)
def test_on_policy_sequence_local_variants_chunk_as_token_local(backend, name):
    """Without old log-probs every log-ratio is 0 and a sequence's factor is 1, so chunks of 3
    rows split sequences of 5 tokens with no open row, KL terms and entropy bonuses included
    (OPTIONS), and equal the two-pass path."""
    single, calls = phase_calls(lambda: run(name, rows_of_bytes(3), on_policy=True))
    two = run(name, 0, on_policy=True)
    assert single[0] == "single" and "open_row_fold" not in calls
    assert_same(single, two)


def test_on_policy_with_the_samplers_log_probs_stays_sequence_local():
    """GSPO-token's off-policy mask compares the sampler's log-probs with a whole sequence's
    current ones: a sequence longer than a chunk then takes the two-pass path."""
    sampling = inputs()[5]
    options = dict(on_policy=True, forward={"sampling_logp": sampling},
                   off_policy_mask_threshold=0.5)  # fmt: skip
    single = run("gspo_token", rows_of_bytes(3), **options)
    assert single[0] == "two-pass: a sequence holds 5 tokens, more than a chunk of 3 rows"
    assert_same(single, run("gspo_token", 0, **options))


@given(rows=st.integers(1, 9), **DRAWN)
def test_on_policy_on_drawn_lengths(lengths, rows, name, seed):
    """Any row lengths and chunks of 1 to 9 rows, the source's KL terms and entropy bonus on:
    the on-policy single pass equals the two-pass path."""
    ref = inputs(seed, *OPEN)[6]
    assert_drawn_same(name, lengths, rows_of_bytes(rows, OPEN[1]), seed, OPTIONS.get(name, {}),
                      ref_per_token_logps=ref)  # fmt: skip
