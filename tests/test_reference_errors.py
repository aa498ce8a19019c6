"""Bad input (docs/math.md §6) on the reference: a ValueError/TypeError naming the argument."""

import pytest
import torch

from fgrpo_kernels import reference as R

B, T, H, V = 4, 3, 5, 7
LP, REF, OLD = torch.randn(B, T), torch.randn(B, T), torch.randn(B, T)
MASK, ADV, RW = torch.ones(B, T), torch.randn(B), torch.rand(B)
CHOSEN = torch.tensor([True, False, True, False])
HID, W, Y = torch.randn(2, 3, H), torch.randn(V, H), torch.randint(0, V, (2, 3))


def lp(**kw):
    args = dict(hidden=HID, weight=W, targets=Y)
    args.update(kw)
    return lambda: R.logprobs(**args)


def fg(**kw):
    args = dict(logps=LP, ref_logps=REF, advantages=ADV, mask=MASK)
    args.update(kw)
    return lambda: R.fgrpo_loss(**args)


def gr(**kw):
    args = dict(logps=LP, old_logps=OLD, ref_logps=REF, advantages=ADV, mask=MASK)
    args.update(kw)
    return lambda: R.grpo_loss(**args)


def gi(**kw):
    args = dict(logps=LP, ref_logps=REF, rewards=RW, mask=MASK, num_generations=2)
    args.update(kw)
    return lambda: R.gift_loss(**args)


def fd(**kw):
    args = dict(logps=LP, ref_logps=REF, mask=MASK, chosen=CHOSEN)
    args.update(kw)
    return lambda: R.fdo_loss(**args)


CASES = {
    "hidden not a tensor": (lp(hidden=[1.0]), TypeError, "hidden"),
    "hidden integer": (lp(hidden=torch.ones(2, 3, H, dtype=torch.int64)), TypeError, "hidden"),
    "weight H mismatch": (lp(weight=torch.randn(V, H + 1)), ValueError, "weight"),
    "weight 1-D": (lp(weight=torch.randn(V)), ValueError, "weight"),
    "fp16 with bf16": (lp(hidden=HID.half(), weight=W.bfloat16()), TypeError, "weight"),
    "targets shape": (lp(targets=torch.zeros(2, 4, dtype=torch.long)), ValueError, "targets"),
    "targets float": (lp(targets=Y.float()), TypeError, "targets"),
    "target = V": (lp(targets=torch.full((2, 3), V)), ValueError, "targets"),
    "target = -1": (lp(targets=torch.full((2, 3), -1)), ValueError, "targets"),
    "bias shape": (lp(bias=torch.randn(V + 1)), ValueError, "bias"),
    "temperature 0": (lp(temperature=0.0), ValueError, "temperature"),
    "temperature < 0": (lp(temperature=-1.0), ValueError, "temperature"),
    "temperature nan": (lp(temperature=float("nan")), ValueError, "temperature"),
    "temperature str": (lp(temperature="1"), TypeError, "temperature"),
    "ignore_index float": (lp(ignore_index=-100.0), TypeError, "ignore_index"),
    "rewards 2-D": (lambda: R.group_normalize(torch.rand(2, 2), 2), ValueError, "rewards"),
    "B % G": (lambda: R.group_normalize(torch.rand(5), 2), ValueError, "num_generations"),
    "G = 0": (lambda: R.group_normalize(torch.rand(4), 0), ValueError, "num_generations"),
    "G float": (lambda: R.group_normalize(torch.rand(4), 2.0), TypeError, "num_generations"),
    "scale unknown": (lambda: R.group_normalize(RW, 2, scale="std"), ValueError, "scale"),
    "eps < 0": (lambda: R.group_normalize(RW, 2, eps=-1.0), ValueError, "eps"),
    "divergence unknown": (fg(divergence="chi2"), ValueError, "divergence"),
    "level unknown": (fg(level="step"), ValueError, "level"),
    "reduction unknown": (fg(reduction="mean"), ValueError, "reduction"),
    "token_mean at sequence level": (
        fg(level="sequence", reduction="token_mean"),
        ValueError,
        "reduction",
    ),
    "logps 1-D": (fg(logps=torch.randn(B)), ValueError, "logps"),
    "ref_logps shape": (fg(ref_logps=torch.randn(B, T + 1)), ValueError, "ref_logps"),
    "mask shape": (fg(mask=torch.ones(B, T - 1)), ValueError, "mask"),
    "advantages shape": (fg(advantages=torch.randn(B + 1)), ValueError, "advantages"),
    "advantages and rewards": (fg(rewards=RW, num_generations=2), ValueError, "advantages"),
    "neither": (fg(advantages=None), ValueError, "advantages"),
    "rewards without G": (fg(advantages=None, rewards=RW), ValueError, "num_generations"),
    "rewards B % G": (
        fg(advantages=None, rewards=RW, num_generations=3),
        ValueError,
        "num_generations",
    ),
    "is-weights without old": (
        fg(advantages=None, rewards=RW, num_generations=2, group_is_weights=True),
        TypeError,
        "old_logps",
    ),
    "is-weights without rewards": (
        fg(group_is_weights=True, old_logps=OLD, num_generations=2),
        ValueError,
        "rewards",
    ),
    "beta str": (fg(beta="0.1"), TypeError, "beta"),
    "loss_type unknown": (gr(loss_type="ppo"), ValueError, "loss_type"),
    "is level unknown": (
        gr(importance_sampling_level="step"),
        ValueError,
        "importance_sampling_level",
    ),
    "old_logps shape": (gr(old_logps=torch.randn(B, T + 1)), ValueError, "old_logps"),
    "grpo advantages 2-D": (gr(advantages=torch.randn(B, T)), ValueError, "advantages"),
    "epsilon_low < 0": (gr(epsilon_low=-0.1), ValueError, "epsilon_low"),
    "max_completion_length 0": (
        gr(loss_type="dr_grpo", max_completion_length=0),
        ValueError,
        "max_completion_length",
    ),
    "gift B % G": (gi(num_generations=3), ValueError, "num_generations"),
    "gift rewards shape": (gi(rewards=torch.rand(B + 2)), ValueError, "rewards"),
    "chosen empty pool": (fd(chosen=torch.ones(B, dtype=torch.bool)), ValueError, "chosen"),
    "rejected empty pool": (fd(chosen=torch.zeros(B, dtype=torch.bool)), ValueError, "chosen"),
    "chosen not bool": (fd(chosen=torch.ones(B)), TypeError, "chosen"),
    "chosen shape": (fd(chosen=CHOSEN[:2]), ValueError, "chosen"),
    "lam > 1": (
        lambda: R.fhal_loss(LP, REF, ADV, MASK, LP, REF, MASK, CHOSEN, lam=1.5),
        ValueError,
        "lam",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_names_the_argument(name):
    fn, exc, arg = CASES[name]
    with pytest.raises(exc) as info:
        fn()
    assert str(info.value).startswith(f"{arg}:"), str(info.value)
