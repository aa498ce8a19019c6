"""`fgrpo bench --preset train-gpu`: one GRPO optimizer step of a Qwen2.5-1.5B-shaped model.
On the CPU, `--tiny` runs the same step of a 2-layer toy; the GPU preset's shape, sizes, budget
and memory skip are checked without a GPU."""

from __future__ import annotations

import pytest
import torch

from fgrpo_kernels import cli
from fgrpo_kernels.benchmarks import report, train_gpu
from fgrpo_kernels.benchmarks.presets import PRESETS, Case, Policy

pytest.importorskip("trl")


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("FGRPO_BACKEND", "cpu")
    monkeypatch.delenv("FGRPO_BENCH_FAKE", raising=False)


def test_tiny_runs_one_optimizer_step_per_impl(tmp_path):
    out = tmp_path / "out"
    assert cli.main(["bench", "--preset", "train-gpu", "--tiny", "--out", str(out)]) == 0
    rows = {r["impl"]: r for r in report.read_csv(out / "results.csv")}
    assert set(rows) == {"trl", "trl_liger_kernel", "ours"}
    assert rows["trl_liger_kernel"]["status"] == "unavailable"
    assert "CUDA only" in rows["trl_liger_kernel"]["note"]
    for impl in ("trl", "ours"):
        r = rows[impl]
        assert r["status"] == "ok" and r["workload"] == "train-gpu" and r["device"] == "cpu", r
        assert r["time_ms"] > 0 and r["peak_mem_mib"] is not None
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / (r["time_ms"] / 1e3), rel=1e-3)
        assert "gradient checkpointing" in r["note"] and "AdamW" in r["note"]
    # the same step: the loss of the last timed step (after the same AdamW updates) agrees
    assert rows["ours"]["checksum"] == pytest.approx(rows["trl"]["checksum"], rel=1e-4)
    md = (out / "results.md").read_text()
    assert "tokens/s" in md.splitlines()[2]


def test_one_step_moves_the_weights_and_checkpoints():
    case = Case("ours", "train-gpu", "fwd+bwd", 2 * 16, 301, 32, "float32", "cpu", 2, Policy())
    job = train_gpu.TrainGpuJob(case)
    assert getattr(job.model, "is_activation_checkpointing", None) or (
        job.model.is_gradient_checkpointing
    )
    before = [p.detach().clone() for p in job.model.parameters()]
    job.run()
    after = list(job.model.parameters())
    assert all(p.grad is None for p in after)  # zero_grad after the step
    moved = sum(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert moved == len(before)  # AdamW moved every parameter


def test_the_gpu_shape_is_qwen25_1_5b():
    from transformers import Qwen2ForCausalLM

    cfg = train_gpu.config(151936, 1536, 1024)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (28, 12, 2)
    assert cfg.intermediate_size == 8960 and cfg.tie_word_embeddings
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    count = sum(p.numel() for p in model.parameters())
    assert train_gpu.parameters(cfg) == count
    assert 1.5e9 < count < 1.6e9


def test_train_gpu_preset_sizes_and_budget():
    preset = PRESETS["train-gpu"]
    cases = preset.cases()
    assert {c.impl for c in cases} == {"trl", "trl_liger_kernel", "ours"}
    assert {(c.generations, c.seq_len) for c in cases} == {(2, 8192), (2, 32768)}
    assert {(c.device, c.dtype, c.vocab, c.hidden) for c in cases} == {
        ("cuda", "bfloat16", 151936, 1536)
    }
    assert preset.budget_s == 120


def test_a_case_that_does_not_fit_is_skipped_with_its_estimate(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (8 * 2**30, 80 * 2**30))
    case = PRESETS["train-gpu"].cases()[-1]
    why = train_gpu.unavailable(case)
    assert why.startswith("skipped: needs ~") and "8 GiB free" in why
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (130 * 2**30, 140 * 2**30))
    assert train_gpu.unavailable(case) is None


def test_dry_run_fits_its_budget(capsys):
    assert cli.main(["bench", "--preset", "train-gpu", "--dry-run"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("6 cases, estimated ") and "(budget 120 s)" in last
    assert float(last.split("estimated ")[1].split(" s")[0]) <= 120
