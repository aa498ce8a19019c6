"""`fgrpo train`: RL of a causal LM with a fused GRPO-family loss, on your prompts and rewards
or on the built-in digit task.

With only `--out DIR` it builds the embedded tiny Llama (no download) and trains it from
scratch on the CPU. `--model PATH` trains a Hugging Face checkpoint, `--prompts FILE` your
prompts, `--reward` your reward functions. DIR receives metrics.jsonl, training.png,
summary.json, checkpoint-N/ (every --save-every steps) and final/; `--resume` continues the run
in DIR from its last checkpoint. `torchrun --nproc-per-node N fgrpo train ...` trains
data-parallel (DDP, or FSDP2 with --fsdp): N × --prompts-per-step prompts per step, rank 0
writes DIR. User errors are one line, found before the model is loaded;
Ctrl-C finishes the step and writes final/, the summary and the plots (exit 130).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import fields
from pathlib import Path

from ..core.divergences import NAMES as DIVERGENCES
from ..core.options import LEVELS, LOSS_TYPES
from . import lock, run_dir, writes
from .config import LOSSES, REPORT_TO, SCHEDULERS, TrainConfig

PROG = "fgrpo train"
# out_dir and progress are --out and --no-progress
DEFAULTS = {f.name: f.default for f in fields(TrainConfig) if f.name not in ("out_dir", "progress")}
DEFAULTS |= {
    "out": None, "resume": False, "overwrite": False, "model": None,
    "lora_r": 0, "lora_alpha": None, "lora_target": "all-linear",
    "prompts": None, "prompt_column": "prompt", "answer_column": "answer",
    "eval_prompts": None, "eval_size": 0.1, "reward": None, "preferences": None,
    "task_steps": "19", "threads": 1, "no_progress": False, "device": "auto",
}  # fmt: skip
# what a resumed run may change; every other option must equal the run's own
RESUMABLE = {
    "out", "resume", "steps", "save_every", "save_total_limit", "report_to", "eval_every",
    "threads", "no_progress", "device",
}  # fmt: skip
PATHS = ("prompts", "eval_prompts", "preferences")
FLAGS: set[str] = set()  # the options' dest names, filled by add_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option, its default in its help; values are absent unless given (SUPPRESS), so
    that `--resume` can tell what the command line asks to change."""
    a = _adder(parser.add_argument_group("run folder"))
    a("--out", required=True, metavar="DIR", help="run folder", shown="required")
    a("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    a("--overwrite", action="store_true", help="replace the run in a non-empty --out")
    a("--save-every", type=int, metavar="N", help="checkpoint every N steps; 0: final/ only")
    a("--save-total-limit", type=int, metavar="N", help="keep the newest N checkpoint-N/ "
      "folders (final/ besides); 0: every one")  # fmt: skip
    a("--report-to", choices=REPORT_TO, help="also log every metric to TensorBoard (DIR/runs) "
      "or W&B, under TRL's names")  # fmt: skip
    a("--no-progress", action="store_true", help="no progress bar")
    _model_and_data(parser)
    _loss_and_optimisation(parser)


def _model_and_data(parser: argparse.ArgumentParser) -> None:
    a = _adder(parser.add_argument_group("model"))
    a("--model", metavar="PATH", help="HF checkpoint folder or Hub id", shown="the tiny model")
    a("--device", help="auto (cuda when available, else cpu), cpu, cuda, cuda:N")
    a("--lora-r", type=int, metavar="R", help="train a LoRA adapter of rank R (PEFT); 0: off")
    a("--lora-alpha", type=float, help="LoRA alpha", shown="2 x --lora-r")
    a("--lora-target", help="LoRA target modules, comma-separated")
    a("--fsdp", action="store_true", help="under torchrun: shard the model with FSDP2 (default: "
      "DDP, a full copy per rank)")  # fmt: skip
    a = _adder(parser.add_argument_group("data and rewards"))
    a("--prompts", metavar="FILE", help=".jsonl/.csv or datasets folder", shown="digit task")
    a("--prompt-column", metavar="NAME", help="the prompt column of --prompts")
    a("--answer-column", metavar="NAME", help="the column exact_match and numeric compare to")
    a("--reward", action="append", metavar="SPEC", shown="pattern; exact_match with --prompts",
      help="repeatable: exact_match, numeric, regex:PATTERN, pattern, or module:function / "
      "file.py:function with TRL's signature f(prompts, completions, **kwargs)")  # fmt: skip
    a("--reward-weights", type=float, nargs="+", metavar="W", help="one per --reward",
      shown="1 each")  # fmt: skip
    a("--eval-every", type=int, metavar="N", help="held-out reward and pass rate every N steps")
    a("--eval-prompts", metavar="FILE", help="held-out prompts",
      shown="a split of --prompts, or its datasets test split")  # fmt: skip
    a("--eval-size", type=float, help="rows of --prompts held out (fraction or count)")
    a("--eval-temperature", type=float, help="held-out sampling temperature; 0: greedy")
    a("--pass-threshold", type=float, help="a held-out completion passes at this total reward")
    a("--chance-samples", type=int, help="random-token completions for the chance level")
    a("--preferences", metavar="FILE", help="f-HAL pairs (prompt, chosen, rejected)",
      shown="the digit task's")  # fmt: skip
    a("--task-steps", help="digit steps of the built-in task's progressions")


def _loss_and_optimisation(parser: argparse.ArgumentParser) -> None:
    a = _adder(parser.add_argument_group("loss and optimisation"))
    a("--loss", choices=LOSSES, help="loss family")
    a("--divergence", choices=DIVERGENCES, help="f-GRPO / f-HAL divergence")
    a("--level", choices=LEVELS, help="f-GRPO / f-HAL level")
    a("--loss-type", choices=LOSS_TYPES, help="GRPO-family normalisation")
    a("--beta", type=float, help="beta", shown="fgrpo/fhal 0.1, grpo 0.04, gift 1.0")
    a("--num-generations", type=int, metavar="G", help="completions per prompt (>= 2)")
    a("--prompts-per-step", type=int, help="prompts per rollout")
    a("--rollouts-per-step", type=int, metavar="R", help="completions per rollout; sets "
      "--prompts-per-step to R / G", shown="G x --prompts-per-step")  # fmt: skip
    a("--steps", type=int, help="rollouts in the whole run")
    a("--lr", type=float, help="AdamW learning rate")
    a("--scheduler", choices=SCHEDULERS, help="learning-rate schedule over --steps")
    a("--warmup-steps", type=int, help="linear warm-up updates")
    a("--temperature", type=float, help="sampling temperature")
    a("--max-new-tokens", type=int, help="completion length limit")
    a("--grad-accum", type=int, help="micro-batches per update")
    a("--num-updates", type=int, help="optimizer updates per rollout")
    a("--max-grad-norm", type=float, help="gradient clipping; <= 0: off")
    a("--seed", type=int, help="seed of every random stream")
    a("--threads", type=int, help="torch CPU threads")


def _adder(group):
    def add(*flags, help, shown=None, **kw):
        dest = flags[0].lstrip("-").replace("-", "_")
        FLAGS.add(dest)
        if kw.get("action") != "store_true":
            help += f" (default: {shown if shown is not None else DEFAULTS[dest]})"
        group.add_argument(*flags, help=help, default=argparse.SUPPRESS, **kw)

    return add


def resolve_options(explicit: dict) -> dict:
    """Every option's value: the defaults, under the run's own options when resuming, under
    what the command line gives. A resumed run refuses changes outside RESUMABLE."""
    explicit = {k: _normal(k, v) for k, v in explicit.items()}
    out = Path(explicit["out"])
    run_dir.check_out_dir(out, explicit.get("resume", False), explicit.get("overwrite", False))
    if "prompts_per_step" in explicit and "rollouts_per_step" in explicit:
        raise ValueError("rollouts_per_step: give it or --prompts-per-step, not both")
    if not explicit.get("resume"):
        return DEFAULTS | explicit
    saved = run_dir.read_json(out / "run.json")["options"]
    for key, value in explicit.items():
        if key not in RESUMABLE and value != saved.get(key, DEFAULTS.get(key)):
            raise ValueError(
                f"{key}: the run in {str(out)!r} was started with {saved.get(key)!r}; --resume "
                f"continues it unchanged (got {value!r}; start a new --out to change it)"
            )
    return DEFAULTS | saved | explicit


def _normal(key: str, value):
    if key in PATHS or key == "out":
        return str(Path(value).expanduser().resolve())
    if key == "model" and Path(value).expanduser().exists():
        return str(Path(value).expanduser().resolve())
    return value


def make_config(opts: dict) -> TrainConfig:
    names = {f.name for f in fields(TrainConfig)}
    kwargs = {k: v for k, v in opts.items() if k in names}
    kwargs.update(out_dir=opts["out"], progress=not opts["no_progress"])
    if opts["max_grad_norm"] is not None and opts["max_grad_norm"] <= 0:
        kwargs["max_grad_norm"] = None
    for key in ("threads", "lora_r"):
        if not isinstance(opts[key], int) or opts[key] < (1 if key == "threads" else 0):
            raise ValueError(f"{key}: expected an int >= {int(key == 'threads')}; got {opts[key]}")
    if not opts["task_steps"].isdigit():
        raise ValueError(f"task_steps: expected digits such as 19; got {opts['task_steps']!r}")
    return TrainConfig(**kwargs)


def loss_name(cfg: TrainConfig) -> str:
    name = cfg.loss + (f" {cfg.divergence}" if cfg.loss in ("fgrpo", "fhal") else "")
    name += f" {cfg.loss_type}" if cfg.loss == "grpo" else ""
    name += f" {cfg.level}-level" if cfg.loss in ("fgrpo", "fhal") and cfg.level != "token" else ""
    return name


def fail(error: Exception | str, rank: int = 0) -> int:
    """One line on stderr; a message that starts with an option's name shows its flag. A rank
    other than 0 of a torchrun launch names itself."""
    name, sep, rest = str(error).partition(": ")
    message = f"--{name.replace('_', '-')}: {rest}" if sep and name in FLAGS else str(error)
    where = f" (rank {rank})" if rank else ""
    print(f"{PROG}: error{where}: {' '.join(message.split())}", file=sys.stderr)
    return 2


STOPPED = f"{PROG}: stopped at once (the last complete checkpoint is kept)"


class RunComplete(Exception):
    """`--resume` of a run that has done its --steps: nothing to do (exit 0, as HF Trainer)."""


def run(args: argparse.Namespace) -> int:
    try:
        return _run(vars(args))
    except KeyboardInterrupt:  # before the run's own handler is installed
        print(STOPPED, file=sys.stderr)
        return 130


def _run(explicit: dict) -> int:
    from . import parallel

    launch = parallel.launch_env()
    rank = 0 if launch is None else launch.rank
    checked, error, complete, held = None, None, None, lock.RunLock(Path(explicit["out"]))
    try:
        checked = _check(explicit, launch, rank)
        if rank == 0:
            held.acquire()  # refuses when another process took it since the check
    except RunComplete as e:
        complete = str(e)
    except (ValueError, TypeError) as e:
        error = str(e)
    owned = launch is not None and parallel.init(launch)
    # every rank stops here, or none does, before any of them touches the run folder
    error = parallel.first_error(error)
    try:
        if complete is not None:
            code, together = 0, True
            if rank == 0:
                print(f"{PROG}: {complete}")
        elif error is None:
            code, together = _train_or_stop(checked, rank)
        else:
            code, together = (fail(error) if rank == 0 else 2), True
    finally:
        held.release()
    # a peer may be waiting in a collective unless `together`: exiting lets torchrun end it
    if together and not parallel.shutdown(owned):
        # the group outlived destroy_process_group (FSDP2): leave before the interpreter's
        # teardown meets its threads. The run folder is written and closed by now.
        from ..backends.distributed import exit_now

        exit_now(code)
    return code


def _check(explicit: dict, launch, rank: int = 0) -> tuple:
    """Every check that needs no model weights; ValueError/TypeError name the option.
    RunComplete: a resumed run that has nothing left to do."""
    from . import preflight

    if rank == 0:  # first: a folder in use is refused whatever the other options say
        lock.check(Path(explicit["out"]).expanduser().resolve())
    opts = resolve_options(explicit)
    cfg = make_config(opts)
    if cfg.fsdp and launch is None:
        raise ValueError(
            "fsdp: FSDP2 shards the model over the ranks of a torchrun launch: torchrun "
            "--nproc-per-node N fgrpo train ... --fsdp"
        )
    preflight.check_packages(opts)
    device = preflight.device(opts["device"], None if launch is None else launch.local_rank)
    source = preflight.model_source(opts["model"])
    tokenizer = preflight.check_model(source) if source is not None else None
    plan = preflight.load_data(opts)
    checkpoint = run_dir.latest_checkpoint(opts["out"]) if opts["resume"] else None
    if checkpoint is not None and run_dir.checkpoint_step(checkpoint) >= cfg.steps:
        raise RunComplete(
            f"the run in {opts['out']!r} is complete: it has done "
            f"{run_dir.checkpoint_step(checkpoint)} steps (--steps {cfg.steps}); pass --resume "
            f"--steps N with a larger N to train it further"
        )
    return opts, cfg, device, source, tokenizer, plan, checkpoint


def _train_or_stop(checked: tuple, rank: int) -> tuple[int, bool]:
    """`_train`, where a full disk, a quota or a read-only folder ends the run with one line
    (exit 1); the last complete checkpoint is what `--resume` continues from."""
    try:
        return _train(*checked, rank)
    except writes.RunFolderError as e:
        fail(e, rank)
        return 1, False


def _train(opts, cfg, device, source, tokenizer, plan, checkpoint, rank: int):
    """(exit code, whether every rank ends here too)."""
    import torch

    from . import loading, parallel
    from .rewards import RewardError

    torch.set_num_threads(opts["threads"])
    try:
        from transformers.utils import logging

        logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - checked above
        pass

    torch.manual_seed(cfg.seed)  # the same LoRA initialisation on every rank and every run
    models, error = None, None
    try:
        models = loading.load_models(opts, cfg, source, checkpoint, device)
    except (ValueError, OSError) as e:
        error = str(e)
    error = parallel.first_error(error)
    if error is not None:
        return (fail(error) if rank == 0 else 2), True
    try:
        trainer = loading.make_trainer(opts, cfg, plan, tokenizer, models, checkpoint)
    except (ValueError, OSError) as e:
        return fail(e, rank), False
    out, main = Path(opts["out"]), trainer.ranks.main
    if main:
        if opts["overwrite"]:
            run_dir.clear_run(out)
        run_dir.write_json(out / "run.json", {"options": opts})  # on resume: the new --steps
    from .finish import finish
    from .signals import GracefulStop

    message = (
        "finishing this step, then writing final/, summary.json, training.png; again: stop now"
    )
    build_s = _build_backend(device) if main else None
    with GracefulStop(trainer.request_stop, message if main else None, STOPPED) as stop:
        start = time.perf_counter()
        try:
            history = trainer.train()
            # the first signal of any rank (torchrun passes its own on to every rank)
            signalled = next((s for s in trainer.ranks.gather(stop.signalled) if s), None)
            if main:
                wall = time.perf_counter() - start
                finish(trainer, history, wall, loss_name(cfg), signalled, build_s)
        except RewardError as e:
            return fail(e, rank), False
    return (130 if signalled else 0), True


def _build_backend(device: str) -> float | None:
    """Build (or load) the C++ CPU backend now, on a line of its own before the progress
    bar, so that its minute is not step 1's; the seconds a build took (None: no build)."""
    import torch

    from ..backends import cpu
    from ..head.autograd import use_triton

    if torch.device(device).type != "cpu" or use_triton(torch.device(device)):
        return None
    try:
        cpu.backend_module()
    except RuntimeError:
        return None  # FGRPO_CPU_BACKEND=cpp and no build: the first step says so
    return cpu.cpp_build_seconds()
