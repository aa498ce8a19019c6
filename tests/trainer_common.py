"""Shared by the trainer's test files: the CPU path, one thread, and the run folder's log."""

import json
from pathlib import Path

import pytest
import torch

TRAIN = ["train", "--no-progress"]


@pytest.fixture
def cpu_path(monkeypatch):
    """The fused log-prob's CPU path (not the Triton interpreter) on one thread (tiny ops);
    torch's thread count restored afterwards (`fgrpo train` sets it too)."""
    monkeypatch.setenv("FGRPO_BACKEND", "cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
