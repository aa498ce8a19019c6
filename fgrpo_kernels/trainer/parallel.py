"""Data parallelism for the trainer: torchrun's ranks, the process group, DDP or FSDP2 around the
policy, and the few collectives a step needs.

A run of N ranks: every rank draws the same seeded prompts and keeps its own slice, samples
with its own seed, and computes the loss on its completions; DDP all-reduces the gradients
(FSDP2 reduce-scatters them), averaged over the ranks. The losses run inside one forward call
of the wrapped model (`forward`), where FSDP2 holds the full lm_head weight and around which
DDP's and FSDP2's hooks run. Metrics are reduced so that every rank holds the global ones
(rewards gathered, O(B); other scalars averaged); rank 0 alone writes the run folder.
"""

from __future__ import annotations

import inspect
import os
import types
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..backends import distributed
from . import hf


@dataclass(frozen=True)
class Launch:
    """What torchrun put in the environment: this process's rank, the world, its local rank."""

    rank: int
    world: int
    local_rank: int


def launch_env() -> Launch | None:
    """torchrun's RANK / WORLD_SIZE / LOCAL_RANK, or None when not launched by it."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return Launch(rank, world, int(os.environ.get("LOCAL_RANK", rank)))


def init(launch: Launch) -> bool:
    """Join torchrun's process group (gloo for CPU tensors, nccl for CUDA ones); False when one
    is already initialised (the caller's, which it keeps)."""
    if dist.is_initialized():
        return False
    # NB: torch.distributed.nn.functional's default arguments read group.WORLD when it is first
    # imported; torch._dynamo and torch.distributed.fsdp import it. Imported after init (by the
    # model's first forward, or by fully_shard) it would hold the default group past
    # destroy_process_group, and the group's threads would die at interpreter exit (SIGABRT).
    import torch._dynamo  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    if torch.cuda.is_available():
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=launch.rank, world_size=launch.world)
    else:
        dist.init_process_group("gloo", rank=launch.rank, world_size=launch.world)
    return True


def first_error(message: str | None) -> str | None:
    """The message of the lowest rank that has one (every rank gets the same answer): ranks
    agree to stop before any of them touches the run folder."""
    if not dist.is_initialized():
        return message
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, message)
    return next((m for m in every if m is not None), None)


def shutdown(owned: bool) -> bool:
    """Leave together (a rank tearing the group down while a peer still talks aborts the peer),
    then destroy the group if `init` made it. False when the group outlives that: its threads
    are still running (FSDP2 in torch 2.13 keeps a reference to the default group), and would
    be torn down at interpreter exit, which aborts the process now and then; the caller then
    leaves with `distributed.exit_now`."""
    if owned and dist.is_initialized():
        return not distributed.leave()
    return True


@dataclass(frozen=True)
class Ranks:
    """The trainer's view of the process group: rank, world size and how the policy is wrapped
    ("none" without a process group, "ddp", or "fsdp")."""

    rank: int = 0
    world: int = 1
    mode: str = "none"

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.mode != "none"

    def mine(self, items: list, n: int) -> list:
        """This rank's n of `items` (n per rank, drawn together by every rank)."""
        return items[self.rank * n : (self.rank + 1) * n]

    def gather(self, obj) -> list:
        """[obj of rank 0, obj of rank 1, ...] on every rank (pickled: small objects only)."""
        if not self.distributed:
            return [obj]
        every: list = [None] * self.world
        dist.all_gather_object(every, obj)
        return every

    def any(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on one."""
        if not self.distributed:
            return bool(flag)
        t = torch.tensor([int(bool(flag))], device=_collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def total(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of a scalar tensor over the ranks (a float64 on the CPU)."""
        if not self.distributed:
            return value.detach().to("cpu", torch.float64).reshape(())
        t = value.detach().to(_collective_device(), torch.float64).reshape(1)
        dist.all_reduce(t)
        return t[0].cpu()

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def _collective_device() -> torch.device:
    """Where small tensor collectives run: the CPU, unless the group has no CPU backend (a
    caller's nccl-only group), then this rank's GPU."""
    backend = str(dist.get_backend())
    if "gloo" in backend or "cpu" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def current(fsdp: bool) -> Ranks:
    """DDP (or FSDP2 with `fsdp`) when a torch.distributed process group is up, else none."""
    if not dist.is_available() or not dist.is_initialized():
        if fsdp:
            raise ValueError(
                "fsdp: FSDP2 needs a torch.distributed process group; launch with torchrun "
                "(torchrun --nproc-per-node N fgrpo train ... --fsdp)"
            )
        return Ranks()
    return Ranks(dist.get_rank(), dist.get_world_size(), "fsdp" if fsdp else "ddp")


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank `rank`'s random streams (sampling); rank 0 keeps the run's seed."""
    return seed + 1_000_003 * rank


# ----------------------------------------------------------------------------- wrapping


def _fgrpo_call(self, fn):
    return fn(self)


def shard(lm, device: torch.device) -> None:
    """FSDP2 in place: each decoder layer (the model's `_no_split_modules`) its own unit, the
    rest (embeddings, final norm, lm_head) the root's; `lm.fgrpo_call(fn)` = fn(lm) is
    registered as a forward method, so the loss runs with the root's parameters gathered
    (`hf.call_in_forward`). Rank 0's values are broadcast first, as DDP does: every rank
    keeps a slice of them (a LoRA adapter's random initial values would otherwise differ from
    rank to rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    with torch.no_grad():
        for t in [*lm.parameters(), *lm.buffers()]:
            dist.broadcast(t, src=0)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    blocks = set(getattr(lm, "_no_split_modules", None) or ())
    for module in list(lm.modules())[1:]:
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(lm, mesh=mesh)
    lm.fgrpo_call = types.MethodType(_fgrpo_call, lm)
    register_fsdp_forward_method(lm, "fgrpo_call")


class _Call(torch.nn.Module):
    """The module DDP wraps: forward(fn) = fn(the causal LM), so that DDP's forward (which
    prepares the gradient all-reduce) runs around the loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, fn):
        return fn(hf.causal_lm(self.model))


def wrap(model, ranks: Ranks):
    """What the training forward goes through (`forward`): DDP around the model, the causal LM
    sharded in place by FSDP2 (the root is the causal LM, not a PeftModel around it: generate()
    calls the causal LM), or the causal LM itself."""
    lm = hf.causal_lm(model)
    device = next(lm.parameters()).device
    if ranks.mode == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        # no buffer broadcast per forward: rotary tables and the like are constants
        quiet = "forward_sync_buffers"  # newer torch's name; broadcast_buffers warns there
        known = inspect.signature(DistributedDataParallel).parameters
        sync = {quiet if quiet in known else "broadcast_buffers": False}
        return DistributedDataParallel(_Call(model), device_ids=ids, **sync)
    if ranks.mode == "fsdp":
        shard(lm, device)
    return lm


def forward(wrapped, fn):
    """fn(lm) inside one forward of `wrap`'s result."""
    if isinstance(wrapped, DistributedDataParallel):
        return wrapped(fn)
    return hf.call_in_forward(wrapped, fn)


@contextmanager
def gradient_sync(wrapped, ranks: Ranks, enabled: bool):
    """Micro-batches before the last of an update accumulate locally; the last one's backward
    all-reduces (reduce-scatters) the sum."""
    if enabled or not ranks.distributed:
        yield
    elif ranks.mode == "ddp":
        with wrapped.no_sync():
            yield
    else:
        wrapped.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            wrapped.set_requires_gradient_sync(True)


def as_float(value) -> float:
    """A scalar tensor (a DTensor's full value) as a Python float."""
    from ..backends.distributed import is_dtensor

    return float(value.full_tensor() if is_dtensor(value) else value)


# ----------------------------------------------------------------------------- checkpoints


def reshard(model, ranks: Ranks) -> None:
    """FSDP2: put the sharded parameters back in place. A forward without gradient leaves the
    root's unsharded until the next backward, and the state-dict functions need the sharded
    ones registered."""
    if ranks.mode != "fsdp":
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _full_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def model_state(model, ranks: Ranks) -> dict | None:
    """FSDP2: the full state dict on rank 0 ({} elsewhere; every rank must call); otherwise
    None (save_pretrained reads the model's own)."""
    if ranks.mode != "fsdp":
        return None
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_full_options())


def optimizer_state(model, optimizer, ranks: Ranks) -> dict:
    """The optimizer's state to checkpoint: FSDP2's full (unsharded) state keyed by parameter
    name, gathered on rank 0 (every rank must call); otherwise `optimizer.state_dict()`, the
    same on every rank under DDP."""
    if ranks.mode != "fsdp":
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_full_options())


def load_optimizer_state(model, optimizer, state: dict, ranks: Ranks) -> None:
    if ranks.mode != "fsdp":
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=options)
