"""The `fgrpo` command: one CLI, subcommands `bench` and `train`.

Each subcommand lives with its code and provides `add_arguments(parser)` and `run(args)`; only
the chosen one is imported.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "bench": (
        "fgrpo_kernels.benchmarks.cli",
        "memory and speed against PyTorch, torch.compile, Liger",
    ),
    "train": ("fgrpo_kernels.trainer.cli", "train a causal LM with a GRPO-family loss"),
}


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line: `prog: error: message (see prog --help)`."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    top = Parser(prog="fgrpo", description="fgrpo_kernels command line")
    top.add_argument(
        "command",
        choices=list(SUBCOMMANDS),
        help="; ".join(f"{k}: {v[1]}" for k, v in SUBCOMMANDS.items()),
    )
    if not argv or argv[0] not in SUBCOMMANDS:
        top.parse_args(argv[:1])
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    parser = Parser(prog=f"fgrpo {argv[0]}", description=SUBCOMMANDS[argv[0]][1])
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(argv[1:])) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
