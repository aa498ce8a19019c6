"""Run a function on several CPU ranks (gloo) from inside a test, with a free port and a timeout.

    run_ranks(fn, 2, *args)   # fn(rank, world, *args) in each spawned process

The children inherit the environment (TRITON_INTERPRET, FGRPO_BACKEND, ...), initialise the
default process group and call `fn`; an exception in any rank fails the test with that rank's
traceback, a hang fails it after `timeout` seconds.

After destroy_process_group each rank checks that the group is gone: no gloo or TCPStore thread
left (`fgrpo_kernels.backends.distributed.leave`). A group that something still holds outlives
destroy_process_group and is torn down at interpreter exit, where its threads abort the process
now and then (SIGABRT, "terminate called without an active exception"; a CI run failed so).
The check turns that into a named, deterministic failure. FSDP2 in torch 2.13 holds the default
group itself: `torch_holds_group=True` skips the check and leaves with os._exit(0) instead, as
`fgrpo train` does.
"""

from __future__ import annotations

import gc
import os
import socket
import time
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world, port, fn, args, errors, torch_holds_group):
    import torch
    import torch.distributed as dist

    from fgrpo_kernels.backends.distributed import exit_now, leave

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        fn(rank, world, *args)
        gc.collect()  # what fn left in reference cycles lets go of the group
        left = leave()
        assert torch_holds_group or not left, (
            f"the process group outlived destroy_process_group (threads {left}): something "
            "still holds it"
        )
    except BaseException:  # noqa: BLE001 - reported to the parent
        errors.put((time.monotonic(), rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if torch_holds_group:
        exit_now(0)


def run_ranks(
    fn, world: int, *args, timeout: float = 240.0, torch_holds_group: bool = False
) -> None:
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child, args=(r, world, port, fn, args, errors, torch_holds_group), daemon=True
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    reports = []
    while not errors.empty():
        reports.append(errors.get())
    if reports:
        _, rank, tb = sorted(reports)[0]  # the first to fail (its peers fail after it)
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout} s")
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks exited with codes {bad}")


__all__ = ["free_port", "run_ranks"]
