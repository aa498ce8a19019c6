"""Prompt data: rows from JSONL, CSV or a local Hugging Face `datasets` folder, a held-out
split, and an epoch sampler whose position a checkpoint can store.

A row is a dict with a "prompt" string (renamed from `prompt_column`) and any other columns
(an answer, metadata); reward functions receive the other columns as keyword lists, as in TRL.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

DATASET_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")


def load_rows(
    path: str | Path, prompt_column: str = "prompt", arg: str = "prompts"
) -> tuple[list[dict], list[dict] | None]:
    """(rows, held-out rows or None) from a .jsonl/.json/.csv file or a datasets folder.

    A datasets folder (save_to_disk, or data files that `datasets.load_dataset` reads) with a
    "test" or "validation" split returns that split as the held-out rows.
    """
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{arg}: no such file or folder: {str(path)!r}")
    held_out = None
    if p.is_dir():
        rows, held_out = _load_dataset_folder(p, arg)
    elif p.suffix in (".jsonl", ".json"):
        rows = _load_json(p, arg)
    elif p.suffix in (".csv", ".tsv"):
        with open(p, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f, delimiter="\t" if p.suffix == ".tsv" else ","))
    else:
        raise ValueError(
            f"{arg}: expected a .jsonl, .json or .csv file or a datasets folder; got {str(path)!r}"
        )
    rows = _with_prompt(rows, prompt_column, arg, str(path))
    if held_out is not None:
        held_out = _with_prompt(held_out, prompt_column, arg, f"{path} (held-out split)")
    return rows, held_out


def _load_json(p: Path, arg: str) -> list[dict]:
    text = p.read_text(encoding="utf-8")
    if p.suffix == ".json" and text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{arg}: {p} is not valid JSON ({e})") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{arg}: line {n} of {p} is not valid JSON ({e.msg})") from None
    return rows


def _load_dataset_folder(p: Path, arg: str):
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"{arg}: a datasets folder needs the `datasets` package (pip install datasets)"
        ) from None
    try:
        if any((p / m).exists() for m in DATASET_MARKERS):
            data = datasets.load_from_disk(str(p))
        else:
            data = datasets.load_dataset(str(p))
    except Exception as e:  # datasets raises many types; the user needs the first line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{arg}: could not read the datasets folder {p}: {first}") from None
    if not isinstance(data, datasets.DatasetDict):
        return list(data), None
    splits = list(data)
    train = "train" if "train" in data else splits[0]
    held = next((s for s in ("test", "validation") if s in data and s != train), None)
    return list(data[train]), (list(data[held]) if held else None)


def _with_prompt(rows, column: str, arg: str, where: str) -> list[dict]:
    if not rows:
        raise ValueError(f"{arg}: {where} holds no rows")
    out = []
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise ValueError(f"{arg}: row {n} of {where} is not an object; got {row!r:.60}")
        if column not in row:
            raise ValueError(
                f"{arg}: row {n} of {where} has no {column!r} column (columns: "
                f"{', '.join(map(repr, row))}); name it with --prompt-column"
            )
        prompt = row[column]
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{arg}: row {n} of {where}: expected a non-empty prompt string")
        row = {k: v for k, v in row.items() if k != column}
        out.append({"prompt": prompt, **row})
    return out


def split_rows(rows: list[dict], size: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held out): `size` rows (an int >= 1) or that fraction (0 < size < 1) held out,
    chosen by a seeded shuffle; at least one row stays on each side."""
    if not size > 0 or (size >= 1 and size != int(size)):
        raise ValueError(f"eval_size: expected a fraction in (0, 1) or a count >= 1; got {size}")
    n = round(size * len(rows)) if size < 1 else int(size)
    if not 1 <= n < len(rows):
        raise ValueError(
            f"eval_size: holding out {size} of {len(rows)} rows leaves {len(rows) - n} to train "
            f"on and {n} to evaluate; expected at least one of each"
        )
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    held = set(order[:n])
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in sorted(held)]


class PromptSampler:
    """Rows epoch by epoch: each row once per epoch, in an order shuffled by (seed, epoch).

    The state is one counter (`drawn`), so a resumed run draws what the uninterrupted one would.
    """

    def __init__(self, rows: list[dict], seed: int):
        self.rows, self.seed, self.drawn = rows, seed, 0
        self._epoch, self._order = -1, []

    def _order_of(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            self._order = list(range(len(self.rows)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order)
            self._epoch = epoch
        return self._order

    def draw(self, n: int) -> list[dict]:
        out = []
        for _ in range(n):
            epoch, pos = divmod(self.drawn, len(self.rows))
            out.append(self.rows[self._order_of(epoch)[pos]])
            self.drawn += 1
        return out

    def state_dict(self) -> dict:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        self.drawn = int(state["drawn"])


def as_rows(prompts) -> list[dict]:
    """Prompt rows from strings or dicts (which must hold "prompt")."""
    rows = []
    for p in prompts:
        if isinstance(p, str):
            rows.append({"prompt": p})
        elif isinstance(p, dict) and isinstance(p.get("prompt"), str):
            rows.append(p)
        else:
            raise TypeError(f"prompts: expected strings or dicts with a 'prompt'; got {p!r:.60}")
    if not rows:
        raise ValueError("prompts: expected at least one prompt; got none")
    return rows
