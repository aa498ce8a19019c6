"""Run a function on several CPU ranks (gloo) from inside a test, with a free port and a timeout.

    run_ranks(fn, 2, *args)   # fn(rank, world, *args) in each spawned process

The children inherit the environment (TRITON_INTERPRET, FGRPO_BACKEND, ...), initialise the
default process group and call `fn`; an exception in any rank fails the test with that rank's
traceback, a hang fails it after `timeout` seconds.
"""

from __future__ import annotations

import os
import socket
import time
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world, port, fn, args, errors):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        fn(rank, world, *args)
        # NB: leave together; a rank tearing gloo down while its peer still talks aborts the
        # peer (SIGABRT from gloo's I/O thread)
        dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent
        errors.put((time.monotonic(), rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 240.0) -> None:
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, world, port, fn, args, errors), daemon=True)
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
