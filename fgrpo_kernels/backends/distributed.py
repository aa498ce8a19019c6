"""torch.distributed support: the vocabulary split over ranks, DTensor lm_heads, global counts.

Vocab-parallel log-probs (docs/math.md §7): rank r holds rows [start_r, start_r + V_r) of the
lm_head. Each rank runs the ordinary kernels on its shard, with the targets it does not own
replaced by a sentinel that matches no column, and returns per-row (logp_r, lse_r, H_r) of its
local softmax. The global values follow from O(N) all-reduces, in fp32:

    lse = M + log Σ_r e^(lse_r − M),  M = max_r lse_r
    logp = logp_o + lse_o − lse                      (o: the rank that owns the target)
    H = Σ_r w_r·(H_r + lse − lse_r),  w_r = e^(lse_r − lse)

Backward needs no communication beyond dhidden: with the global lse and H saved, each rank's
kernel produces the exact dlogits of its columns (no one-hot where it does not own the
target), hence its rows of dweight/dbias and a partial dhidden that is summed over the group.
"""

from __future__ import annotations

import os
import sys
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Bytes moved by this module's collectives in this process, by collective (see `comm_bytes`).
_COMM: dict[str, int] = {}
# Resolved layouts {(vocab_start, V_r): (start, V)} per process group, weakly keyed: the cache
# never keeps a group alive past destroy_process_group (its gloo threads would then die at
# interpreter exit, sometimes with SIGABRT), and a re-initialised default group starts afresh.
_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class VocabParallel:
    """The lm_head is split over the vocabulary across the ranks of `group` (default: the world).

    Each rank passes its contiguous shard weight[V_r, H] (and bias[V_r]); `vocab_start` is the
    shard's first token id (None: the prefix sum of the ranks' V_r in rank order, found by one
    all-gather). Hidden states, targets (global ids) and masks are the same on every rank, and so
    are the results. dweight/dbias are the local shard's rows; dhidden is summed over the group
    unless `reduce_hidden_grad=False` (each rank then returns its partial sum, for callers whose
    own sequence-parallel gather reduces it).
    """

    group: object = None
    vocab_start: int | None = None
    reduce_hidden_grad: bool = True


@dataclass(frozen=True)
class Shard:
    """A resolved `VocabParallel`: this rank's [start, start + size) of a vocabulary of `total`."""

    group: object
    start: int
    size: int
    total: int
    reduce_hidden_grad: bool


def _record(name: str, t: torch.Tensor) -> None:
    _COMM[name] = _COMM.get(name, 0) + t.numel() * t.element_size()


def comm_bytes(reset: bool = False) -> dict[str, int]:
    """Bytes this process has sent into each kind of collective through this module (the payload
    of its own tensor, not the transport's overhead); `reset` clears the counters."""
    out = dict(_COMM)
    if reset:
        _COMM.clear()
    return out


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    _record("all_reduce", t)
    dist.all_reduce(t, op=op, group=group)
    return t


def resolve(vp: VocabParallel, local_vocab: int, device: torch.device) -> Shard:
    """Check that the ranks' shards tile [0, V) and return this rank's. Cached per (group,
    vocab_start, V_r): the all-gather runs once for a given layout."""
    if not isinstance(vp, VocabParallel):
        raise TypeError(f"vocab_parallel: expected a VocabParallel; got {type(vp).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "vocab_parallel: expected an initialised torch.distributed process group "
            "(torch.distributed.init_process_group); got none"
        )
    if vp.vocab_start is not None and (
        isinstance(vp.vocab_start, bool) or not isinstance(vp.vocab_start, int)
        or vp.vocab_start < 0
    ):  # fmt: skip
        raise ValueError(
            f"vocab_parallel: expected vocab_start an int >= 0; got {vp.vocab_start!r}"
        )
    layouts = _LAYOUTS.setdefault(dist.group.WORLD if vp.group is None else vp.group, {})
    key = (vp.vocab_start, local_vocab)
    if key not in layouts:
        layouts[key] = _layout(vp, local_vocab, device)
    start, total = layouts[key]
    return Shard(vp.group, start, local_vocab, total, bool(vp.reduce_hidden_grad))


def _layout(vp: VocabParallel, local_vocab: int, device: torch.device) -> tuple[int, int]:
    """(this rank's vocab_start, the global V), from one all-gather of every rank's
    (vocab_start, V_r); the shards must tile [0, V)."""
    world = dist.get_world_size(vp.group)
    start = -1 if vp.vocab_start is None else vp.vocab_start
    mine = torch.tensor([start, local_vocab], dtype=torch.int64, device=device)
    every = torch.empty(world * 2, dtype=torch.int64, device=device)
    _record("all_gather", mine)
    dist.all_gather_into_tensor(every, mine, group=vp.group)
    starts, sizes = every[0::2].tolist(), every[1::2].tolist()
    if all(s < 0 for s in starts):
        starts = [sum(sizes[:r]) for r in range(world)]
    elif any(s < 0 for s in starts):
        raise ValueError(
            "vocab_parallel: expected vocab_start on every rank or on none; got "
            f"{['None' if s < 0 else s for s in starts]}"
        )
    spans = sorted(zip(starts, sizes))
    edge = 0
    for s, n in spans:
        if s != edge:
            raise ValueError(
                "vocab_parallel: expected the ranks' shards [vocab_start, vocab_start + V_r) to "
                f"tile [0, V) without gaps or overlaps; got {sorted(zip(starts, sizes))}"
            )
        edge = s + n
    return starts[dist.get_rank(vp.group)], edge


def owned_targets(targets: torch.Tensor, shard: Shard, ignore_index: int) -> torch.Tensor:
    """Which rows' (global) targets lie in this rank's shard."""
    local = targets - shard.start
    return (targets != ignore_index) & (local >= 0) & (local < shard.size)


def local_targets(targets: torch.Tensor, opts, vocab: int) -> torch.Tensor:
    """Global ids → ids of the rows [opts.vocab_start, + vocab) the kernels hold; ids owned by
    another shard become a sentinel that matches no column and is not `ignore_index` (the row
    still gets its lse, entropy and −p gradient). The identity off vocabulary parallelism."""
    if opts.vocab_total is None:
        return targets
    ignore = opts.ignore_index
    local = targets - opts.vocab_start
    valid = targets != ignore
    sentinel = -1 if ignore != -1 else -2
    owned = valid & (local >= 0) & (local < vocab)
    return torch.where(owned, local, torch.where(valid, sentinel, ignore))


def combine(logp, lse, entropy, owned, valid, shard: Shard):
    """Per-row local (logp, lse, entropy | None) of each shard → the global ones (three O(N)
    fp32 all-reduces; two without entropy)."""
    group = shard.group
    top = all_reduce(lse.clone(), dist.ReduceOp.MAX, group)
    top = torch.where(torch.isfinite(top), top, 0.0)
    total = all_reduce(torch.exp(lse - top), group=group)
    glse = top + torch.log(total)
    rows = torch.stack([torch.where(owned, logp + lse - glse, 0.0)])
    if entropy is not None:
        w = torch.exp(lse - glse)
        term = torch.where(w > 0, w * (entropy + glse - lse), 0.0)
        rows = torch.cat([rows, term[None]])
    rows = all_reduce(rows, group=group)
    logp_g = torch.where(valid, rows[0], 0.0)
    ent_g = None if entropy is None else torch.where(valid, rows[1], 0.0)
    return logp_g, glse, ent_g


def reduce_hidden_grad(dh: torch.Tensor | None, shard: Shard) -> torch.Tensor | None:
    if dh is None or not shard.reduce_hidden_grad:
        return dh
    return all_reduce(dh, group=shard.group)


# ----------------------------------------------------------------------------- DTensor


class _GatherRows(torch.autograd.Function):
    """Local rows [V_r, ...] → the full tensor [V, ...] on every rank; backward hands each rank
    its rows of the gradient averaged over the ranks (FSDP's reduce-scatter)."""

    @staticmethod
    def forward(ctx, local, full_shape, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        world = len(sizes)
        width = max(sizes)
        padded = local.new_zeros((width, *local.shape[1:]))
        padded[: local.shape[0]] = local
        out = local.new_empty((world * width, *local.shape[1:]))
        _record("all_gather", padded)
        dist.all_gather_into_tensor(out, padded.contiguous(), group=group)
        pieces = [out[r * width : r * width + n] for r, n in enumerate(sizes)]
        return torch.cat(pieces).reshape(full_shape)

    @staticmethod
    def backward(ctx, grad):
        sizes, world = ctx.sizes, len(ctx.sizes)
        width = max(sizes)
        padded = grad.new_zeros((world * width, *grad.shape[1:]))
        offset = 0
        for r, n in enumerate(sizes):
            padded[r * width : r * width + n] = grad[offset : offset + n]
            offset += n
        out = grad.new_empty((width, *grad.shape[1:]))
        _record("reduce_scatter", padded)
        dist.reduce_scatter_tensor(out, padded.contiguous(), op=dist.ReduceOp.AVG, group=ctx.group)
        return out[: sizes[dist.get_rank(ctx.group)]], None, None, None


def is_dtensor(t) -> bool:
    # NB: no DTensor exists before torch.distributed.tensor is imported, and importing it here
    # would load sympy and torch.fx into every process on its first fused call (~70 MiB)
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def gather_dtensor(t, arg: str) -> torch.Tensor:
    """A DTensor sharded along dim 0 over a 1-D mesh (FSDP2's `fully_shard` parameters) as the
    full plain tensor, differentiably: its gradient arrives as the sharded DTensor gradient,
    averaged over the mesh as FSDP does."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = t.device_mesh, tuple(t.placements)
    if all(isinstance(p, Replicate) for p in placements):
        return t.to_local()
    if mesh.ndim != 1 or not (isinstance(placements[0], Shard) and placements[0].dim == 0):
        raise ValueError(
            f"{arg}: expected a DTensor sharded along dim 0 over a 1-D mesh (FSDP2) or "
            f"replicated; got placements {placements} on a {mesh.ndim}-D mesh"
        )
    group = mesh.get_group()
    local = t.to_local()
    size = torch.tensor([local.shape[0]], dtype=torch.int64, device=local.device)
    sizes = torch.empty(mesh.size(), dtype=torch.int64, device=local.device)
    dist.all_gather_into_tensor(sizes, size, group=group)
    return _GatherRows.apply(local, tuple(t.shape), group, tuple(sizes.tolist()))


# ----------------------------------------------------------------------------- data parallel


def check_group(group, arg: str = "process_group"):
    """A process group of an initialised torch.distributed (or None: no data parallelism)."""
    if group is None:
        return None
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"{arg}: expected a process group of an initialised torch.distributed; got {group!r} "
            "without init_process_group"
        )
    return group


def global_sum(values, group) -> torch.Tensor:
    """Σ over the group's ranks of a few numbers (float64, one all-reduce)."""
    t = torch.as_tensor(values, dtype=torch.float64).reshape(-1).clone()
    return all_reduce(t, group=group)


def gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's x [B, ...] stacked in rank order: [world·B, ...] (every rank's B equal)."""
    world = dist.get_world_size(group)
    total = int(global_sum([x.shape[0]], group)[0])
    if total != world * x.shape[0]:
        raise ValueError(
            "process_group: expected the same number of completions on every rank; got "
            f"{x.shape[0]} here and {total} in all over {world} ranks"
        )
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    _record("all_gather", x)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def gather_values(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's 1-D x (of any length) concatenated: an all-gather of the lengths, then of
    the values padded to the longest."""
    world = dist.get_world_size(group)
    n = torch.tensor([x.numel()], dtype=torch.int64, device=x.device)
    lengths = torch.empty(world, dtype=torch.int64, device=x.device)
    dist.all_gather_into_tensor(lengths, n, group=group)
    width = int(lengths.max())
    padded = x.new_zeros(max(width, 1))
    padded[: x.numel()] = x.reshape(-1)
    out = x.new_empty(world * padded.numel())
    _record("all_gather", padded)
    dist.all_gather_into_tensor(out, padded, group=group)
    pieces = out.view(world, -1)
    return torch.cat([pieces[r, : int(k)] for r, k in enumerate(lengths.tolist())])


# ----------------------------------------------------------------------------- teardown


def leave() -> list[str]:
    """Leave together (a rank tearing gloo down while a peer still talks aborts the peer) and
    destroy the default process group. Returns the group's threads still running after that
    (`group_threads`): non-empty when something still holds the group (FSDP2 in torch 2.13
    does), and the process should then end with `exit_now` before the interpreter's teardown
    meets them."""
    dist.barrier()
    dist.destroy_process_group()
    return group_threads()


def exit_now(code: int) -> None:
    """End the process with `code` past the interpreter's teardown (stdout/stderr flushed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def group_threads() -> list[str]:
    """This process's threads of a process group (gloo, TCPStore), by name; [] where /proc
    does not say. Left after destroy_process_group, they mean something still holds the group:
    they are then torn down at interpreter exit, which aborts the process now and then."""
    names = []
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return sorted(n for n in names if "gloo" in n or "tcpstore" in n)
