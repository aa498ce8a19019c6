"""The Triton loss epilogue: `fgrpo`, `grpo`, `gift` (FDO maps onto `fgrpo` in the caller).

Each returns (loss 0-d fp32, dL/dlogps [B, T] fp32) with the semantics of the option-taking
function of the same name in `fgrpo_kernels.reference` (which `fgrpo_kernels.losses.epilogue` calls
off the Triton path): one launch per loss, one program per group (or per block of rows), two
passes over T (row sums, then dL/dlogp).

`AOT_SPECS` lists one ahead-of-time compile configuration per shipped kernel variant
({"name", "fn", "signature", "constexprs", "num_warps"}; constexprs are plain values or the
divergence twins, which are `triton.JITFunction`s); tests/test_epilogue_compile.py
compiles each for sm_90 so that code the interpreter accepts but the compiler rejects fails CI.
"""

from __future__ import annotations

from ...core.divergences import TABLE, Divergence
from ...core.grpo_math import POLICY_TERMS
from ...core.options import Objective
from .epilogue_common import num_warps
from .epilogue_fgrpo import _fgrpo_epilogue_kernel, fgrpo
from .epilogue_gift import _gift_epilogue_kernel, gift
from .epilogue_grpo import _grpo_epilogue_kernel, grpo
from .tl_divergences import phi_constexprs

__all__ = ["AOT_SPECS", "fgrpo", "gift", "grpo"]

_TYPES = {
    "mask_ptr": "*i1",
    "B": "i32",
    "T": "i32",
    "ROWS": "i32",
    "beta": "fp32",
    "eps": "fp32",
    "var_dof": "fp32",
    "inv_batch": "fp32",
    "clip_low": "fp32",
    "clip_high": "fp32",
    "delta": "fp32",
    "clip_c": "fp32",
    "tau_pos": "fp32",
    "tau_neg": "fp32",
}
# A long-row tile (one row, 4096 tokens) and a group tile (8 completions × 512 tokens).
_ROW_TILE = {"BLOCK_G": 1, "BLOCK_T": 4096}
_GROUP_TILE = {"BLOCK_G": 8, "BLOCK_T": 512}


def _spec(name: str, fn, constexprs: dict, ref_dtype: str = "*fp32") -> dict:
    """Every non-constexpr argument typed: pointers *fp32 (ref/old as `ref_dtype`, the mask
    bool), ints i32, floats fp32; None pointers are constexpr None."""
    signature = {}
    for arg in fn.arg_names:
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg in ("ref_ptr", "old_ptr", "ratio_ptr"):
            signature[arg] = ref_dtype
        else:
            signature[arg] = _TYPES.get(arg, "*fp32")
    return {
        "name": name,
        "fn": fn,
        "signature": signature,
        "constexprs": dict(constexprs),
        "num_warps": num_warps(constexprs["BLOCK_G"], constexprs["BLOCK_T"]),
    }


def _fgrpo_spec(name, divergence, sequence, tile, **flags):
    constexprs = {
        **phi_constexprs(divergence),
        "SEQUENCE_LEVEL": sequence,
        "ROW_MEAN": False,
        "HAS_ADVANTAGES": True,
        "SCALE": 0,
        "HAS_IS_WEIGHTS": False,
        "RATIO": 0,
        **tile,
    }
    constexprs.update(flags)
    if not constexprs["RATIO"]:
        constexprs["ratio_ptr"] = None
    if constexprs["HAS_ADVANTAGES"] and not constexprs["HAS_IS_WEIGHTS"]:
        constexprs["rewards_ptr"] = None
    if not constexprs["HAS_IS_WEIGHTS"]:
        constexprs["old_ptr"] = None
    if constexprs["HAS_ADVANTAGES"]:
        constexprs["SCALE"] = 0
    if constexprs["HAS_ADVANTAGES"] or constexprs["SCALE"] != 1:
        constexprs["sigma_ptr"] = None
    if not constexprs["HAS_ADVANTAGES"]:
        constexprs["adv_ptr"] = None
    return _spec(name, _fgrpo_epilogue_kernel, constexprs)


_GRPO_FLAGS = ("HAS_OLD", "HAS_KL", "BIAS_CORRECTION", "HAS_ROW_WEIGHT", "HAS_TOKEN_WEIGHT")
_GRPO_POINTERS = {"HAS_OLD": "old_ptr", "HAS_KL": "ref_ptr", "HAS_ROW_WEIGHT": "row_w_ptr",
                  "HAS_TOKEN_WEIGHT": "tok_w_ptr"}  # fmt: skip


def _grpo_spec(name, objective: Objective, sequence: bool, flags: set[str], tile):
    constexprs = {"OBJECTIVE": POLICY_TERMS[objective].triton_id, "SEQUENCE_LEVEL": sequence,
                  **tile}  # fmt: skip
    for flag in _GRPO_FLAGS:
        constexprs[flag] = flag in flags
        if flag in _GRPO_POINTERS and flag not in flags:
            constexprs[_GRPO_POINTERS[flag]] = None
    return _spec(name, _grpo_epilogue_kernel, constexprs, "*bf16")


# (name, sequence level, tile, flags) of the f-GRPO variants beyond divergence × level.
_FGRPO_VARIANTS = [
    ("token_seq_mean", False, _ROW_TILE, {"ROW_MEAN": True}),
    ("rewards_group", False, _GROUP_TILE, {"HAS_ADVANTAGES": False}),
    ("rewards_batch", True, _GROUP_TILE, {"HAS_ADVANTAGES": False, "SCALE": 1}),
    ("rewards_none", False, _GROUP_TILE, {"HAS_ADVANTAGES": False, "SCALE": 2}),
    ("is_weights_token", False, _GROUP_TILE, {"HAS_IS_WEIGHTS": True, "ROW_MEAN": True}),
    ("is_weights_sequence", True, _GROUP_TILE, {"HAS_IS_WEIGHTS": True, "HAS_ADVANTAGES": False}),
    ("ratio_token", False, _ROW_TILE, {"RATIO": 2}),
    ("ratio_sequence", True, _ROW_TILE, {"RATIO": 1}),
]
# Every objective at token level plain and with every option on; the sequence level (clipped
# family only) likewise, plus on-policy variants without old log-probs or KL.
_EVERY = set(_GRPO_FLAGS)
_GRPO_VARIANTS = [
    ("sequence", Objective.CLIPPED, True, {"HAS_OLD", "HAS_KL"}),
    ("sequence_all", Objective.CLIPPED, True, _EVERY),
    ("sequence_on_policy", Objective.CLIPPED, True, {"HAS_KL"}),
    ("token_on_policy_no_kl", Objective.CLIPPED, False, set()),
]


def _aot_specs() -> list[dict]:
    specs = []
    for div in Divergence:
        for sequence, level in ((False, "token"), (True, "sequence")):
            name = f"fgrpo_{TABLE[div].name}_{level}"
            specs.append(_fgrpo_spec(name, div, sequence, _ROW_TILE))
    for name, sequence, tile, flags in _FGRPO_VARIANTS:
        specs.append(_fgrpo_spec(f"fgrpo_{name}", Divergence.PEARSON, sequence, tile, **flags))
    for objective in Objective:
        label = objective.name.lower()
        specs.append(_grpo_spec(f"grpo_{label}_token", objective, False, {"HAS_OLD", "HAS_KL"},
                                _ROW_TILE))  # fmt: skip
        specs.append(_grpo_spec(f"grpo_{label}_token_all", objective, False, _EVERY, _ROW_TILE))
    for name, objective, sequence, flags in _GRPO_VARIANTS:
        specs.append(_grpo_spec(f"grpo_{name}", objective, sequence, flags, _ROW_TILE))
    for detach in (False, True):
        constexprs = {"DETACH_STATS": detach, **_GROUP_TILE}
        specs.append(_spec(f"gift_detach_{str(detach).lower()}", _gift_epilogue_kernel, constexprs))
    return specs


AOT_SPECS: list[dict] = _aot_specs()
