"""The run folder: every file the trainer writes or reads back, and nothing else touches it.

    DIR/train_config.json    the TrainConfig
    DIR/run.json             the command-line options (what `--resume` rebuilds the run from)
    DIR/metrics.jsonl        one line per step, appended across resumes
    DIR/checkpoint-N/        model + tokenizer (save_pretrained) and trainer_state.pt
    DIR/final/               the same at the end of the run or at an interrupt
    DIR/summary.json, DIR/training.png
    DIR/.lock                held by the process that trains in DIR (`lock.py`)

Every write goes through `writes.py` (a full disk stops the run with the file's name and
leaves nothing half-written). A data-parallel run calls these functions on rank 0 only.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from . import lock, writes

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
        if latest_checkpoint(out) is None and (out / "run.json").exists():
            raise ValueError(
                f"resume: the run in {str(out)!r} never saved a checkpoint (it was stopped "
                f"before its first --save-every step and before final/); start it again with "
                f"the same command and --overwrite instead of --resume"
            )
        if latest_checkpoint(out) is None:
            raise ValueError(
                f"resume: no checkpoint in {str(out)!r} (a run writes checkpoint-N/ every "
                f"--save-every steps and final/ when it ends or is interrupted)"
            )
        if not (out / "run.json").exists():
            raise ValueError(f"resume: {str(out)!r} has no run.json; it was not written by fgrpo")
        return
    if out.is_dir() and any(p.name != lock.NAME for p in out.iterdir()) and not overwrite:
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
    place, so that an interrupted or failed save never leaves half a checkpoint (a failed one
    is removed, to give the space back, and raises `writes.RunFolderError`)."""
    import torch

    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        with writes.writing(tmp):
            model.save_pretrained(tmp, **({} if weights is None else {"state_dict": weights}))
            tokenizer.save_pretrained(tmp)
        # NB: into a file object, so that a full disk surfaces as the OSError (ENOSPC) behind
        # torch's RuntimeError; given a path, torch only says "unexpected pos"
        with writes.writing(tmp / STATE), open(tmp / STATE, "wb") as f:
            torch.save(state, f)
        with writes.writing(tmp / STATE_JSON):
            (tmp / STATE_JSON).write_text(json.dumps({"step": state["step"]}) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = path.with_name(path.name + ".old")
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    if old.exists():
        _remove_checkpoint(old)


def _remove_checkpoint(path: Path) -> None:
    """Unmark it first (trainer_state.json), so that a kill halfway through leaves a folder
    that `latest_checkpoint` skips, never a half checkpoint it would pick."""
    (path / STATE_JSON).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def rotate(out: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoint-N/ (by step; final/ is never counted nor
    deleted); the caller runs it after a new checkpoint is completely written. Returns the
    deleted folders."""
    named = [p for p in Path(out).iterdir() if re.fullmatch(rf"{CHECKPOINT}\d+", p.name)]
    found = sorted((checkpoint_step(p) or -1, p) for p in named)
    doomed = [p for _, p in found[: max(len(found) - keep, 0)]]
    for path in doomed:
        _remove_checkpoint(path)
    return doomed


def load_state(path: Path) -> dict:
    import torch

    return torch.load(Path(path) / STATE, map_location="cpu", weights_only=True)


def write_json(path: Path, obj) -> None:
    writes.replace_text(path, json.dumps(obj, indent=2) + "\n")


def read_json(path: Path):
    return json.loads(Path(path).read_text())


def start_metrics(out: Path, config: dict) -> None:
    """A fresh run: the config, and an empty metrics log."""
    write_json(out / "train_config.json", config)
    writes.replace_text(out / METRICS, "")


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
        writes.append_line(out / ROLLED_BACK, "\n".join(drop))
        writes.replace_text(path, "".join(line + "\n" for line in keep))
    return [json.loads(line) for line in keep]


def append_metrics(out: Path, record: dict) -> None:
    writes.append_line(out / METRICS, json.dumps(record))


def read_metrics(out: Path) -> list[dict]:
    path = Path(out) / METRICS
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
