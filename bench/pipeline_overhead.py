"""CPU time of one fused forward+backward per loss family (C++ backend, 1 thread, median of 7).

Run it with PYTHONPATH set to two checkouts to compare the pipeline's overhead before and after
a change (the 2026-12-05 architecture change: docs/architecture.md):

    PYTHONPATH=/path/to/before python bench/pipeline_overhead.py
    PYTHONPATH=/path/to/after  python bench/pipeline_overhead.py
"""

import json
import os
import time

os.environ.setdefault("FGRPO_BACKEND", "cpu")
os.environ.setdefault("FGRPO_CPU_BACKEND", "cpp")

import torch  # noqa: E402

import fgrpo_kernels as fk  # noqa: E402


def main():
    torch.set_num_threads(1)
    B, T, H, V = 8, 64, 256, 4096
    g = torch.Generator().manual_seed(0)
    h = torch.randn(B, T, H, generator=g, requires_grad=True)
    w = (torch.randn(V, H, generator=g) * 0.05).requires_grad_()
    ids = torch.randint(0, V, (B, T), generator=g)
    mask, adv = torch.ones(B, T), torch.randn(B)
    ref = torch.randn(B, T) * 0.1 - 8
    cases = {
        "grpo": (fk.FusedLinearGRPOLoss(beta=0.04),
                 lambda m: m(h, w, ids, mask, adv, ref_per_token_logps=ref)),
        "fgrpo": (fk.FusedLinearFGRPOLoss("pearson", 0.1),
                  lambda m: m(h, w, ids, mask, advantages=adv, ref_per_token_logps=ref)),
        "gift": (fk.FusedLinearGIFTLoss(4), lambda m: m(h, w, ids, mask, adv, ref)),
    }  # fmt: skip
    out = {}
    for name, (module, call) in cases.items():
        times = []
        for i in range(9):
            t = time.perf_counter()
            call(module)[0].backward()
            if i >= 2:  # two warm-up calls
                times.append(time.perf_counter() - t)
        out[name] = round(sorted(times)[len(times) // 2] * 1e3, 2)
    print(json.dumps({"ms_median": out, "package": os.path.dirname(fk.__file__)}))


if __name__ == "__main__":
    main()
