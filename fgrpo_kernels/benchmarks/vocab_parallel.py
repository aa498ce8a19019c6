"""The `vocab-parallel` workload: the fused GRPO loss (dapo, fwd+bwd) with the lm_head split over
the vocabulary on 1 or 2 CPU ranks (gloo), each rank one thread.

Impls `ours_1rank` and `ours_2ranks` run the same code (`FusedLinearGRPOLoss` with
`VocabParallel`) on every rank's shard of the case's workload (rank 0 holds ⌊V/2⌋ rows). The
bench child spawns the ranks; each measures its own peak memory beyond its inputs (`PeakRSS`,
reset after a warm-up on the first T/8 tokens) and times its runs between barriers. The row
reports the slowest rank's median time, the largest rank's peak, the loss (the same on every
rank and for both impls) and, in its note, the bytes each rank sent into collectives per call.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

IMPLS = {"ours_1rank": 1, "ours_2ranks": 2}


def _shard(V: int, rank: int, world: int) -> tuple[int, int]:
    cuts = [round(V * r / world) for r in range(world + 1)]
    cuts[1:-1] = [V // 2] if world == 2 else cuts[1:-1]
    return cuts[rank], cuts[rank + 1]


def _rank(rank: int, world: int, port: int, case, queue) -> None:
    import torch.distributed as dist

    import fgrpo_kernels as fk
    from fgrpo_kernels.backends import distributed

    from .process_memory import PeakRSS
    from .workload import EPS, GRPO_BETA, Workload

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        w = Workload.make(case)
        lo, hi = _shard(case.vocab, rank, world)
        weight = w.weight.detach()[lo:hi].clone().requires_grad_(True)
        w.weight = weight  # this rank's shard (the whole lm_head freed)
        small = w.prefix()  # the first T/8 tokens of every completion, the same shard
        w.hidden = w.hidden.detach().clone().requires_grad_(True)
        loss_fn = fk.FusedLinearGRPOLoss(
            "dapo", GRPO_BETA, EPS, EPS, vocab_parallel=fk.VocabParallel()
        )

        def step(x) -> float:
            loss, _ = loss_fn(x.hidden, weight, x.ids, x.mask, x.advantages,
                              ref_per_token_logps=x.ref_logps)  # fmt: skip
            loss.backward()
            x.hidden.grad = weight.grad = None
            return float(loss.detach())

        # NB: the warm-up (layout resolved, code paths taken) runs on the small prefix, so that
        # the full-size buffers are first allocated after the reset below and count in the peak
        # (freed memory stays resident: a full-size warm-up would hide them)
        step(small)
        del small
        distributed.comm_bytes(reset=True)
        rss = PeakRSS()
        times, policy = [], case.policy
        for _ in range(max(policy.repeats, 1)):
            dist.barrier()
            t0 = time.perf_counter()
            loss = step(w)
            times.append(time.perf_counter() - t0)
            if sum(times) >= policy.min_time_s:
                break
        sent = sum(distributed.comm_bytes().values()) // len(times)
        queue.put((rank, statistics.median(times), rss.extra(), loss, sent, len(times)))
        dist.barrier()
    except BaseException as e:  # noqa: BLE001 - reported as the case's error row
        queue.put((rank, None, None, None, None, f"{type(e).__name__}: {e}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def measure(case) -> dict:
    """Spawn the case's ranks and combine what they measured (values for `measure.row`)."""
    import socket

    import torch.multiprocessing as mp

    world = IMPLS[case.impl]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, case, queue)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(case.policy.timeout_s)
    for p in procs:
        if p.is_alive():
            p.kill()
    results = []
    while not queue.empty():
        results.append(queue.get())
    errors = [r[5] for r in results if r[1] is None]
    if errors or len(results) != world:
        raise RuntimeError(errors[0] if errors else f"{world - len(results)} ranks gave no result")
    sent = [r[4] for r in results]
    return {
        "time_ms": 1e3 * max(r[1] for r in results),
        "peak_mem_mib": max(r[2] for r in results) / 2**20,
        "checksum": results[0][3],
        "repeats": min(r[5] for r in results),
        "note": f"{world} rank(s), 1 thread each; bytes sent into collectives per call and "
        f"rank: {max(sent)}",
    }
