"""Silent garbage refused (docs/math.md §6): NaN or inf in advantages, rewards or given
log-probs, masks that are not 0/1, and float64 mixed with another dtype in the lm_head each
raise an error naming the argument, on the fused modules (chunked-torch and C++ backends, one
Triton case) and on the reference. The last tests pin what stays accepted: non-finite values
at masked positions (they never reach a loss), half-precision activations with fp32 weights,
and the dtype of the log-probs (fp32, fp64 for fp64 inputs)."""

import pytest
import torch

import fgrpo_kernels as fk
from fgrpo_kernels import reference as ref
from fgrpo_kernels.backends.cpu import cpp

B, T, H, V = 4, 5, 6, 13
GEN = torch.Generator().manual_seed(0)
HID, W = torch.randn(B, T, H, generator=GEN), torch.randn(V, H, generator=GEN)
IDS = torch.randint(0, V, (B, T), generator=GEN)
MASK = torch.ones(B, T)
MASK[:, 3:] = 0  # right padding: positions [:, 3:] are masked
ADV, RW = torch.randn(B, generator=GEN), torch.rand(B, generator=GEN)
REF, OLD = torch.randn(B, T, generator=GEN) - 3, torch.randn(B, T, generator=GEN) - 3
CHOSEN = torch.tensor([True, False, True, False])
LIVE, PAD = (1, 2), (1, 4)  # an unmasked and a masked position


@pytest.fixture(params=["chunked", "cpp"])
def backend(request, monkeypatch):
    monkeypatch.setenv("FGRPO_BACKEND", "cpu")
    monkeypatch.setenv("FGRPO_CPU_BACKEND", "torch" if request.param == "chunked" else "cpp")
    if request.param == "cpp" and not cpp.available():
        pytest.skip(f"C++ backend not built: {cpp.build_error()}")
    return request.param


def grpo(**kw):
    args = dict(advantages=ADV, ref_per_token_logps=REF, old_per_token_logps=OLD)
    return fk.FusedLinearGRPOLoss(beta=0.04), {**args, **kw}


def fgrpo(**kw):
    args = dict(advantages=ADV, ref_per_token_logps=REF, old_per_token_logps=OLD)
    return fk.FusedLinearFGRPOLoss(), {**args, **kw}


def fgrpo_rewards(**kw):
    args = dict(rewards=RW, ref_per_token_logps=REF)
    return fk.FusedLinearFGRPOLoss(num_generations=2), {**args, **kw}


def gift(**kw):
    return fk.FusedLinearGIFTLoss(2), {"rewards": RW, "ref_per_token_logps": REF, **kw}


def fdo(**kw):
    return fk.FusedLinearFDOLoss(), {"chosen": CHOSEN, "ref_per_token_logps": REF, **kw}


def fhal(**kw):
    args = dict(
        pref_hidden=HID, pref_completion_ids=IDS, pref_completion_mask=MASK, chosen=CHOSEN,
        advantages=ADV, ref_per_token_logps=REF, pref_ref_per_token_logps=REF,
    )  # fmt: skip
    return fk.FusedLinearFHALLoss(), {**args, **kw}


def policy(**kw):
    module = fk.FusedLinearPolicyLoss(
        "vanilla", kl_coef=0.1, rollout_correction={"rollout_is": "token"}
    )
    args = dict(advantages=ADV, ref_per_token_logps=REF, old_per_token_logps=OLD,
                rollout_per_token_logps=OLD - 0.1)  # fmt: skip
    return module, {**args, **kw}


def call(make, hidden=HID, weight=W, mask=MASK, **kw):
    module, args = make(**kw)
    return module(hidden, weight, IDS, mask, **args)


def poisoned(t, value, at):
    t = t.clone()
    t[at] = value
    return t


# (module, argument, its clean value, where to put the NaN/inf)
NON_FINITE = [
    (grpo, "advantages", ADV, 2),
    (grpo, "ref_per_token_logps", REF, LIVE),
    (grpo, "old_per_token_logps", OLD, LIVE),
    (fgrpo, "advantages", ADV, 0),
    (fgrpo, "ref_per_token_logps", REF, LIVE),
    (fgrpo, "old_per_token_logps", OLD, LIVE),
    (fgrpo_rewards, "rewards", RW, 3),
    (gift, "rewards", RW, 1),
    (gift, "ref_per_token_logps", REF, LIVE),
    (fdo, "ref_per_token_logps", REF, LIVE),
    (fhal, "pref_ref_per_token_logps", REF, LIVE),
    (fhal, "advantages", ADV, 1),
    (policy, "advantages", ADV, 0),
    (policy, "ref_per_token_logps", REF, LIVE),
    (policy, "old_per_token_logps", OLD, LIVE),
    (policy, "rollout_per_token_logps", OLD, LIVE),
]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("make, arg, clean, at", NON_FINITE)
def test_non_finite_input_is_named(backend, make, arg, clean, at, value):
    bad = poisoned(clean, value, at)
    with pytest.raises(ValueError, match=f"^{arg}: expected finite values; got 1 NaN/inf of"):
        call(make, **{arg: bad})


@pytest.mark.parametrize("make", [grpo, fgrpo, fgrpo_rewards, gift, fdo, policy])
@pytest.mark.parametrize("value", [-1.0, 0.5, 2.0, float("nan")])
def test_mask_that_is_not_0_or_1_is_named(backend, make, value):
    with pytest.raises(ValueError, match=r"^completion_mask: expected 0/1 values .* at \[0, 1\]"):
        call(make, mask=poisoned(MASK, value, (0, 1)))


def test_preference_mask_that_is_not_0_or_1_is_named(backend):
    with pytest.raises(ValueError, match="^pref_completion_mask: expected 0/1 values"):
        call(fhal, pref_completion_mask=poisoned(MASK, -1, (2, 0)))


@pytest.mark.parametrize("make", [grpo, fgrpo, gift, fdo, policy])
@pytest.mark.parametrize(
    "hidden, weight",
    [(HID.double(), W), (HID, W.double()), (HID.bfloat16(), W.double())],
    ids=["fp64-fp32", "fp32-fp64", "bf16-fp64"],
)
def test_float64_mixed_into_the_lm_head_is_named(backend, make, hidden, weight):
    with pytest.raises(TypeError, match="^weight: expected hidden's dtype"):
        call(make, hidden=hidden, weight=weight)


def test_float64_reference_hidden_with_fp32_weight_is_named(backend):
    with pytest.raises(TypeError, match="^weight: expected ref_hidden's dtype torch.float64"):
        call(grpo, ref_per_token_logps=None, ref_hidden=HID.double())
    with pytest.raises(TypeError, match="^ref_weight: expected ref_hidden's dtype"):
        call(grpo, ref_per_token_logps=None, ref_hidden=HID, ref_weight=W.double())


def test_primitive_refuses_float64_mixes():
    with pytest.raises(TypeError, match="^weight: expected hidden's dtype torch.float64"):
        fk.fused_linear_logprobs(HID.double(), W, IDS)


def test_triton_refuses_nan_advantages_and_a_weighted_mask(monkeypatch):
    """The checks run before any kernel, on the Triton path as well (interpreted here)."""
    monkeypatch.setenv("FGRPO_BACKEND", "triton")
    with pytest.raises(ValueError, match="^advantages: expected finite values"):
        call(grpo, advantages=poisoned(ADV, float("nan"), 0))
    with pytest.raises(ValueError, match="^completion_mask: expected 0/1 values"):
        call(grpo, mask=poisoned(MASK, 0.5, (0, 0)))


# ----------------------------------------------------------------------------- the reference

LP = ref.logprobs(HID, W, IDS)


@pytest.mark.parametrize(
    "fn, arg, at",
    [
        (lambda **k: ref.grpo_loss(LP, k.get("old", OLD), k.get("ref", REF),
                                   k.get("adv", ADV), MASK), "advantages", 0),
        (lambda **k: ref.grpo_loss(LP, k.get("old", OLD), k.get("ref", REF),
                                   k.get("adv", ADV), MASK), "old_logps", LIVE),
        (lambda **k: ref.grpo_loss(LP, k.get("old", OLD), k.get("ref", REF),
                                   k.get("adv", ADV), MASK), "ref_logps", LIVE),
        (lambda **k: ref.fgrpo_loss(LP, k.get("ref", REF), k.get("adv", ADV), MASK),
         "advantages", 3),
        (lambda **k: ref.fgrpo_loss(LP, k.get("ref", REF), k.get("adv", ADV), MASK),
         "ref_logps", LIVE),
        (lambda **k: ref.fgrpo_loss(LP, REF, None, MASK, rewards=k.get("rw", RW),
                                    num_generations=2), "rewards", 1),
        (lambda **k: ref.gift_loss(LP, REF, k.get("rw", RW), MASK, 2), "rewards", 0),
        (lambda **k: ref.fdo_loss(LP, k.get("ref", REF), MASK, CHOSEN), "ref_logps", LIVE),
        (lambda **k: ref.fhal_loss(LP, REF, ADV, MASK, LP, k.get("ref", REF), MASK, CHOSEN),
         "pref_ref_logps", LIVE),
        (lambda **k: ref.group_normalize(k.get("rw", RW), 2), "rewards", 2),
    ],
    ids=["grpo-adv", "grpo-old", "grpo-ref", "fgrpo-adv", "fgrpo-ref", "fgrpo-rewards",
         "gift-rewards", "fdo-ref", "fhal-pref-ref", "group_normalize"],
)  # fmt: skip
def test_reference_refuses_non_finite_input(fn, arg, at):
    key = {"advantages": "adv", "rewards": "rw", "old_logps": "old"}.get(arg, "ref")
    clean = {"adv": ADV, "rw": RW, "old": OLD, "ref": REF}[key]
    with pytest.raises(ValueError, match=f"^{arg}: expected finite values; got 1 NaN/inf"):
        fn(**{key: poisoned(clean, float("nan"), at)})


@pytest.mark.parametrize("value", [-1.0, 0.25, 3.0])
def test_reference_refuses_a_mask_that_is_not_0_or_1(value):
    bad = poisoned(MASK, value, (3, 0))
    with pytest.raises(ValueError, match=r"^mask: expected 0/1 values .* at \[3, 0\]"):
        ref.fgrpo_loss(LP, REF, ADV, bad)
    with pytest.raises(ValueError, match="^mask: expected 0/1 values"):
        ref.grpo_loss(LP, OLD, REF, ADV, bad)
    with pytest.raises(ValueError, match="^pref_mask: expected 0/1 values"):
        ref.fhal_loss(LP, REF, ADV, MASK, LP, REF, bad, CHOSEN)


def test_reference_logprobs_refuse_float64_mixes():
    with pytest.raises(TypeError, match="^weight: expected hidden's dtype torch.float64"):
        ref.logprobs(HID.double(), W, IDS)


# ----------------------------------------------------------------------------- what stays accepted


@pytest.mark.parametrize(
    "make, arg, clean",
    [(grpo, "ref_per_token_logps", REF), (grpo, "old_per_token_logps", OLD),
     (fgrpo, "ref_per_token_logps", REF), (gift, "ref_per_token_logps", REF),
     (fdo, "ref_per_token_logps", REF), (fhal, "pref_ref_per_token_logps", REF),
     (policy, "rollout_per_token_logps", OLD - 0.1)],
)  # fmt: skip
def test_non_finite_log_probs_at_masked_positions_change_nothing(backend, make, arg, clean):
    """Padding may hold anything (docs/math.md §6): the loss is the one with finite padding."""
    hidden = HID.clone().requires_grad_()
    loss = call(make, hidden=hidden, **{arg: poisoned(clean, float("nan"), PAD)})[0]
    loss.backward()
    want = call(make, **{arg: clean})[0]
    assert torch.isfinite(hidden.grad).all()
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mask", [MASK.bool(), MASK.long(), MASK.to(torch.uint8)])
def test_binary_masks_of_any_dtype_are_accepted(backend, mask):
    want = call(grpo)[0]
    torch.testing.assert_close(call(grpo, mask=mask)[0], want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_activations_with_fp32_weights_stay_accepted(backend, dtype):
    """Autocast's pair (half hidden, fp32 master weight) is not a float64 mix."""
    loss, _ = call(grpo, hidden=HID.to(dtype))
    assert torch.isfinite(loss)


@pytest.mark.parametrize(
    "hidden_dtype, weight_dtype, out",
    [(torch.float32, torch.float32, torch.float32),
     (torch.bfloat16, torch.float32, torch.float32),
     (torch.bfloat16, torch.bfloat16, torch.float32),
     (torch.float64, torch.float64, torch.float64)],
)  # fmt: skip
def test_log_prob_dtype_is_fp32_or_fp64_for_fp64_inputs(backend, hidden_dtype, weight_dtype, out):
    """The README's sentence: fp32 log-probs, fp64 for fp64 hidden and weight (CPU path)."""
    logp = fk.fused_linear_logprobs(HID.to(hidden_dtype), W.to(weight_dtype), IDS)
    assert logp.dtype == out
