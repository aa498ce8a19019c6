"""The run folder: every file the trainer writes or reads back, and nothing else touches it.

    DIR/train_config.json    the TrainConfig
    DIR/run.json             the command-line options (what `--resume` rebuilds the run from)
    DIR/metrics.jsonl        one line per step, appended across resumes
    DIR/checkpoint-N/        model + tokenizer (save_pretrained) and trainer_state.pt
    DIR/final/               the same at the end of the run or at an interrupt
    DIR/summary.json, DIR/training.png

A data-parallel run calls these functions on rank 0 only.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

CHECKPOINT = "checkpoint-"
FINAL = "final"
STATE = "trainer_state.pt"
STATE_JSON = "trainer_state.json"
METRICS = "metrics.jsonl"
ROLLED_BACK = "metrics.rolled_back.jsonl"
RUN_FILES = (
    "train_config.json", "run.json", METRICS, ROLLED_BACK, "summary.json", "training.png", FINAL,
)  # fmt: skip


def check_out_dir(out: str | Path, resume: bool, overwrite: bool) -> None:
    """Refuse what would lose or mix up a run: --out a file, a non-empty folder without
    --resume or --overwrite, --resume with nothing to resume."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out: {str(out)!r} is a file; expected a folder for the run")
    if resume and overwrite:
        raise ValueError("resume: --resume continues the run in --out, --overwrite deletes it")
    if resume:
        if latest_checkpoint(out) is None:
            raise ValueError(
                f"resume: no checkpoint in {str(out)!r} (a run writes checkpoint-N/ every "
                f"--save-every steps and final/ when it ends or is interrupted)"
            )
        if not (out / "run.json").exists():
            raise ValueError(f"resume: {str(out)!r} has no run.json; it was not written by fgrpo")
        return
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(
            f"out: {str(out)!r} is not empty; pass --resume to continue the run in it or "
            f"--overwrite to replace it"
        )


def clear_run(out: Path) -> None:
    """Delete the files a previous run wrote into `out` (and only those)."""
    leftovers = [out / f"{FINAL}{suffix}" for suffix in (".tmp", ".old")]
    for path in [*(out / name for name in RUN_FILES), *out.glob(f"{CHECKPOINT}*"), *leftovers]:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def checkpoint_step(path: Path) -> int | None:
    try:
        return int(json.loads((path / STATE_JSON).read_text())["step"])
    except (OSError, ValueError, KeyError):
        return None  # not a (complete) checkpoint


def latest_checkpoint(out: str | Path) -> Path | None:
    """The checkpoint with the most steps (checkpoint-N/ or final/; final wins a tie)."""
    out = Path(out)
    if not out.is_dir():
        return None
    named = [
        p for p in out.iterdir() if p.name == FINAL or re.fullmatch(rf"{CHECKPOINT}\d+", p.name)
    ]
    found = [(checkpoint_step(p), p.name == FINAL, p) for p in named]
    found = [f for f in found if f[0] is not None]
    return max(found, key=lambda f: f[:2])[2] if found else None


def save_checkpoint(path: Path, model, tokenizer, state: dict, weights: dict | None = None) -> None:
    """Model and tokenizer (save_pretrained; `weights`: the model's full state dict when its
    own is sharded) plus the trainer state, written to a temporary folder and renamed into
    place, so that an interrupted save never leaves half a checkpoint."""
    import torch

    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, **({} if weights is None else {"state_dict": weights}))
    tokenizer.save_pretrained(tmp)
    torch.save(state, tmp / STATE)
    (tmp / STATE_JSON).write_text(json.dumps({"step": state["step"]}) + "\n")
    old = path.with_name(path.name + ".old")
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    if old.exists():
        shutil.rmtree(old)


def load_state(path: Path) -> dict:
    import torch

    return torch.load(Path(path) / STATE, map_location="cpu", weights_only=True)


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")


def read_json(path: Path):
    return json.loads(Path(path).read_text())


def start_metrics(out: Path, config: dict) -> None:
    """A fresh run: the config, and an empty metrics log."""
    write_json(out / "train_config.json", config)
    (out / METRICS).write_text("")


def resume_metrics(out: Path, step: int) -> list[dict]:
    """The logged records of steps 1..`step`. Lines of later steps (logged after the checkpoint
    the run resumes from, then lost) move to metrics.rolled_back.jsonl: they are run again."""
    path = out / METRICS
    lines = path.read_text().splitlines() if path.exists() else []
    keep, drop = [], []
    for line in lines:
        if line.strip():
            (keep if json.loads(line)["step"] <= step else drop).append(line)
    if drop:
        with open(out / ROLLED_BACK, "a") as f:
            f.write("\n".join(drop) + "\n")
        path.write_text("".join(line + "\n" for line in keep))
    return [json.loads(line) for line in keep]


def append_metrics(out: Path, record: dict) -> None:
    with open(out / METRICS, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_metrics(out: Path) -> list[dict]:
    path = Path(out) / METRICS
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
