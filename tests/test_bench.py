"""`fgrpo bench` at toy sizes: the CSV schema, the OOM paths, the plots and the markdown table."""

from __future__ import annotations

import csv
import dataclasses

import pytest

from fgrpo_kernels import cli, cpu_backend
from fgrpo_kernels.bench import measure, report
from fgrpo_kernels.bench.presets import PRESETS, Case

REQUIRED = ("impl", "tokens", "vocab", "hidden", "dtype", "pass", "time_ms", "peak_mem_mib")
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    # conftest interprets Triton; the bench children should take the CPU path a user gets.
    monkeypatch.setenv("FGRPO_BACKEND", "cpu")
    monkeypatch.delenv("FGRPO_BENCH_FAKE", raising=False)


def tiny(impl="ours_grpo", pass_="fwd+bwd", **kw) -> Case:
    fields = dict(tokens=64, vocab=512, hidden=32, dtype="float32", device="cpu", repeats=2)
    fields.update(min_time_s=0.0, timeout_s=120.0)
    fields.update(kw)
    return Case(impl, pass_, **fields)


def bench(tmp_path, *extra):
    out = tmp_path / "out"
    argv = ["bench", "--preset", "tiny", "--device", "cpu", "--out", str(out), *extra]
    assert cli.main(argv) == 0
    return out


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("FGRPO_BACKEND", "cpu")
    mp.setenv("FGRPO_BENCH_FAKE", "oom:liger_grpo")
    try:
        yield bench(tmp_path_factory.mktemp("bench"), "--tokens", "64,128", "--repeats", "1")
    finally:
        mp.undo()


def test_csv_schema(tiny_run):
    with (tiny_run / "results.csv").open(newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert tuple(reader.fieldnames) == report.COLUMNS
    assert set(REQUIRED) <= set(reader.fieldnames)
    expected = {(c.impl, c.pass_, c.tokens) for c, _ in PRESETS["tiny"].cases() if c.tokens <= 128}
    assert {(r["impl"], r["pass"], int(r["tokens"])) for r in rows} == expected
    for r in rows:
        assert r["status"] in ("ok", "oom", "skipped"), r
        assert (r["vocab"], r["hidden"], r["dtype"], r["device"]) == ("512", "32", "float32", "cpu")
        if r["status"] == "ok":
            assert float(r["time_ms"]) > 0 and float(r["peak_mem_mib"]) >= 0
            assert int(r["repeats"]) == 1 and r["backend"]
    ours = [r for r in rows if r["impl"].startswith("ours") and r["status"] == "ok"]
    # The CPU path's backend: the C++ ops when they build here, else the chunked PyTorch tiles.
    assert ours and {r["backend"] for r in ours} == {cpu_backend()}


def test_fake_oom_is_a_row(tiny_run):
    rows = report.read_csv(tiny_run / "results.csv")
    liger = [r for r in rows if r["impl"] == "liger_grpo"]
    assert liger and all(r["status"] == "oom" and r["time_ms"] is None for r in liger)
    assert "simulated out of memory" in liger[0]["note"]
    assert any(r["status"] == "skipped" for r in rows)  # ours_fgrpo is capped at N=64


def test_plots_are_pngs(tiny_run):
    for name in ("memory.png", "time.png"):
        data = (tiny_run / name).read_bytes()
        assert data[:8] == PNG and len(data) > 5000


def test_markdown_table(tiny_run, capsys):
    md = (tiny_run / "results.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert table[0].startswith("| pass | N | V | H | dtype | impl | status | time ms |")
    assert len(table) == 2 + len(report.read_csv(tiny_run / "results.csv"))
    assert "| `liger_grpo` | oom |" in md
    assert "`ours_grpo` / `eager_grpo` (fwd+bwd, N=128" in md


def test_real_oom_under_a_memory_cap():
    # eager materialises 4096 × 32768 fp32 logits (512 MiB); allow it 64 MiB.
    case = tiny(impl="eager_grpo", tokens=4096, vocab=32768, max_mem_gib=1 / 16)
    result = measure.measure(case, "fork")
    assert result["status"] == "oom", result
    assert "allocate" in result["note"]


def test_killed_worker_is_an_oom_row(monkeypatch):
    monkeypatch.setenv("FGRPO_BENCH_FAKE", "kill:*")
    result = measure.measure(tiny(), "fork")
    assert result["status"] == "oom" and "SIGKILL" in result["note"]


def test_exec_worker_and_timeout(monkeypatch):
    case = tiny(impl="ours_logprobs", pass_="fwd", min_time_s=60.0)  # repeats (2) is the cap
    result = measure.measure(case, "exec")
    assert result["status"] == "ok" and result["repeats"] == 2
    slow = dataclasses.replace(tiny(impl="ours_logprobs"), timeout_s=0.01)
    assert measure.measure(slow, "exec")["status"] == "timeout"


def test_error_is_a_row(monkeypatch):
    monkeypatch.setenv("FGRPO_BENCH_FAKE", "error:ours_grpo")
    result = measure.measure(tiny(), "none")
    assert result["status"] == "error" and "simulated error" in result["note"]


def test_cuda_only_impl_is_unavailable_on_cpu():
    result = measure.measure(tiny(impl="liger_triton_grpo"), "none")
    assert result["status"] == "unavailable"


def test_gpu_preset_dry_run(capsys):
    assert cli.main(["bench", "--preset", "gpu", "--device", "cpu", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "skip eager_grpo fwd+bwd N=65536 V=151936 H=4096" in lines
    assert "ours_grpo fwd+bwd N=131072 V=151936 H=4096" in lines


def test_spent_budget_skips_the_rest(tmp_path):
    out = bench(tmp_path, "--budget-s", "0", "--impls", "ours_grpo,eager_grpo")
    rows = report.read_csv(out / "results.csv")
    assert rows and all(r["status"] == "skipped" for r in rows)
    assert all("time budget" in r["note"] for r in rows)
    assert (out / "memory.png").read_bytes()[:8] == PNG
