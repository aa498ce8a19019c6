"""Bad input (docs/math.md §6) on the fused modules and the primitive: it raises before any
kernel launch, naming the argument and the expected value."""

import pytest
import torch

import fgrpo_kernels as fk

B, T, H, V = 4, 3, 6, 11
HID, W, BIAS = torch.randn(B, T, H), torch.randn(V, H), torch.randn(V)
IDS, MASK = torch.randint(0, V, (B, T)), torch.ones(B, T)
ADV, RW, REF = torch.randn(B), torch.rand(B), torch.randn(B, T)
CHOSEN = torch.tensor([True, False, True, False])


def fg(init=None, **kw):
    args = dict(
        hidden=HID,
        weight=W,
        completion_ids=IDS,
        completion_mask=MASK,
        advantages=ADV,
        ref_per_token_logps=REF,
    )
    args.update(kw)
    return lambda: fk.FusedLinearFGRPOLoss(**(init or {}))(**args)


def gr(init=None, **kw):
    args = dict(
        hidden=HID,
        weight=W,
        completion_ids=IDS,
        completion_mask=MASK,
        advantages=ADV,
        ref_per_token_logps=REF,
    )
    args.update(kw)
    return lambda: fk.FusedLinearGRPOLoss(**(init or {}))(**args)


def gi(init=None, **kw):
    args = dict(
        hidden=HID,
        weight=W,
        completion_ids=IDS,
        completion_mask=MASK,
        rewards=RW,
        ref_per_token_logps=REF,
    )
    args.update(kw)
    return lambda: fk.FusedLinearGIFTLoss(**(init or {"num_generations": 2}))(**args)


def fd(**kw):
    args = dict(
        hidden=HID,
        weight=W,
        completion_ids=IDS,
        completion_mask=MASK,
        chosen=CHOSEN,
        ref_per_token_logps=REF,
    )
    args.update(kw)
    return lambda: fk.FusedLinearFDOLoss()(**args)


def fh(init=None, **kw):
    args = dict(
        hidden=HID,
        weight=W,
        completion_ids=IDS,
        completion_mask=MASK,
        pref_hidden=HID,
        pref_completion_ids=IDS,
        pref_completion_mask=MASK,
        chosen=CHOSEN,
        advantages=ADV,
        ref_per_token_logps=REF,
        pref_ref_per_token_logps=REF,
    )
    args.update(kw)
    return lambda: fk.FusedLinearFHALLoss(**(init or {}))(**args)


def lp(**kw):
    args = dict(hidden=HID, weight=W, targets=IDS)
    args.update(kw)
    return lambda: fk.fused_linear_logprobs(**args)


CASES = {
    # the primitive
    "lp hidden list": (lp(hidden=[[1.0]]), TypeError, "hidden"),
    "lp weight H": (lp(weight=torch.randn(V, H + 2)), ValueError, "weight"),
    "lp targets shape": (lp(targets=IDS[:, :2]), ValueError, "targets"),
    "lp targets >= V": (lp(targets=torch.full((B, T), V)), ValueError, "targets"),
    "lp targets float": (lp(targets=IDS.float()), TypeError, "targets"),
    "lp bias shape": (lp(bias=torch.randn(V - 1)), ValueError, "bias"),
    "lp temperature 0": (lp(temperature=0), ValueError, "temperature"),
    "lp fp16 x bf16": (lp(hidden=HID.half(), weight=W.bfloat16()), TypeError, "weight"),
    # constructors
    "fgrpo divergence": (fg({"divergence": "alpha"}), ValueError, "divergence"),
    "fgrpo level": (fg({"level": "group"}), ValueError, "level"),
    "fgrpo reduction": (fg({"reduction": "mean"}), ValueError, "reduction"),
    "fgrpo seq reduction": (
        fg({"level": "sequence", "reduction": "token_mean"}),
        ValueError,
        "reduction",
    ),
    "fgrpo temperature": (fg({"temperature": -1.0}), ValueError, "temperature"),
    "fgrpo G float": (fg({"num_generations": 2.5}), TypeError, "num_generations"),
    "fgrpo scale": (fg({"scale_rewards": "std"}), ValueError, "scale_rewards"),
    "fgrpo beta": (fg({"beta": None}), TypeError, "beta"),
    "grpo loss_type": (gr({"loss_type": "ppo"}), ValueError, "loss_type"),
    "grpo is level": (
        gr({"importance_sampling_level": "tok"}),
        ValueError,
        "importance_sampling_level",
    ),
    "grpo eps": (gr({"epsilon_high": -0.2}), ValueError, "epsilon_high"),
    "grpo max len": (gr({"max_completion_length": 0}), ValueError, "max_completion_length"),
    "gift G": (gi({"num_generations": 0}), ValueError, "num_generations"),
    "fhal lam": (fh({"lam": 2.0}), ValueError, "lam"),
    # forward arguments
    "hidden 2-D": (fg(hidden=HID.reshape(B * T, H)), ValueError, "hidden"),
    "hidden int": (fg(hidden=HID.long()), TypeError, "hidden"),
    "weight H": (fg(weight=torch.randn(V, H - 1)), ValueError, "weight"),
    "weight dtype mix": (fg(hidden=HID.half(), weight=W.bfloat16()), TypeError, "weight"),
    "ids shape": (fg(completion_ids=IDS[:2]), ValueError, "completion_ids"),
    "ids float": (fg(completion_ids=IDS.float()), TypeError, "completion_ids"),
    "ids out of vocab": (fg(completion_ids=IDS + V), ValueError, "completion_ids"),
    "ids negative": (fg(completion_ids=IDS - V), ValueError, "completion_ids"),
    "mask shape": (fg(completion_mask=MASK[:, :1]), ValueError, "completion_mask"),
    "bias shape": (fg(bias=BIAS[:3]), ValueError, "bias"),
    "advantages shape": (fg(advantages=ADV[:2]), ValueError, "advantages"),
    "advantages and rewards": (fg({"num_generations": 2}, rewards=RW), ValueError, "advantages"),
    "neither": (fg(advantages=None), ValueError, "advantages"),
    "rewards without G": (fg(advantages=None, rewards=RW), ValueError, "num_generations"),
    "rewards B % G": (
        fg({"num_generations": 3}, advantages=None, rewards=RW),
        ValueError,
        "num_generations",
    ),
    "is-weights without rewards": (
        fg({"group_is_weights": True, "num_generations": 2}),
        ValueError,
        "rewards",
    ),
    "ref missing": (fg(ref_per_token_logps=None), ValueError, "ref_per_token_logps"),
    "ref shape": (fg(ref_per_token_logps=REF[:, :1]), ValueError, "ref_per_token_logps"),
    "ref_hidden shape": (
        fg(ref_per_token_logps=None, ref_hidden=HID[:, :2]),
        ValueError,
        "ref_hidden",
    ),
    "ref_weight H": (
        fg(ref_per_token_logps=None, ref_hidden=HID, ref_weight=W[:, :2]),
        ValueError,
        "ref_weight",
    ),
    "fhal pref ref shape": (
        fh(pref_ref_per_token_logps=REF[:, :1]),
        ValueError,
        "pref_ref_per_token_logps",
    ),
    "old shape": (gr(old_per_token_logps=REF[:3]), ValueError, "old_per_token_logps"),
    "grpo advantages 2-D": (gr(advantages=REF), ValueError, "advantages"),
    "grpo beta without ref": (gr(ref_per_token_logps=None), ValueError, "ref_per_token_logps"),
    "grpo num_items < 0": (gr(num_items_in_batch=-3), ValueError, "num_items_in_batch"),
    "gift rewards shape": (gi(rewards=RW[:3]), ValueError, "rewards"),
    "gift B % G": (gi({"num_generations": 3}), ValueError, "num_generations"),
    "fdo chosen all": (fd(chosen=torch.ones(B, dtype=torch.bool)), ValueError, "chosen"),
    "fdo chosen none": (fd(chosen=torch.zeros(B, dtype=torch.bool)), ValueError, "chosen"),
    "fdo chosen dtype": (fd(chosen=CHOSEN.long()), TypeError, "chosen"),
    "fhal pref ids": (fh(pref_completion_ids=IDS[:, :1]), ValueError, "pref_completion_ids"),
    "fhal chosen pool": (fh(chosen=torch.ones(B, dtype=torch.bool)), ValueError, "chosen"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_names_the_argument(name, monkeypatch):
    fn, exc, arg = CASES[name]
    launched = []
    import fgrpo_kernels.head.autograd as glue

    monkeypatch.setattr(glue, "select_backend", lambda *a: launched.append(a) or 1 / 0)
    with pytest.raises(exc) as info:
        fn()
    assert str(info.value).startswith(f"{arg}:"), str(info.value)
    assert "expected" in str(info.value)
    assert not launched, "a kernel was launched before the inputs were validated"
