"""Reward functions: TRL's signature, the built-ins, and their weighted sum with statistics.

A reward function is called as `f(prompts=..., completions=..., completion_ids=..., **columns,
trainer_state=..., log_metric=...)` with one list entry per completion (each prompt and each
data column repeated G times) and returns one float per completion, or None for "not scored"
(TRL's convention). Keywords that `f` does not accept are left out, so `f(prompts,
completions)` works as well. Built-ins: `exact_match` and `numeric` against the answer column,
`regex:PATTERN` (format), `pattern` (the built-in digit task).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .task import PatternTask

BUILTINS = ("exact_match", "numeric", "regex:PATTERN", "pattern")
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


class RewardError(ValueError):
    """A reward function broke the contract (wrong count or type of its results)."""


@dataclass
class RewardState:
    """What a reward function gets as `trainer_state` (the fields of TRL's that apply)."""

    global_step: int = 0
    max_steps: int = 0


def parse_number(value) -> float | None:
    """The last number in `value` ("#### 1,234" -> 1234.0); None when there is none."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    found = _NUMBER.findall(str(value))
    return float(found[-1].replace(",", "")) if found else None


def exact_match(column: str = "answer") -> Callable:
    """1.0 when the stripped completion equals the stripped `column` value, else 0.0."""

    def exact_match(completions, **kwargs):
        want = kwargs[column]
        return [float(str(c).strip() == str(a).strip()) for c, a in zip(completions, want)]

    exact_match.columns = (column,)
    return exact_match


def numeric(column: str = "answer") -> Callable:
    """1.0 when the last number of the completion equals the `column` value's (rel. 1e-6)."""

    def numeric(completions, **kwargs):
        out = []
        for c, a in zip(completions, kwargs[column]):
            got, want = parse_number(c), parse_number(a)
            if want is None:
                out.append(None)  # no number in the answer: not scored
            else:
                out.append(float(got is not None and math.isclose(got, want, rel_tol=1e-6)))
        return out

    numeric.columns = (column,)
    numeric.numeric_columns = (column,)
    return numeric


def regex_format(pattern: str) -> Callable:
    """1.0 when the whole stripped completion matches `pattern` (re.DOTALL), else 0.0."""
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ValueError(
            f"reward: regex:{pattern} is not a valid regular expression: {e}"
        ) from None

    def regex(completions, **kwargs):
        return [float(compiled.fullmatch(str(c).strip()) is not None) for c in completions]

    return regex


def pattern(prompts, completions, **kwargs):
    """The built-in digit task: 1.0 exact next term, 0.5 the right digit followed by more."""
    return PatternTask().reward(prompts, completions)


def load_function(spec: str) -> Callable:
    """The callable that "module:function" or "path/to/file.py:function" names."""
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise ValueError(
            f"reward: expected a built-in ({', '.join(BUILTINS)}) or module:function; got {spec!r}"
        )
    try:
        if module_name.endswith(".py") or "/" in module_name:
            path = Path(module_name)
            if not path.is_file():
                raise ValueError(f"reward: no such file: {module_name!r} (from {spec!r})")
            loader = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))  # as `python -m` would
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(
            f"reward: no module named {e.name!r} (from {spec!r}); run from the folder that holds "
            f"it or give path/to/file.py:{attr}"
        ) from None
    except ValueError:
        raise
    except Exception as e:  # the user's module failed to import: say where, in one line
        what = f"{type(e).__name__}: {e}".splitlines()[0]
        raise ValueError(f"reward: importing {module_name!r} failed: {what}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"reward: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"reward: {spec!r} is not callable; got {type(fn).__name__}")
    return fn


def resolve(spec: str, answer_column: str = "answer") -> Callable:
    """A reward function from its command-line name (see BUILTINS) or module:function."""
    if spec == "exact_match":
        return exact_match(answer_column)
    if spec == "numeric":
        return numeric(answer_column)
    if spec == "pattern":
        return pattern
    if spec.startswith("regex:"):
        return regex_format(spec[len("regex:") :])
    return load_function(spec)


def _accepted(fn) -> set[str] | None:
    """Keyword names `fn` takes (None: it takes **kwargs, so everything)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: give it everything
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in params if p.kind in kinds}


def _name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


class RewardSet:
    """Several reward functions with weights: total = Σ_k w_k·r_k (None-scores skipped, as TRL
    does); per-function mean and std go to the metrics as rewards/<name>/mean|std."""

    def __init__(self, funcs: Callable | Sequence[Callable], weights=None):
        self.funcs = [funcs] if callable(funcs) else list(funcs)
        if not self.funcs:
            raise ValueError("reward_fn: expected at least one reward function; got none")
        for fn in self.funcs:
            if not callable(fn):
                raise TypeError(f"reward_fn: expected callables; got {type(fn).__name__}")
        weights = [1.0] * len(self.funcs) if weights is None else [float(w) for w in weights]
        if len(weights) != len(self.funcs):
            raise ValueError(
                f"reward_weights: expected one weight per reward function ({len(self.funcs)}); "
                f"got {len(weights)}"
            )
        self.weights = weights
        self.names: list[str] = []
        for fn in self.funcs:
            name, k = _name(fn), 2
            while name in self.names:
                name, k = f"{_name(fn)}_{k}", k + 1
            self.names.append(name)

    def check_columns(self, columns: set[str], rows: Sequence[dict] = ()) -> None:
        """Every function can be called with the data's columns (checked without calling it)."""
        given = {"prompts", "completions", "completion_ids", "trainer_state", "log_metric"}
        given |= set(columns)
        for fn, name in zip(self.funcs, self.names):
            missing = [c for c in getattr(fn, "columns", ()) if c not in columns]
            if missing:
                raise ValueError(
                    f"reward: {name} needs the column {missing[0]!r}; the prompts have "
                    f"{', '.join(map(repr, sorted(columns))) or 'none'} (see --answer-column)"
                )
            for column in getattr(fn, "numeric_columns", ()):
                for n, row in enumerate(rows, 1):
                    if parse_number(row[column]) is None:
                        raise ValueError(
                            f"reward: {name} needs a number in {column!r}; row {n} has "
                            f"{row[column]!r:.60}"
                        )
            try:
                sig = inspect.signature(fn)
            except (TypeError, ValueError):  # no signature to check (a builtin)
                continue
            accepted = _accepted(fn)
            kwargs = dict.fromkeys(given if accepted is None else given & accepted)
            try:
                if accepted is None or {"prompts", "completions"} <= accepted:
                    sig.bind(**kwargs)
                else:
                    sig.bind(None, None, **kwargs)
            except TypeError as e:
                raise ValueError(
                    f"reward: {name} cannot be called with the prompts' columns "
                    f"({', '.join(sorted(columns)) or 'none'}): {e}"
                ) from None

    def __call__(self, prompts, completions, completion_ids, columns: dict, state: RewardState):
        """(total [B], per-function [B, F] with NaN for None, metrics dict)."""
        n = len(completions)
        per_func = torch.full((n, len(self.funcs)), math.nan)
        logged: dict[str, list[float]] = {}

        def log_metric(name: str, value: float) -> None:
            logged.setdefault(name, []).append(float(value))

        everything = dict(
            prompts=prompts, completions=completions, completion_ids=completion_ids,
            trainer_state=state, log_metric=log_metric, **columns,
        )  # fmt: skip
        for k, (fn, name) in enumerate(zip(self.funcs, self.names)):
            accepted = _accepted(fn)
            if accepted is None:
                out = fn(**everything)
            elif "prompts" in accepted and "completions" in accepted:
                out = fn(**{key: v for key, v in everything.items() if key in accepted})
            else:
                rest = {key: v for key, v in everything.items() if key in accepted}
                out = fn(prompts, completions, **rest)
            out = list(out)
            if len(out) != n:
                raise RewardError(f"reward: {name} returned {len(out)} rewards; expected {n}")
            try:
                per_func[:, k] = torch.tensor([math.nan if r is None else float(r) for r in out])
            except (TypeError, ValueError):
                bad = next(r for r in out if r is not None and not _is_real(r))
                raise RewardError(
                    f"reward: {name} returned {bad!r:.40}; expected floats or None"
                ) from None
        weights = torch.tensor(self.weights)
        total = (per_func * weights).nansum(-1)
        total[per_func.isnan().all(-1)] = math.nan  # scored by no function
        metrics = self.statistics(per_func)
        metrics.update({name: sum(v) / len(v) for name, v in logged.items()})
        return total, per_func, metrics

    def statistics(self, per_func: torch.Tensor) -> dict[str, float]:
        """rewards/<name>/mean and /std of each function over the completions it scored
        (per_func [B, F], NaN where unscored); a function that scored nothing has none."""
        metrics = {}
        for k, name in enumerate(self.names):
            col = per_func[:, k]
            col = col[~col.isnan()]
            if col.numel():
                metrics[f"rewards/{name}/mean"] = float(col.mean())
                metrics[f"rewards/{name}/std"] = float(col.std()) if col.numel() > 1 else 0.0
        return metrics


def _is_real(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True
