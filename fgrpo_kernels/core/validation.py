"""Argument checks shared by the reference and the fused modules (docs/math.md §6).

Every failure is a ValueError or TypeError whose message starts with the argument's name and
states the expected value.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def choice(arg: str, value, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{arg}: expected one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def positive(arg: str, value, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{arg}: expected a real number; got {type(value).__name__}")
    if not (value > 0 or (allow_zero and value == 0)) or value != value or value == float("inf"):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{arg}: expected a finite number {bound}; got {value!r}")
    return float(value)


# Below this the logits z/τ of any realistic lm_head (|h·w + b| up to 3e8) overflow fp32, and
# 1/τ itself does below 3e-39.
MIN_TEMPERATURE = 1e-30


def temperature(value) -> float:
    """τ > 0, finite, and ≥ MIN_TEMPERATURE (1/τ and the scaled logits must stay finite)."""
    value = positive("temperature", value)
    if value < MIN_TEMPERATURE:
        raise ValueError(
            f"temperature: expected a number >= {MIN_TEMPERATURE:g} (the logits are divided by "
            f"it in fp32); got {value!r}"
        )
    return value


def unit_fraction(arg: str, value, why: str) -> float:
    """A number in [0, 1)."""
    value = positive(arg, value, allow_zero=True)
    if value >= 1.0:
        raise ValueError(f"{arg}: expected a number in [0, 1) ({why}); got {value!r}")
    return value


def num_items_in_batch(value) -> None:
    """None, or a positive count (a number or a one-element tensor): the dapo normaliser."""
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        tensor("num_items_in_batch", value)
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(
                "num_items_in_batch: expected a number or a one-element real tensor; got "
                f"{value.dtype} of shape {list(value.shape)}"
            )
        value = value.item()
    positive("num_items_in_batch", value)


def real(arg: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{arg}: expected a real number; got {type(value).__name__}")
    if value != value or abs(value) == float("inf"):
        raise ValueError(f"{arg}: expected a finite number; got {value!r}")
    return float(value)


def tensor(
    arg: str,
    t,
    *,
    shape: Sequence[int | None] | None = None,
    ndim: int | None = None,
    floating: bool = False,
    dtypes: Sequence[torch.dtype] | None = None,
) -> torch.Tensor:
    """Check a tensor's type, rank, shape (None = any size on that axis) and dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg}: expected a torch.Tensor; got {type(t).__name__}")
    if t.is_meta:
        raise ValueError(f"{arg}: expected a tensor with data; got a meta tensor")
    if shape is not None:
        ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
        if not ok:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{arg}: expected shape {want}; got {list(t.shape)}")
    elif ndim is not None and t.dim() != ndim:
        raise ValueError(f"{arg}: expected a {ndim}-D tensor; got shape {list(t.shape)}")
    if floating and t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{arg}: expected a floating-point tensor; got {t.dtype}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{arg}: expected dtype in {[str(d) for d in dtypes]}; got {t.dtype}")
    return t


def mask(arg: str, m, shape: Sequence[int]) -> torch.Tensor:
    """A 0/1 mask of the given shape (bool, integer or floating dtype). Other values (negative,
    fractional, > 1, NaN) are refused: the Triton epilogue reads a mask as `!= 0` while the
    CPU paths multiply by it, so a weighted mask would give different losses (docs/math.md §6)."""
    tensor(arg, m, shape=shape)
    if m.is_complex():
        raise TypeError(f"{arg}: expected a 0/1 mask of real dtype; got {m.dtype}")
    if m.dtype != torch.bool and m.numel():
        bad = (m != 0) & (m != 1)
        count = int(bad.sum())  # one reduction, one host sync
        if count:
            at = [int(i) for i in bad.nonzero()[0]]
            raise ValueError(
                f"{arg}: expected 0/1 values (1 = a token that counts, 0 = padding); got "
                f"{m[tuple(at)].item()!r} at {at} ({count} of {m.numel()} entries not 0 or 1)"
            )
    return m


def finite(arg: str, t: torch.Tensor | None, where: torch.Tensor | None = None) -> None:
    """NaN or ±inf in `t` is a ValueError naming `arg`. With `where` (a mask broadcastable to
    `t`) only the positions where it is nonzero count: masked positions never reach a loss
    (every loss selects them away with `torch.where`), and TRL's padding holds whatever the
    model scored there.

    NB: one reduction and one host sync per tensor. On a GPU that sync stalls the launch queue;
    its cost there is unmeasured (no GPU in this project's runs). On 2 CPU cores the value
    checks of a GRPO call (mask, advantages, reference and old log-probs; N 8192) take 0.15 ms,
    0.02% of its forward+backward at H 128, V 32768 (bench/finite_checks.py)."""
    if t is None or t.numel() == 0:
        return
    bad = ~torch.isfinite(t.detach())
    if where is not None:
        bad = bad & (where != 0)
    count = int(bad.sum())
    if count:
        raise ValueError(
            f"{arg}: expected finite values; got {count} NaN/inf of {t.numel()}"
            + (" (counted where the mask is set)" if where is not None else "")
        )


def per_row(arg: str, t, B: int) -> torch.Tensor:
    """A floating [B] tensor of finite values (advantages, rewards)."""
    tensor(arg, t, shape=(B,), floating=True)
    finite(arg, t)
    return t


def per_token_logps(arg: str, t, mask_: torch.Tensor) -> torch.Tensor:
    """Given log-probs [B, T] (reference, old, rollout), finite where `mask_` is set."""
    tensor(arg, t, shape=tuple(mask_.shape), floating=True)
    finite(arg, t, mask_)
    return t


def head_dtypes(hidden_arg: str, hidden, weight_arg: str, weight) -> None:
    """The dtype pairs of (hidden, weight) the kernels take: equal dtypes, or fp16 / bf16 with
    fp32 (autocast's half activations with fp32 master weights). fp64 is never mixed: torch's
    matmul refuses it, and a silent promotion would hide a model cast by mistake."""
    pair = {hidden.dtype, weight.dtype}
    if len(pair) == 1:
        return
    if torch.float64 in pair:
        raise TypeError(
            f"{weight_arg}: expected {hidden_arg}'s dtype {hidden.dtype} (float64 is not mixed "
            f"with other dtypes); got {weight.dtype}"
        )
    if pair == {torch.float16, torch.bfloat16}:
        raise TypeError(
            f"{weight_arg}: expected the dtype family of {hidden_arg} (fp16 or bf16, each with "
            f"fp32); got {hidden_arg} {hidden.dtype} and {weight_arg} {weight.dtype}"
        )


def num_generations(arg: str, g, batch: int) -> int:
    if isinstance(g, bool) or not isinstance(g, int):
        raise TypeError(f"{arg}: expected a positive int; got {type(g).__name__}")
    if g <= 0:
        raise ValueError(f"{arg}: expected a positive int; got {g}")
    if batch % g != 0:
        raise ValueError(
            f"{arg}: expected a divisor of the batch size {batch} (completions of one prompt are "
            f"contiguous rows); got {g}"
        )
    return g


def same_device(tensors: dict[str, torch.Tensor | None]) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        desc = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"tensors must share one device; got {desc}")


INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


def lm_head_sizes(prefix: str, hidden, weight) -> None:
    """H ≥ 1 and V ≥ 1: an lm_head with no hidden units or no vocabulary has no softmax."""
    if hidden.shape[-1] == 0:
        raise ValueError(
            f"{prefix}hidden: expected a hidden size H >= 1; got shape {list(hidden.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError(f"weight: expected V >= 1 vocabulary rows; got shape {list(weight.shape)}")


def bias_entries(bias) -> None:
    """A bias may hold −inf (a banned token: p = 0, as logit processors do), not NaN or +inf,
    and not only −inf (no token left)."""
    if bias is None:
        return
    bias = bias.detach()
    bad = torch.isnan(bias) | (bias == float("inf"))
    any_bad, all_banned = torch.stack([bad.any(), (bias == float("-inf")).all()]).tolist()
    if any_bad:
        index = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"bias: expected finite entries or -inf (banned tokens); got {float(bias[index])} "
            f"at index {index}"
        )
    if all_banned:
        raise ValueError("bias: expected at least one entry above -inf; every token is banned")


def logprob_inputs(hidden, weight, targets, bias, temperature_, ignore_index, vocab_size=None):
    """The primitive's inputs: hidden [..., H], weight [V, H], targets [...] integer, bias [V]
    or None (−inf entries allowed). `vocab_size` is the global V when weight holds one shard of
    the vocabulary."""
    tensor("hidden", hidden, floating=True)
    if hidden.dim() < 1:
        raise ValueError("hidden: expected shape [..., H]; got a 0-D tensor")
    H = hidden.shape[-1]
    tensor("weight", weight, shape=(None, H), floating=True)
    lm_head_sizes("", hidden, weight)
    head_dtypes("hidden", hidden, "weight", weight)
    tensor("targets", targets, shape=tuple(hidden.shape[:-1]))
    if targets.dtype not in INT_DTYPES:
        raise TypeError(f"targets: expected an integer (int64) tensor; got {targets.dtype}")
    V = weight.shape[0]
    if bias is not None:
        tensor("bias", bias, shape=(V,), floating=True)
    V = V if vocab_size is None else vocab_size
    temperature(temperature_)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index: expected an int; got {type(ignore_index).__name__}")
    same_device({"hidden": hidden, "weight": weight, "targets": targets, "bias": bias})
    bias_entries(bias)
    if targets.numel():
        bad = (targets != ignore_index) & ((targets < 0) | (targets >= V))
        if bool(bad.any()):
            first = int(targets[bad].reshape(-1)[0])
            raise ValueError(
                f"targets: expected ids in [0, {V}) or ignore_index={ignore_index}; got {first}"
            )


def loss_batch(logps, ref_logps, mask_, prefix: str = "") -> tuple[int, int]:
    """logps [B, T] floating; a 0/1 mask and ref_logps (if given: finite where the mask is set)
    of the same shape. Returns (B, T)."""
    tensor(f"{prefix}logps", logps, ndim=2, floating=True)
    B, T = logps.shape
    mask(f"{prefix}mask", mask_, (B, T))
    if ref_logps is not None:
        per_token_logps(f"{prefix}ref_logps", ref_logps, mask_)
    return B, T


def optional_per_token(arg: str, t, B: int, T: int, logps_of=None) -> None:
    """None or a floating [B, T]; `logps_of` (a mask): given log-probs, finite where it is set."""
    if t is not None:
        tensor(arg, t, shape=(B, T), floating=True)
        if logps_of is not None:
            finite(arg, t, logps_of)


def is_ratio(arg: str, t, B: int, T: int, per_token: bool = True) -> None:
    """A rollout-engine IS ratio: [B, T] (when `per_token`), [B, 1] or [B], floating."""
    if t is None:
        return
    tensor(arg, t, floating=True)
    shapes = ([(B, T)] if per_token else []) + [(B, 1), (B,)]
    if tuple(t.shape) not in shapes:
        want = " or ".join("[" + ", ".join(map(str, s)) + "]" for s in shapes)
        raise ValueError(f"{arg}: expected shape {want}; got {list(t.shape)}")


def advantages_or_rewards(
    advantages, rewards, num_generations_, B: int, need_rewards: bool, groups_of: int | None = None
):
    """f-GRPO's inputs: `advantages` [B], or `rewards` [B] with `num_generations` (normalised
    inside). Both are accepted only when rewards are needed besides (group_is_weights).
    `groups_of`: the number of rows the groups tile (default B; a data-parallel batch's
    global B)."""
    if advantages is not None:
        per_row("advantages", advantages, B)
    if rewards is not None:
        per_row("rewards", rewards, B)
    if advantages is None and rewards is None:
        raise ValueError(
            "advantages: expected exactly one of advantages [B] or rewards [B]; got neither"
        )
    if advantages is not None and rewards is not None and not need_rewards:
        raise ValueError("advantages: expected exactly one of advantages or rewards; got both")
    if need_rewards and rewards is None:
        raise ValueError("rewards: expected a [B] tensor when group_is_weights=True; got None")
    if rewards is not None or need_rewards:
        if num_generations_ is None:
            raise ValueError("num_generations: expected a positive int with rewards; got None")
        num_generations("num_generations", num_generations_, B if groups_of is None else groups_of)
    return advantages


def chosen(arg: str, c, B: int, pools=None) -> None:
    """A bool [B] mask of the chosen completions; both pools non-empty (counted over `pools` =
    (chosen, total) when given: a data-parallel batch's global counts)."""
    tensor(arg, c, shape=(B,), dtypes=(torch.bool,))
    n, B = (int(c.sum()), B) if pools is None else (int(pools[0]), int(pools[1]))
    if n == 0 or n == B:
        pool = "chosen" if n == 0 else "rejected"
        raise ValueError(
            f"{arg}: expected non-empty chosen and rejected pools; the {pool} pool is empty"
        )


def linear_batch(hidden, weight, ids, mask_, bias, *, prefix: str = "", vocab_size=None):
    """The fused modules' inputs: hidden [B, T, H], weight [V, H], ids [B, T] in [0, V) where
    the mask is set, mask [B, T], bias [V] | None. Returns (B, T, H, V). `vocab_size`: the
    global V when weight holds one shard of the vocabulary (ids are global)."""
    tensor(f"{prefix}hidden", hidden, ndim=3, floating=True)
    B, T, H = hidden.shape
    tensor("weight", weight, shape=(None, H), floating=True)
    lm_head_sizes(prefix, hidden, weight)
    head_dtypes(f"{prefix}hidden", hidden, "weight", weight)
    V = weight.shape[0]
    tensor(f"{prefix}completion_ids", ids, shape=(B, T))
    if ids.dtype not in INT_DTYPES:
        raise TypeError(f"{prefix}completion_ids: expected an integer tensor; got {ids.dtype}")
    mask(f"{prefix}completion_mask", mask_, (B, T))
    if bias is not None:
        tensor("bias", bias, shape=(V,), floating=True)
    same_device(
        {
            f"{prefix}hidden": hidden,
            "weight": weight,
            f"{prefix}completion_ids": ids,
            f"{prefix}completion_mask": mask_,
            "bias": bias,
        }
    )
    bias_entries(bias)
    V = V if vocab_size is None else vocab_size
    live = ids[mask_.bool()]
    if live.numel() and bool(((live < 0) | (live >= V)).any()):
        bad = int(live[(live < 0) | (live >= V)][0])
        raise ValueError(
            f"{prefix}completion_ids: expected ids in [0, {V}) where the mask is set; got {bad}"
        )
    return B, T, H, V


def positive_int(arg: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{arg}: expected a positive int; got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{arg}: expected a positive int; got {value}")
    return value


def byte_count(arg: str, value) -> int | None:
    """None (the default), or a number of bytes ≥ 0 (an int)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{arg}: expected None or an int number of bytes; got {type(value).__name__}"
        )
    if value < 0:
        raise ValueError(f"{arg}: expected a number of bytes >= 0; got {value}")
    return value
