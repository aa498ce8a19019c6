"""What a checkpoint holds besides the weights, writing one, and where a session's random
streams start: seeded afresh (each rank its own) or restored from the checkpoint.

Under torch.distributed every rank calls these (they gather every rank's random streams and,
with FSDP2, the full weights and optimizer state); rank 0 alone writes the run folder.
"""

from __future__ import annotations

import sys
from pathlib import Path

from . import evaluation, parallel, rng, run_dir


def state_dict(trainer) -> dict:
    """Step, optimizer (FSDP2: the full state, on rank 0), scheduler, the random streams
    (`rng`: this rank's; `rng_ranks`: every rank's), the prompt sampler, the chance level."""
    ranks = trainer.ranks
    state = {
        "step": trainer.step_count,
        "optimizer": parallel.optimizer_state(trainer.model, trainer.optimizer, ranks),
        "scheduler": trainer.scheduler.state_dict(),
        "rng": rng.rng_state(),
        "trainer_rng": rng.python_rng_state(trainer.rng),
        "sampler": None if trainer.sampler is None else trainer.sampler.state_dict(),
        "chance": trainer.chance,
    }
    if ranks.distributed:
        state["rng_ranks"] = ranks.gather(state["rng"])
    return state


def load_state_dict(trainer, state: dict) -> None:
    ranks = trainer.ranks
    trainer.step_count = int(state["step"])
    parallel.load_optimizer_state(trainer.model, trainer.optimizer, state["optimizer"], ranks)
    trainer.scheduler.load_state_dict(state["scheduler"])
    rng.set_python_rng_state(trainer.rng, state["trainer_rng"])
    if trainer.sampler is not None and state["sampler"] is not None:
        trainer.sampler.load_state_dict(state["sampler"])
    trainer.chance = state["chance"]
    saved = state.get("rng_ranks") or [state["rng"]]
    # a rank the checkpoint holds no streams of (more ranks than saved it) seeds afresh
    trainer.restored_rng = saved[ranks.rank] if ranks.rank < len(saved) else None
    if ranks.main and len(saved) != ranks.world:
        print(
            f"fgrpo train: resuming on {ranks.world} rank(s) a run saved by {len(saved)}; the "
            "steps from here differ from an uninterrupted run's",
            file=sys.stderr,
        )
    trainer.resumed = True


def save(trainer, path: Path) -> None:
    ranks = trainer.ranks
    parallel.reshard(trainer.model, ranks)
    state = state_dict(trainer)
    weights = parallel.model_state(trainer.model, ranks)
    if ranks.main:
        run_dir.save_checkpoint(path, trainer.model, trainer.tokenizer, state, weights)


def begin(trainer, out: Path) -> tuple[list[dict], float]:
    """(history so far, seconds already spent): a fresh run seeds every random stream and
    starts its metrics; a resumed one restores the streams and reads back its logged steps
    (rank 0 reads, every rank gets them)."""
    cfg, ranks = trainer.cfg, trainer.ranks
    if not trainer.resumed:
        rng.seed_everything(parallel.rank_seed(cfg.seed, ranks.rank))
        if ranks.main:
            out.mkdir(parents=True, exist_ok=True)
            run_dir.start_metrics(out, cfg.to_dict())
            if cfg.chance_samples:
                trainer.chance = evaluation.chance_level(trainer, cfg.chance_samples)
        return [], 0.0
    logged = run_dir.resume_metrics(out, trainer.step_count) if ranks.main else None
    history = ranks.broadcast(logged)
    # last: loading models may have drawn numbers
    if trainer.restored_rng is not None:
        rng.set_rng_state(trainer.restored_rng)
    else:
        rng.seed_everything(parallel.rank_seed(cfg.seed, ranks.rank) + trainer.step_count)
    return history, (history[-1].get("time_s", 0.0) if history else 0.0)
