"""Peak host memory of one GRPO training step: `fgrpo bench --preset train-memory`.

    python bench/train_memory.py --out DIR [any `fgrpo bench` option, e.g. --tokens 8192]

A Qwen2-shaped model (V 151,936) with completions of 4k to 32k tokens: stock TRL, TRL with
Liger's fused GRPO loss, our TRL drop-in and the backbone alone, each case in a fresh process
(see fgrpo_kernels/benchmarks/train_step.py).
"""

import sys

from fgrpo_kernels.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "--preset", "train-memory", *sys.argv[1:]]))
