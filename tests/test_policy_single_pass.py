"""The policy variants' single pass (losses/policy.py, `PolicyStep.chunked`) against their
two-pass path on every backend, with chunks small enough to split sequences (token-local
variants) or to hold several whole ones (sequence-local): the loss, the gradients in hidden
and weight, and the metrics. The variants that need the whole batch's log-probs first, and the
option sets that make a variant batch-wide, say why they take the two-pass path."""

import pytest
import torch

from fgrpo_kernels.head.autograd import select_backend
from fgrpo_kernels.losses import single_pass
from fgrpo_kernels.losses.policy import VARIANTS, FusedLinearPolicyLoss

B, T, H, V = 4, 5, 8, 23
LOCAL = sorted(n for n, v in VARIANTS.items() if not isinstance(v.locality, str))
OPTIONS = {
    "dro": {"dro_beta": 0.1},
    "gmpo": {"beta": 0.05},
    "gspo_token": {"beta": 0.05, "entropy_coef": 0.01, "compute_entropy": True},
}


def inputs(seed=0):
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


def rows_of_bytes(rows: int) -> int:
    """max_chunk_bytes for chunks of `rows` rows on the backend in use."""
    return rows * select_backend(torch.device("cpu")).bytes_per_row(torch.empty(1, H), V)


def run(name, max_chunk_bytes, seed=0, **options):
    h, w, ids, mask, adv, old, ref, rollout, keep = inputs(seed)
    opts = {**OPTIONS.get(name, {}), **options}
    module = FusedLinearPolicyLoss(name, max_chunk_bytes=max_chunk_bytes, **opts)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    forward = {"clip_cov_keep": keep} if name == "clip_cov" else {}
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
        ("kl_cov", {}, "top-k of the token covariance"),
        ("m2po", {}, "clip range (tau)"),
        ("gmpo", {"top_entropy_quantile": 0.5}, "top_entropy_quantile < 1"),
        ("vanilla", {"rollout_correction": {"rollout_is": "token", "bypass_mode": True}}, "bypass"),
    ],
)
def test_batch_wide_variants_say_why_they_take_two_passes(name, options, reason):
    last_pass, loss, gh, gw, _ = run(name, None, **options)
    assert last_pass.startswith(f"two-pass: loss_mode={name!r}: ") and reason in last_pass
    assert torch.isfinite(loss) and torch.isfinite(gh).all() and torch.isfinite(gw).all()


def test_a_sequence_longer_than_the_chunk_takes_two_passes():
    last_pass = run("gspo", rows_of_bytes(3))[0]
    assert last_pass == "two-pass: a sequence holds 5 tokens, more than a chunk of 3 rows"
