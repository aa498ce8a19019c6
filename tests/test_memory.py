"""No [N, V] on the CPU path: at N 16,384 × V 32,768 (one fp32 [N, V] is 2 GiB) fwd+bwd of the
primitive and of FusedLinearFGRPOLoss stays under 512 MiB of extra peak memory (fresh process)."""

import json
import os
import subprocess
import sys

import pytest

CHILD = r"""
import json, sys, torch
import fgrpo_kernels as fk
from fgrpo_kernels.benchmarks.process_memory import PeakRSS

N, V, H = 16384, 32768, 64
torch.manual_seed(0)
h = torch.randn(N, H, requires_grad=True)
w = (torch.randn(V, H) / H**0.5).requires_grad_(True)
ids = torch.randint(0, V, (N,))
what = sys.argv[1]
mask = torch.ones(8, N // 8)
ref = torch.full((8, N // 8), -10.0)
peak = PeakRSS()
if what == "logprobs":
    loss = fk.fused_linear_logprobs(h, w, ids).sum()
else:
    module = fk.FusedLinearFGRPOLoss()
    loss, _ = module(h.view(8, N // 8, H), w, ids.view(8, N // 8), mask,
                     advantages=torch.linspace(-1, 1, 8), ref_per_token_logps=ref)
loss.backward()
print(json.dumps({"extra_mib": peak.extra() / 2**20, "backend": fk.cpu_backend()}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
@pytest.mark.parametrize("what", ["logprobs", "fgrpo"])
def test_cpu_path_peak_memory_is_far_below_one_logits_tensor(what):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FGRPO_BACKEND")}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, what],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # fp32 [N, V] logits alone would be 2048 MiB; the gradients here add 16 MiB (w) + 8 MiB (h).
    assert result["extra_mib"] < 512, result


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_peak_rss_sees_a_freed_allocation():
    """In a fresh process, as every figure is measured. Inside the pytest process, after 1,300
    other tests, it once read 0 in CI (not reproduced alone in 5 runs; the likeliest cause is
    the allocator serving the block from memory earlier tests freed, not confirmed)."""
    out = subprocess.run([sys.executable, "-c", FREED], capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    extra = int(out.stdout.strip().splitlines()[-1])
    assert 90 * 2**20 <= extra < 200 * 2**20, extra


FREED = r"""
from fgrpo_kernels.benchmarks.process_memory import PeakRSS

peak = PeakRSS()
block = bytearray(96 * 2**20)  # zero-filled pages, touched: resident
block[::4096] = b"\x01" * len(block[::4096])
del block
print(peak.extra())
"""
