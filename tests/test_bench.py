"""`fgrpo bench` at toy sizes: the CSV schema, the OOM paths, the plots and the markdown table
(the peers' adapters: test_bench_peers.py)."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fgrpo_kernels import cli, cpu_backend
from fgrpo_kernels.benchmarks import cli as bench_cli
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
    mp.setenv("FGRPO_BENCH_FAKE", "oom:liger (eager)")
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
    assert rows[0]["impl"] == "gemm"  # the floor's rate comes first
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
    liger = [r for r in rows if r["impl"] == "liger (eager)"]
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
    assert "| `liger (eager)` | oom |" in md
    assert "`ours` / `eager` (grpo fwd+bwd, N=128, B=8, V=512" in md
    assert "load average" in md.splitlines()[0]


def test_real_oom_under_a_memory_cap():
    # eager materialises 4096 × 32768 fp32 logits (512 MiB); allow it 64 MiB.
    case = tiny(impl="eager", tokens=4096, vocab=32768, max_mem_gib=1 / 16)
    result = measure.measure(case, "fork")
    assert result["status"] == "oom", result
    assert re.match(r"out of memory: tried to allocate \d+\.\d\d GiB; ", result["note"]), result


CPU_OOM = RuntimeError(
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 4294967296 bytes. Error code 12 (Cannot allocate memory)"
)


@pytest.mark.parametrize(
    "error, start",
    [
        (CPU_OOM, "out of memory: tried to allocate 4.00 GiB; RuntimeError: [enforce fail"),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has 80 GiB\nmore"),
         "out of memory: tried to allocate 2.50 GiB; RuntimeError: CUDA out of memory."),
        (MemoryError(), "MemoryError:"),
    ],
)  # fmt: skip
def test_oom_note_puts_the_size_first(error, start):
    note = measure.oom_note(error)
    assert note.startswith(start) and "\n" not in note, note


def test_markdown_keeps_the_oom_size_and_labels_both_times():
    def rec(impl, status, note=None, ms=None, cpu_ms=None):
        r = dict.fromkeys(report.COLUMNS)
        r.update(impl=impl, workload="grpo", pass_=None, tokens=4096, batch=8, vocab=32768,
                 hidden=128, dtype="float32", device="cpu", status=status, note=note,
                 time_ms=ms, cpu_time_ms=cpu_ms, peak_mem_mib=10.0 if ms else None)  # fmt: skip
        r["pass"] = "fwd+bwd"
        return r

    note = measure.oom_note(CPU_OOM)
    rows = [rec("eager", "oom", note), rec("ours", "ok", ms=100.0, cpu_ms=190.0),
            rec("liger", "ok", ms=400.0, cpu_ms=380.0)]  # fmt: skip
    md = report.markdown(rows)
    oom_line = next(line for line in md.splitlines() if "`eager`" in line)
    assert "out of memory: tried to allocate 4.00 GiB" in oom_line
    assert "| wall time ms | CPU time ms |" in md
    assert "memory 1×, wall time 0.25×, CPU time 0.5×" in md


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


def test_cuda_only_impl_is_unavailable_on_cpu(monkeypatch):
    result = measure.measure(tiny(impl="verl_triton", workload="logprobs"), "none")
    assert result["status"] == "unavailable" and "cuda only" in result["note"]
    # the Triton peers that run under the interpreter (the suite's) are unavailable without it
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    result = measure.measure(tiny(impl="liger_triton"), "none")
    assert result["status"] == "unavailable" and "cuda only" in result["note"]


def test_workload_a_peer_lacks_is_unavailable():
    result = measure.measure(tiny(impl="cce", workload="grpo"), "none")
    assert result["status"] == "unavailable" and "no grpo of its own" in result["note"]


def test_gpu_preset_dry_run(capsys):
    assert cli.main(["bench", "--preset", "gpu", "--device", "cpu", "--dry-run"]) == 0
    lines = [line.split("  ~")[0] for line in capsys.readouterr().out.splitlines()]
    # the materialising peers are listed at every size: the GPU's own out-of-memory bounds them
    assert "eager grpo fwd+bwd N=131072 B=8 V=151936 H=4096" in lines
    assert "ours grpo fwd+bwd N=131072 B=8 V=151936 H=4096" in lines
    assert "cce logprobs fwd+bwd N=131072 B=8 V=151936 H=4096" in lines


def test_spent_budget_skips_the_rest(tmp_path):
    out = bench(tmp_path, "--budget-s", "0", "--impls", "ours,eager")
    rows = report.read_csv(out / "results.csv")
    assert rows and all(r["status"] == "skipped" for r in rows)
    assert all("time budget of 0 s from process start" in r["note"] for r in rows)
    assert (out / "bench.png").read_bytes()[:8] == PNG


def test_process_age_counts_from_the_start_of_the_process():
    """Not from the first case: this pytest process imported torch and more before it."""
    import subprocess
    import sys

    age = bench_cli.process_age_s()
    assert 0 < age < 24 * 3600
    code = "import time; time.sleep(1.0); from fgrpo_kernels.benchmarks import cli; "
    code += "print(cli.process_age_s())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(out.stdout) >= 1.0  # the second before the import counts


def test_budget_counts_the_process_age(tmp_path, monkeypatch):
    """A process already older than the budget runs no case, whatever the first case costs."""
    monkeypatch.setattr(bench_cli, "process_age_s", lambda: 100.0)
    out = bench(tmp_path, "--budget-s", "99", "--impls", "ours")
    rows = report.read_csv(out / "results.csv")
    assert rows and {r["status"] for r in rows} == {"skipped"}


def test_cuda_case_that_would_not_fit_the_budget_is_skipped(tmp_path, monkeypatch):
    """CUDA cases run in-process (they cannot be stopped): one whose estimate exceeds what is
    left is skipped before it starts, its note giving both numbers."""
    monkeypatch.setattr(bench_cli, "process_age_s", lambda: 0.0)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(bench_cli, "machine", lambda: "a test machine")
    seen = []
    monkeypatch.setattr(measure, "measure", lambda case, isolation: seen.append(case))
    from fgrpo_kernels.benchmarks import estimate

    monkeypatch.setattr(estimate, "case_seconds", lambda case: 50.0)
    out = tmp_path / "o"
    argv = ["bench", "--preset", "gpu-quick", "--budget-s", "40", "--out", str(out)]
    assert cli.main(argv) == 0
    rows = report.read_csv(out / "results.csv")
    assert not seen and rows and {r["status"] for r in rows} == {"skipped"}
    assert "the case needs ~50 s (estimate)" in rows[0]["note"]


def test_report_is_rewritten_after_every_case(tmp_path, monkeypatch):
    """A run killed after its first case keeps that row in results.csv, results.md and the plot."""
    real = measure.measure
    calls = []

    def measure_then_die(case, isolation):
        calls.append(case)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the kill, after one finished case
        return real(case, isolation)

    monkeypatch.setattr(measure, "measure", measure_then_die)
    out = tmp_path / "out"
    argv = ["bench", "--preset", "tiny", "--device", "cpu", "--out", str(out), "--tokens", "64"]
    with pytest.raises(KeyboardInterrupt):
        cli.main(argv + ["--impls", "gemm,ours", "--repeats", "1"])
    rows = report.read_csv(out / "results.csv")
    assert [r["impl"] for r in rows] == ["gemm"]
    md = (out / "results.md").read_text()
    assert "| `gemm` | ok |" in md and "1 cases done" in md.splitlines()[0]
    assert (out / "bench.png").read_bytes()[:8] == PNG


def test_floor_uses_the_gemm_of_the_run_and_each_peers_k(tiny_run):
    rows = report.read_csv(tiny_run / "results.csv")
    gemm = {r["tokens"]: r for r in rows if r["impl"] == "gemm"}
    assert set(gemm) == {64, 128}
    for r in rows:
        if r["status"] != "ok":
            continue
        g = gemm[r["tokens"]]
        rate = 2 * r["tokens"] * r["hidden"] * r["vocab"] / (g["time_ms"] / 1e3)
        assert r["gemm_tflops"] == pytest.approx(rate / 1e12, rel=1e-3)
        floor_s = r["floor_k"] * r["tokens"] * r["hidden"] * r["vocab"] / rate
        assert r["flop_floor_ratio"] == pytest.approx(r["time_ms"] / 1e3 / floor_s, rel=2e-3)
    k = {(r["impl"], r["workload"], r["pass"]): r["floor_k"] for r in rows}
    assert k[("gemm", "gemm", "fwd")] == 2 and k[("ours", "logprobs", "fwd")] == 2
    assert k[("eager", "grpo", "fwd+bwd")] == 6  # the bf16/fp32 logits are kept for backward
    assert k[("ours_two_pass", "grpo", "fwd+bwd")] == 8  # the backward recomputes them
    assert k[("ours", "grpo", "fwd+bwd")] == 6  # single pass: the gradient in the forward
    assert "× floor (k)" in (tiny_run / "results.md").read_text()


def test_every_ok_peer_row_passed_the_oracle_check(tiny_run):
    rows = report.read_csv(tiny_run / "results.csv")
    checked = [r for r in rows if r["status"] == "ok" and r["impl"] != "gemm"]
    assert checked and all(r["check"] and r["check"].startswith("out ") for r in checked)
    assert all("dhidden" in r["check"] for r in checked if r["pass"] == "fwd+bwd")


def test_a_peer_that_fails_the_oracle_is_wrong_and_not_timed(monkeypatch):
    monkeypatch.setenv("FGRPO_BENCH_FAKE", "wrong:eager")
    result = measure.measure(tiny(impl="eager", workload="logprobs"), "none")
    assert result["status"] == "wrong" and "time_ms" not in result, result
    assert "against the float64 oracle: out" in result["note"]
    ok = measure.measure(tiny(impl="ours", workload="logprobs"), "none")  # only eager is off
    assert ok["status"] == "ok"


def test_dynamo_failure_gives_a_liger_eager_row(monkeypatch):
    """Liger's compiled loss failing in dynamo: the row is `liger (eager)`, its note the error."""
    import dataclasses

    import torch

    from fgrpo_kernels.benchmarks.peers import PEERS

    def broken(device):
        def step(w):
            torch._dynamo.graph_break()
            return w.hidden.sum()

        return torch.compile(step, fullgraph=True)

    peer = dataclasses.replace(PEERS["liger"], losses={"grpo": broken})
    monkeypatch.setitem(PEERS, "liger", peer)
    pytest.importorskip("liger_kernel")
    result = measure.measure(tiny(impl="liger"), "none")
    assert result["case"]["impl"] == "liger (eager)" and result["status"] == "ok", result
    assert result["note"].startswith("liger failed to compile (")
    assert "graph_break" in result["note"] or "Unsupported" in result["note"]


def test_cuda_dry_run_on_a_machine_without_cuda(capsys, monkeypatch):
    """The quick GPU plan prints with its estimate, within the 240 s budget, without CUDA."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert cli.main(["bench", "--device", "cuda", "--quick", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    cases = [line for line in out if "  ~" in line]
    impls = {line.split()[0] for line in cases}
    assert {"gemm", "liger_flce", "verl_triton", "ours_two_pass", "liger", "eager"} <= impls
    assert {"compile", "cce", "trl", "verl", "liger_triton", "ours"} <= impls
    assert {int(line.split("N=")[1].split()[0]) for line in cases} == {8192, 32768, 65536}
    assert all(" fwd+bwd " in line or line.startswith("gemm") for line in cases)
    assert all("V=151936 H=4096" in line for line in cases)
    total = float(out[-1].split("estimated ")[1].split(" s")[0])
    assert 100 < total <= 240 and "budget 240 s" in out[-1]
    assert cases[0].startswith("gemm gemm fwd N=8192")  # each size's GEMM first


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


LEAK_SCRIPT = """
import multiprocessing, multiprocessing.util, sys, time
from fgrpo_kernels.benchmarks import measure

def child(conn):
    global lock
    lock = multiprocessing.get_context("forkserver").Lock()  # a named semaphore, as tqdm's
    multiprocessing.util.Finalize(None, time.sleep, (0.5,), exitpriority=100)  # a slow exit
    conn.send("row")
    conn.close()

if __name__ == "__main__":
    sent, code = measure.run_forked(child, (), 60.0)
    print(sent, code)
"""


def test_forked_case_leaves_no_leaked_semaphore(tmp_path):
    """A CPU case's child that has sent its row exits by itself: killed at once, its semaphores
    were reported leaked by the resource tracker at exit (2 per `fgrpo bench --quick`)."""
    script = tmp_path / "leak.py"
    script.write_text(LEAK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["row", "0"]
    assert "leaked semaphore" not in done.stderr, done.stderr[-2000:]


def test_a_zero_flag_stays_in_the_recorded_command():
    """Regression: `command()` tested `value in (None, False)`, and 0 == False dropped
    `--warmup 0` from meta.json's command."""
    import argparse

    from fgrpo_kernels.benchmarks.cli import add_arguments, command

    p = argparse.ArgumentParser()
    add_arguments(p)
    recorded = command(p.parse_args(["--warmup", "0", "--quick"]))
    assert "--warmup 0" in recorded and "--quick" in recorded
    assert "--repeats" not in command(p.parse_args([]))


def test_a_variant_row_is_timed_by_turns_with_the_grpo_loss():
    """A policy variant's row also times our GRPO loss on the same tensors, by turns, and the
    report prints the median of the per-turn ratios beside the ratio of the two rows."""
    got = measure.measure_here(tiny(workload="policy:gmpo", repeats=3))
    assert got["status"] == "ok" and got["grpo_paired_ms"] > 0 and got["vs_grpo_paired"] > 0
    assert "vs_grpo_paired" not in measure.measure_here(tiny(repeats=1))
    rows = [report.flatten(measure.measure_here(tiny(repeats=1)), None), report.flatten(got, None)]
    (line,) = report.variant_ratios(rows)
    assert f"(paired, by turns: {rows[1]['vs_grpo_paired']:.3g}×)" in line


def test_a_csv_from_before_a_column_was_added_reads(tmp_path):
    old = [c for c in report.COLUMNS if c not in ("grpo_paired_ms", "vs_grpo_paired")]
    path = tmp_path / "results.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, old)
        w.writeheader()
        w.writerow({c: "" for c in old} | {"impl": "ours", "workload": "grpo", "time_ms": "2.5"})
    (rec,) = report.read_csv(path)
    assert rec["time_ms"] == 2.5 and rec["vs_grpo_paired"] is None
