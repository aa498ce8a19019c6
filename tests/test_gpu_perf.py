"""The GPU-performance levers on the CPU: the buffer rule (`backends.memory`), the phase hook
(`backends.phases`), the primitive through the cuBLAS chunk path ($FGRPO_PRIMITIVE=cublas)
against float64 under the interpreter, and bench/gpu_perf.py --tiny end to end."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fgrpo_kernels
from fgrpo_kernels import reference
from fgrpo_kernels.backends import memory, phases
from fgrpo_kernels.backends.triton import bytes_per_row, cublas_chunks

ROOT = Path(__file__).resolve().parents[1]
GiB = memory.GiB
sys.path.insert(0, str(ROOT / "bench"))
import traffic_model  # noqa: E402


def test_buffer_rule_clamps_a_quarter_of_free_memory():
    assert memory.auto_bytes(free=140 * GiB, fixed=4 * GiB) == memory.CAP  # an idle H200
    assert memory.auto_bytes(free=12 * GiB, fixed=4 * GiB) == 2 * GiB  # (12 − 4) / 4
    assert memory.auto_bytes(free=15 * GiB, fixed=4 * GiB) == 2 * GiB  # 2.75: a power of two
    assert memory.auto_bytes(free=3 * GiB, fixed=2 * GiB) == memory.FLOOR  # never below 1 GiB
    assert memory.auto_bytes(free=140 * GiB, fixed=0, cap=GiB // 2) == GiB // 2  # a user cap
    assert memory.auto_bytes(free=140 * GiB, fixed=0, cap=3 * GiB) == 3 * GiB  # taken as is
    sizes = {memory.auto_bytes(free=f * GiB // 8, fixed=0) for f in range(0, 200)}
    assert sizes == {GiB, 2 * GiB, 4 * GiB}  # the chunking moves only at thresholds
    assert memory.fixed_bytes(151936, 4096, torch.bfloat16) == 151936 * 4096 * 6
    with pytest.raises(ValueError, match="free and fixed"):
        memory.auto_bytes(free=-1, fixed=0)


def test_traffic_model_uses_the_code_s_chunks_and_meets_the_measured_run():
    """The model's rows per chunk are the single pass's (`bytes_per_row`, bf16: 6 B per logit;
    the issue's ~1,150 rows and ~57 chunks at 64k); at 1 GiB its estimate lies within 15% of
    the 2026-12-04 H200 times (8k: 10% under; it leaves out launches and slow small-K
    products); more buffer, fewer chunks, a lower estimate; bad input named."""
    per_row = bytes_per_row(torch.empty(0, dtype=torch.bfloat16), traffic_model.V)
    assert per_row == 6 * traffic_model.V
    m = traffic_model.model(65536, GiB)
    assert m["rows"] == GiB // per_row and m["chunks"] == -(-65536 // m["rows"]) == 56
    for N, seen in traffic_model.MEASURED_1GIB.items():
        est = traffic_model.model(N, GiB)["total_ms"]
        assert 0.85 * seen < est < 1.01 * seen, (N, est, seen)
    for N in traffic_model.GEMM_MS:
        ests = [traffic_model.model(N, g * GiB)["total_ms"] for g in traffic_model.BUFFERS_GIB]
        assert ests == sorted(ests, reverse=True)
        assert traffic_model.model(N, 8 * GiB)["ratio"] > 1.0  # the model never beats the floor
    for bad in ({"N": 1000, "budget": GiB}, {"N": 8192, "budget": 0}, {"N": 8192, "budget": 8}):
        with pytest.raises(ValueError, match="N|budget"):
            traffic_model.model(**bad)
    assert "| 65536 | 1 | 1177 | 56 |" in traffic_model.table(4.8e12)
    prim = traffic_model.model(8192, GiB, kind="primitive")
    assert prim["gemm_ms"] == pytest.approx(4 / 3 * traffic_model.model(8192, GiB)["gemm_ms"])
    with pytest.raises(ValueError, match="kind"):
        traffic_model.model(8192, GiB, kind="both")


def test_buffer_env(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("FGRPO_MAX_CHUNK_BYTES", raising=False)
    assert memory.buffer_bytes(cpu) == 32 << 20
    monkeypatch.setenv("FGRPO_MAX_CHUNK_BYTES", "12345")
    assert memory.buffer_bytes(cpu) == 12345
    monkeypatch.setenv("FGRPO_MAX_CHUNK_BYTES", "lots")
    with pytest.raises(ValueError, match="FGRPO_MAX_CHUNK_BYTES"):
        memory.buffer_bytes(cpu)
    monkeypatch.setenv(memory.MODE_ENV, "huge")
    with pytest.raises(ValueError, match=memory.MODE_ENV):
        memory.mode()
    monkeypatch.setenv(cublas_chunks.ENV, "magic")
    with pytest.raises(ValueError, match=cublas_chunks.ENV):
        cublas_chunks.chosen()


def test_device_rule_counts_the_allocator_cache(monkeypatch):
    """On CUDA the rule sees the driver's free memory plus the caching allocator's unused
    blocks; $FGRPO_CHUNK_CAP_BYTES caps it and $FGRPO_CHUNK_BUFFER=fixed gives 1 GiB (faked
    device: no GPU here)."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (6 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 12 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 2 * GiB)
    for name in ("FGRPO_MAX_CHUNK_BYTES", memory.CAP_ENV, memory.MODE_ENV):
        monkeypatch.delenv(name, raising=False)
    assert memory.available(cuda) == 16 * GiB
    assert memory.buffer_bytes(cuda) == 4 * GiB  # 16 / 4
    assert memory.buffer_bytes(cuda, fixed=8 * GiB) == 2 * GiB  # (16 − 8) / 4
    monkeypatch.setenv(memory.CAP_ENV, str(GiB + 5))
    assert memory.buffer_bytes(cuda) == GiB + 5
    monkeypatch.setenv(memory.CAP_ENV, "big")
    with pytest.raises(ValueError, match=memory.CAP_ENV):
        memory.buffer_bytes(cuda)
    monkeypatch.setenv(memory.MODE_ENV, "fixed")
    assert memory.buffer_bytes(cuda) == memory.FLOOR
    monkeypatch.setenv("FGRPO_MAX_CHUNK_BYTES", "777")
    assert memory.buffer_bytes(cuda) == 777


def test_phase_hook_records_only_inside_recording():
    rec = phases.Recorder(cuda=False)
    with phases.phase("logits_gemm"):
        pass
    assert rec.totals_ms() == {}
    with phases.recording(rec):
        with phases.phase("dw_gemm"):
            sum(range(1000))
        with (
            pytest.raises(RuntimeError, match="already installed"),
            phases.recording(phases.Recorder(cuda=False)),
        ):
            pass
    with phases.phase("dh_gemm"):
        pass
    assert set(rec.totals_ms()) == {"dw_gemm"} and rec.calls["dw_gemm"] == 1
    assert rec.totals_ms()["dw_gemm"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_primitive_through_cublas_chunks_matches_float64(monkeypatch, dtype):
    """Several chunks (a 5-row buffer) of an awkward shape with bias, τ, ignored rows and the
    entropy's gradient: the cuBLAS chunk path ran (its phases recorded) and matches float64."""
    monkeypatch.setenv("FGRPO_BACKEND", "triton")
    monkeypatch.setenv(cublas_chunks.ENV, "cublas")
    N, H, V = 13, 19, 67
    g = torch.Generator().manual_seed(1)
    h = torch.randn(N, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 2 / H**0.5).to(dtype)
    b = (torch.randn(V, generator=g) * 0.5).to(dtype)
    y = torch.randint(0, V, (N,), generator=g)
    y[[2, 7]] = -100
    up = torch.randn(2, N, generator=g, dtype=torch.float64)
    monkeypatch.setenv("FGRPO_MAX_CHUNK_BYTES", str(5 * bytes_per_row(h, V)))

    def run(fn, leaves):
        leaves = [t.detach().requires_grad_() for t in leaves]
        lp, ent = fn(*leaves[:2], y, leaves[2], 0.7, return_entropy=True)
        ((lp.double() * up[0]).sum() + (ent.double() * up[1]).sum()).backward()
        return [lp.detach(), ent.detach()] + [t.grad for t in leaves]

    rec = phases.Recorder(cuda=False)
    with phases.recording(rec):
        got = run(fgrpo_kernels.fused_linear_logprobs, (h, w, b))
    assert rec.calls["logits_gemm"] == 2 * 3 and rec.calls["dw_gemm"] == 3
    want = run(reference.logprobs, [t.double() for t in (h, w, b)])
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    for name, a, e in zip(("logp", "entropy", "dh", "dw", "db"), got, want, strict=True):
        assert a.dtype == (torch.float32 if name in ("logp", "entropy") else dtype)
        err = float((a.double() - e).norm() / e.norm())
        assert err < tol, (name, err)
    monkeypatch.setenv(cublas_chunks.ENV, "tiles")
    rec = phases.Recorder(cuda=False)
    with phases.recording(rec):
        run(fgrpo_kernels.fused_linear_logprobs, (h, w, b))
    assert rec.calls == {}  # the Triton tiles: no chunk phases


def test_gpu_perf_tiny_writes_the_phase_csv(tmp_path):
    env = dict(os.environ, TRITON_DEFAULT_FP_FUSION="1")
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_perf.py"), "--tiny", "--iters", "1",
           "--out", str(tmp_path)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    with open(tmp_path / "gpu_perf.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(r["status"] == "ok" for r in rows), [r for r in rows if r["status"] != "ok"]
    by = {r["variant"] for r in rows}
    assert {"correctness"} | {f"buffer_{x}" for x in ("0.5GiB", "1GiB", "auto")} <= by
    assert {"primitive_tiles", "primitive_cublas"} <= by
    assert any(v.startswith("rows_") for v in by)
    loss = [r for r in rows if r["variant"].startswith("buffer_")]
    for r in loss:
        assert float(r["total_ms"]) > 0 and float(r["cublas_tflops"]) > 0
        assert float(r["ratio_to_floor"]) > 0 and r["floor"] == "6NHV"
        assert float(r["logits_gemm_ms"]) > 0 and float(r["dw_gemm_ms"]) > 0
        assert float(r["epilogue_ms"]) > 0 and int(r["chunks"]) >= 1
    cub = [r for r in rows if r["variant"] == "primitive_cublas"]
    assert cub and all(r["floor"] == "8NHV" and float(r["grad_kernel_ms"]) > 0 for r in cub)
    assert all(int(r["chunks"]) > 1 for r in cub)
    # every variant agrees with the first of its kind (buffer_auto, primitive_tiles)
    checked = [r for r in rows if r["agree_with"]]
    assert {r["agree_with"] for r in checked} == {"buffer_auto", "primitive_tiles"}
    assert len(checked) == len(loss) - 1 + 3 + 1, [r["variant"] for r in checked]
    assert all(0 <= float(r["agree_rel"]) <= 2e-2 for r in checked), checked
    import gpu_perf

    # the policy variants beside the GRPO loss (tiny: one N, so no long-sequence rows)
    policy = {r["variant"]: r for r in rows if r["variant"].startswith("policy_")}
    assert set(policy) == {f"policy_{v}" for v in gpu_perf.POLICY}
    assert all(r["path"] == "single" and r["floor"] == "6NHV" for r in policy.values()), policy
    corr = [r for r in rows if r["variant"] == "correctness"]
    assert {"loss", "d_hidden", "d_weight", "single_pass_ran"} <= {r["quantity"] for r in corr}
    assert all(float(r["rel_err"]) <= float(r["tol"]) for r in corr), corr


def test_disagreement_flags_a_broken_variant():
    import gpu_perf

    want = [torch.ones(3), torch.ones(2, 2, dtype=torch.bfloat16)]
    assert gpu_perf.disagreement(want, want) == 0.0
    bad = [torch.ones(3), torch.full((2, 2), 1.5, dtype=torch.bfloat16)]
    got = gpu_perf.disagreement(bad, want)
    assert got == pytest.approx(0.5) and got > gpu_perf.AGREE_TOL
