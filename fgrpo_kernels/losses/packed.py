"""Packed (THD) sequences for every fused loss: hidden [N, H], ids [N] and the sequence
boundaries `cu_seqlens` [B + 1] (TRL's padding-free batches, verl's remove-padding), instead of
the padded [B, T] call.

`PackedLoss(loss)(...)` takes the wrapped module's own arguments, with every per-token one
packed ([N] or [N, H]) and `cu_seqlens` (and `pref_cu_seqlens` for f-HAL's preference batch)
as keywords. It lays them out as [B, T_max] (masked past each sequence's end), calls the module,
and returns what the module returns, a returned entropy packed back to [N]. The values and
gradients are those of the padded call, since the padded positions are masked out. The cost:
one [B, T_max, H] copy of the hidden states, and one of their gradient; no [N, V] ever.

Per-token arguments, by name: hidden, ref_hidden, completion_ids, completion_mask (None: every
token counts), the *_per_token_logps, clip_cov_keep, and vllm_is_ratio when it is [N] (a
per-sequence ratio stays [B] or [B, 1]); their pref_* twins go with pref_cu_seqlens. Any other
argument (advantages, rewards, chosen, the weight, ...) passes through unchanged.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ..core import validation as check

TOKENS = ("hidden", "ref_hidden", "completion_ids", "completion_mask", "clip_cov_keep")
MASK = "completion_mask"


@dataclass(frozen=True)
class Layout:
    """Where each packed token sits in the padded [B, T] batch."""

    B: int
    T: int
    rows: torch.Tensor  # [N]
    cols: torch.Tensor  # [N]

    @classmethod
    def of(cls, cu_seqlens, arg: str = "cu_seqlens") -> Layout:
        check.tensor(arg, cu_seqlens, ndim=1)
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
            raise TypeError(f"{arg}: expected an integer tensor; got {cu_seqlens.dtype}")
        if cu_seqlens.numel() < 1 or int(cu_seqlens[0]) != 0:
            raise ValueError(f"{arg}: expected [0, end_1, ..., end_B] (starting at 0)")
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        if bool((lengths < 0).any()):
            raise ValueError(
                f"{arg}: expected non-decreasing boundaries; got {cu_seqlens.tolist()}"
            )
        B, N = lengths.numel(), int(cu_seqlens[-1])
        T = int(lengths.max()) if B else 0
        device = cu_seqlens.device
        rows = torch.repeat_interleave(torch.arange(B, device=device), lengths)
        cols = torch.arange(N, device=device) - cu_seqlens[:-1].repeat_interleave(lengths)
        return cls(B, T, rows, cols)

    @property
    def N(self) -> int:
        return self.rows.numel()

    def pad(self, arg: str, x: torch.Tensor, fill=0) -> torch.Tensor:
        """[N, ...] → [B, T, ...], `fill` past each end (differentiable in x)."""
        if x.shape[:1] != (self.N,):
            raise ValueError(
                f"{arg}: expected {self.N} packed tokens in dim 0 (cu_seqlens[-1]); got shape "
                f"{list(x.shape)}"
            )
        out = x.new_full((self.B, self.T, *x.shape[1:]), fill)
        return out.index_put((self.rows, self.cols), x)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] → [N, ...]."""
        return x[self.rows, self.cols]


def _per_token(name: str, value, layout: Layout) -> bool:
    base = name.removeprefix("pref_")
    if not isinstance(value, torch.Tensor):
        return False
    if base in TOKENS or base.endswith("_per_token_logps"):
        return True
    return base == "vllm_is_ratio" and value.dim() == 1 and value.shape[0] == layout.N


class PackedLoss(torch.nn.Module):
    """A fused loss module called on packed sequences (see the module docstring)."""

    def __init__(self, loss: torch.nn.Module):
        super().__init__()
        if not isinstance(loss, torch.nn.Module):
            raise TypeError(f"loss: expected a fused loss module; got {type(loss).__name__}")
        self.loss = loss
        self._signature = inspect.signature(loss.forward)

    def forward(self, *args, cu_seqlens, pref_cu_seqlens=None, **kwargs):
        bound = self._signature.bind(*args, **kwargs)
        layouts = {"": Layout.of(cu_seqlens)}
        if pref_cu_seqlens is not None:
            layouts["pref_"] = Layout.of(pref_cu_seqlens, "pref_cu_seqlens")
        named = {}
        for name, value in bound.arguments.items():  # **inputs (a variant's) spread out
            kind = self._signature.parameters[name].kind
            named.update(value if kind == inspect.Parameter.VAR_KEYWORD else {name: value})
        for prefix, layout in layouts.items():
            if prefix + MASK in self._signature.parameters and named.get(prefix + MASK) is None:
                named[prefix + MASK] = torch.ones(layout.N, device=layout.rows.device)
        for name, value in list(named.items()):
            prefix = "pref_" if name.startswith("pref_") else ""
            if not _per_token(name, value, layouts.get(prefix, layouts[""])):
                continue
            if prefix not in layouts:
                raise ValueError(f"pref_cu_seqlens: needed to unpack {name}; got None")
            fill = 1.0 if name.endswith("vllm_is_ratio") else 0  # a neutral ratio past the end
            named[name] = layouts[prefix].pad(name, value, fill)
        out = self.loss(**named)
        if isinstance(out, tuple) and len(out) == 3:  # (loss, metrics, entropy [B, T])
            return out[0], out[1], layouts[""].unpad(out[2])
        return out
