"""`fgrpo bench` at toy sizes: the CSV schema, the OOM paths, the plots and the markdown table
(the peers' adapters: test_bench_peers.py)."""

from __future__ import annotations

import csv
import json
import shutil

import pytest

from fgrpo_kernels import cli, cpu_backend
from fgrpo_kernels.benchmarks import measure, report
from fgrpo_kernels.benchmarks.presets import PRESETS, Case, Policy

REQUIRED = (
    "impl",
    "workload",
    "tokens",
    "vocab",
    "hidden",
    "dtype",
    "pass",
    "time_ms",
    "peak_mem_mib",
)
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    # conftest interprets Triton; the bench children should take the CPU path a user gets.
    monkeypatch.setenv("FGRPO_BACKEND", "cpu")
    monkeypatch.delenv("FGRPO_BENCH_FAKE", raising=False)


def tiny(impl="ours", workload="grpo", pass_="fwd+bwd", **kw) -> Case:
    policy = dict(repeats=2, min_time_s=0.0, timeout_s=120.0)
    policy.update({k: kw.pop(k) for k in list(kw) if k in Policy.__dataclass_fields__})
    fields = dict(tokens=64, vocab=512, hidden=32, dtype="float32", device="cpu")
    fields.update(kw)
    return Case(impl, workload, pass_, policy=Policy(**policy), **fields)


def bench(tmp_path, *extra):
    out = tmp_path / "out"
    argv = ["bench", "--preset", "tiny", "--device", "cpu", "--out", str(out), *extra]
    assert cli.main(argv) == 0
    return out


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("FGRPO_BACKEND", "cpu")
    mp.setenv("FGRPO_BENCH_FAKE", "oom:liger")
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
    expected = {(c.impl, c.workload, c.pass_, c.tokens) for c in PRESETS["tiny"].cases()}
    assert {(r["impl"], r["workload"], r["pass"], int(r["tokens"])) for r in rows} == expected
    for r in rows:
        assert r["status"] in ("ok", "oom"), r
        assert (r["vocab"], r["hidden"], r["dtype"], r["device"]) == ("512", "32", "float32", "cpu")
        if r["status"] == "ok":
            assert float(r["time_ms"]) > 0 and float(r["peak_mem_mib"]) >= 0
            assert int(r["repeats"]) == 1 and r["backend"]
            assert float(r["case_s"]) > 0 and float(r["process_cpu_s"]) > 0
    ours = [r for r in rows if r["impl"] == "ours" and r["status"] == "ok"]
    # The CPU path's backend: the C++ ops when they build here, else the chunked PyTorch tiles.
    assert ours and {r["backend"] for r in ours} == {cpu_backend()}


def test_fake_oom_is_a_row(tiny_run):
    rows = report.read_csv(tiny_run / "results.csv")
    liger = [r for r in rows if r["impl"] == "liger"]
    assert liger and all(r["status"] == "oom" and r["time_ms"] is None for r in liger)
    assert "simulated out of memory" in liger[0]["note"]
    # a preset lists what it runs: ours fgrpo is capped at N=64, so there is no N=128 row
    assert {r["tokens"] for r in rows if r["workload"] == "fgrpo"} == {64}


def test_same_work_same_checksum(tiny_run):
    rows = report.read_csv(tiny_run / "results.csv")
    grpo = [r for r in rows if r["workload"] == "grpo"]
    eager, ours = (
        {r["tokens"]: r["checksum"] for r in grpo if r["impl"] == i} for i in ("eager", "ours")
    )
    assert set(eager) == set(ours) == {64, 128}
    for n in eager:
        assert eager[n] == pytest.approx(ours[n], rel=1e-4, abs=1e-6)


def test_plot_is_a_png(tiny_run):
    data = (tiny_run / "bench.png").read_bytes()
    assert data[:8] == PNG and len(data) > 5000


def test_markdown_table(tiny_run, capsys):
    md = (tiny_run / "results.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert table[0].startswith("| workload | pass | N | B | V | H | dtype | impl | status |")
    assert len(table) == 2 + len(report.read_csv(tiny_run / "results.csv"))
    assert "| `liger` | oom |" in md
    assert "`ours` / `eager` (grpo fwd+bwd, N=128, B=8, V=512" in md
    assert "load average" in md.splitlines()[0]


def test_real_oom_under_a_memory_cap():
    # eager materialises 4096 × 32768 fp32 logits (512 MiB); allow it 64 MiB.
    case = tiny(impl="eager", tokens=4096, vocab=32768, max_mem_gib=1 / 16)
    result = measure.measure(case, "fork")
    assert result["status"] == "oom", result
    assert "allocate" in result["note"]


def test_killed_worker_is_an_oom_row(monkeypatch):
    monkeypatch.setenv("FGRPO_BENCH_FAKE", "kill:*")
    result = measure.measure(tiny(), "fork")
    assert result["status"] == "oom" and "SIGKILL" in result["note"]


def test_exec_worker_and_timeout(monkeypatch):
    case = tiny(workload="logprobs", pass_="fwd", min_time_s=60.0)  # repeats (2) is the cap
    result = measure.measure(case, "exec")
    assert result["status"] == "ok" and result["repeats"] == 2
    slow = tiny(workload="logprobs", timeout_s=0.01)
    assert measure.measure(slow, "exec")["status"] == "timeout"


def test_error_is_a_row(monkeypatch):
    monkeypatch.setenv("FGRPO_BENCH_FAKE", "error:ours")
    result = measure.measure(tiny(), "none")
    assert result["status"] == "error" and "simulated error" in result["note"]


def test_cuda_only_impl_is_unavailable_on_cpu():
    result = measure.measure(tiny(impl="liger_triton"), "none")
    assert result["status"] == "unavailable" and "cuda only" in result["note"]


def test_workload_a_peer_lacks_is_unavailable():
    result = measure.measure(tiny(impl="cce", workload="grpo"), "none")
    assert result["status"] == "unavailable" and "no grpo of its own" in result["note"]


def test_gpu_preset_dry_run(capsys):
    assert cli.main(["bench", "--preset", "gpu", "--device", "cpu", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # the materialising peers are listed at every size: the GPU's own out-of-memory bounds them
    assert "eager grpo fwd+bwd N=131072 B=8 V=151936 H=4096" in lines
    assert "ours grpo fwd+bwd N=131072 B=8 V=151936 H=4096" in lines
    assert "cce logprobs fwd+bwd N=131072 B=8 V=151936 H=4096" in lines


def test_spent_budget_skips_the_rest(tmp_path):
    out = bench(tmp_path, "--budget-s", "0", "--impls", "ours,eager")
    rows = report.read_csv(out / "results.csv")
    assert rows and all(r["status"] == "skipped" for r in rows)
    assert all("time budget" in r["note"] for r in rows)
    assert (out / "bench.png").read_bytes()[:8] == PNG


def test_replot_redraws_from_the_csv(tiny_run, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(tiny_run, out)
    (out / "bench.png").unlink()
    (out / "results.md").unlink()
    assert cli.main(["bench", "--replot", "--out", str(out)]) == 0
    assert (out / "bench.png").read_bytes()[:8] == PNG
    assert (out / "results.md").read_text() == (tiny_run / "results.md").read_text()


def test_replot_of_an_interrupted_run(tiny_run, tmp_path):
    out = tmp_path / "cut"
    shutil.copytree(tiny_run, out)
    meta = json.loads((out / "meta.json").read_text())
    del meta["wall_s"], meta["load_average_after"]  # what the run writes before its first case
    (out / "meta.json").write_text(json.dumps(meta))
    assert cli.main(["bench", "--replot", "--out", str(out)]) == 0
    assert "interrupted" in (out / "results.md").read_text().splitlines()[0]


def test_vocab_parallel_case_on_two_ranks():
    """The distributed case: 1 and 2 CPU ranks run the same loss (same checksum), each row with
    per-rank peak memory, time and the bytes sent per call."""
    rows = {}
    for impl in ("ours_1rank", "ours_2ranks"):
        case = Case(impl, "vocab-parallel", "fwd+bwd", 256, 301, 16, "float32", "cpu", 8,
                    Policy(repeats=1, min_time_s=0.0, timeout_s=240.0))  # fmt: skip
        rows[impl] = measure.measure(case)
        assert rows[impl]["status"] == "ok", rows[impl]
        assert rows[impl]["peak_mem_mib"] > 0 and rows[impl]["time_ms"] > 0
        assert "bytes sent into collectives per call" in rows[impl]["note"]
    assert rows["ours_1rank"]["checksum"] == pytest.approx(rows["ours_2ranks"]["checksum"])


def test_single_pass_script_measures_every_impl(tmp_path):
    """bench/single_pass.py at toy size: a row per impl from its own process, the same loss."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "single_pass.py"
    out = tmp_path / "results.json"
    args = ["--N", "64", "--V", "96", "--H", "8", "--rounds", "1", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["impl"] for r in rows] == ["two_pass", "single", "eager", "liger"]
    assert all("error" not in r for r in rows), rows
    assert len({round(r["loss"], 5) for r in rows}) == 1, rows
    assert "| single | " in done.stdout
