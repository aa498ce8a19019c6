"""Where an off-policy sequence-local variant's time goes beyond our GRPO loss's (CPU).

    python bench/open_row_costs.py [--tokens 4096,16384] [--mode gmpo] [--turns 5]

On the `fgrpo bench` tensors (B 8, V 32,768, H 128, fp32, old log-probs = the reference ones),
by turns in one process (a drifting machine load hits every row alike), medians of fwd+bwd:

- `grpo`: our GRPO dapo loss at the default budget (chunks of 255 rows);
- `grpo@open-rows`: the same loss with the budget left to the logits beside an open row's
  fp32 [V, H] dW (chunks of 127 rows): what the smaller chunks cost alone;
- `MODE`: the variant with open rows, and `MODE@on-policy` (no old log-probs: token-local
  chunks), each with the phase recorder's epilogue calls and milliseconds and the open rows'
  folds (their dW and db now join within the last piece's backward: `fold_ms` is the dh
  rows' scaling alone).

Prints one JSON line per row, time as a ratio to `grpo` of the same turn.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from fgrpo_kernels.backends import phases
from fgrpo_kernels.benchmarks import peers
from fgrpo_kernels.benchmarks.peers import PEERS
from fgrpo_kernels.benchmarks.presets import Case
from fgrpo_kernels.benchmarks.workload import Workload, run_step
from fgrpo_kernels.losses.single_pass import DEFAULT_BYTES

V, H, B = 32768, 128, 8


def timed(step, w: Workload) -> tuple[float, dict, dict]:
    rec = phases.Recorder(cuda=False)
    t0 = time.perf_counter()
    with phases.recording(rec):
        run_step(step, w, "fwd+bwd")
    dt = time.perf_counter() - t0
    w.zero_grad()
    return dt, rec.totals_ms(), dict(rec.calls)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--mode", default="gmpo")
    ap.add_argument("--turns", type=int, default=5)
    args = ap.parse_args(argv)
    open_dw = V * H * 4
    grpo = PEERS["ours"].step("grpo", "cpu")
    for n in map(int, args.tokens.split(",")):
        w = Workload.make(Case("ours", "grpo", "fwd+bwd", n, V, H, "float32", "cpu", B))

        rows = {
            "grpo": grpo,
            "grpo@open-rows": peers._ours_grpo(DEFAULT_BYTES["cpu"] - open_dw)("cpu"),
            args.mode: PEERS["ours"].step(f"policy:{args.mode}", "cpu"),
            f"{args.mode}@on-policy": PEERS["ours"].step(f"policy:{args.mode}@on-policy", "cpu"),
        }
        for step in rows.values():  # warm-up
            timed(step, w)
        out = {k: [] for k in rows}
        for _ in range(args.turns):
            for name, step in rows.items():
                out[name].append(timed(step, w))
        for name, runs in out.items():
            ratios = [r[0] / g[0] for r, g in zip(runs, out["grpo"])]
            last = runs[-1]
            print(json.dumps({
                "tokens": n, "row": name,
                "ms": round(1e3 * statistics.median(r[0] for r in runs), 1),
                "vs_grpo": round(statistics.median(ratios), 3),
                "epilogue_calls": last[2].get("epilogue", 0),
                "epilogue_ms": round(last[1].get("epilogue", 0.0), 1),
                "open_row_folds": last[2].get("open_row_fold", 0),
                "fold_ms": round(last[1].get("open_row_fold", 0.0), 1),
            }))  # fmt: skip


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
