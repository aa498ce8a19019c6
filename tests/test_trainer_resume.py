"""Resuming and interrupting `fgrpo train`: a resumed run repeats the uninterrupted one exactly
(weights, optimizer, scheduler, step, every random stream, the original reference); metrics
are appended, each step once; SIGINT/SIGTERM leave a loadable final checkpoint and a summary."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from fgrpo_kernels.cli import main  # noqa: E402
from fgrpo_kernels.trainer import run_dir  # noqa: E402

from .trainer_common import TRAIN, cpu_path, metrics  # noqa: E402, F401

pytestmark = pytest.mark.usefixtures("cpu_path")


def shell_env() -> dict:
    # the chunked CPU path: no C++ build in a child process; threads fixed by --threads
    return dict(os.environ, FGRPO_BACKEND="cpu", FGRPO_CPU_BACKEND="torch")


def fgrpo(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "fgrpo_kernels.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=shell_env())


def test_resume_repeats_the_uninterrupted_run(tmp_path, monkeypatch):
    """A dataset run (epoch sampler, held-out eval, a custom reward, cosine schedule with
    warm-up) interrupted by SIGINT at step 6 of 12 and resumed logs what the uninterrupted
    run logs, step for step."""
    rows = [{"prompt": f"{a}{b}?", "answer": str((a + b) % 10)} for a in range(7) for b in range(3)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "ctrl_c.py").write_text(
        "import os, signal\n"
        "def right(completions, answer, trainer_state, **kwargs):\n"
        "    if trainer_state.global_step == 5 and os.environ.get('CTRL_C_AT_STEP_6'):\n"
        "        os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C during step 6\n"
        "    return [float(c == a) for c, a in zip(completions, answer)]\n"
    )
    common = [
        "--prompts", str(data), "--reward", f"{tmp_path}/ctrl_c.py:right", "--reward",
        "pattern", "--prompts-per-step", "4", "--num-generations", "4", "--scheduler",
        "cosine", "--warmup-steps", "3", "--eval-every", "4", "--eval-size", "5",
        "--eval-temperature", "0.7", "--save-every", "4", "--lr", "1e-2", "--steps", "12",
    ]  # fmt: skip
    assert main([*TRAIN, "--out", str(tmp_path / "a"), *common]) == 0
    monkeypatch.setenv("CTRL_C_AT_STEP_6", "1")
    assert main([*TRAIN, "--out", str(tmp_path / "b"), *common]) == 130
    assert [r["step"] for r in metrics(tmp_path / "b")] == [1, 2, 3, 4, 5, 6]
    monkeypatch.delenv("CTRL_C_AT_STEP_6")
    assert main([*TRAIN, "--out", str(tmp_path / "b"), "--resume"]) == 0
    a, b = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [r["step"] for r in b] == list(range(1, 13))
    for ra, rb in zip(a, b):
        assert ra["loss"] == pytest.approx(rb["loss"], abs=1e-6), ra["step"]
        assert ra["sample"] == rb["sample"] and ra["reward_mean"] == rb["reward_mean"]
        assert ra["lr"] == pytest.approx(rb["lr"], rel=1e-12)
        assert ra.get("eval/reward_mean") == rb.get("eval/reward_mean")
    assert b[6]["loss"] != 0.0 and "eval/pass_rate" in b[7] and "eval/pass_rate" in b[11]
    assert b[-1]["time_s"] > b[5]["time_s"]  # the clock continues across the sessions
    wa = torch.load(tmp_path / "a" / "final" / "trainer_state.pt", weights_only=True)
    wb = run_dir.load_state(tmp_path / "b" / "final")
    assert wa["step"] == wb["step"] == 12 and wa["sampler"] == wb["sampler"]
    for pa, pb in zip(wa["optimizer"]["state"].values(), wb["optimizer"]["state"].values()):
        torch.testing.assert_close(pa["exp_avg"], pb["exp_avg"], rtol=1e-5, atol=1e-8)


def test_resume_keeps_the_run_as_it_was_started(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TRAIN, "--out", str(out), "--steps", "2", "--loss", "gift"]) == 0
    for args, message in [
        (["--steps", "4", "--loss", "grpo"], "--loss: the run .* was started with 'gift'"),
        (["--steps", "4", "--lr", "0.1"], "--lr: the run .* was started with 0.003"),
        (["--steps", "4", "--overwrite"], "--resume: --resume continues the run"),
    ]:
        assert main([*TRAIN, "--out", str(out), "--resume", *args]) == 2, args
        assert re.match(f"fgrpo train: error: {message}", capsys.readouterr().err), args
    assert main([*TRAIN, "--out", str(out), "--resume", "--steps", "3", "--loss", "gift"]) == 0
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]
    assert json.loads((out / "summary.json").read_text())["loss"] == "gift"


def test_steps_logged_after_the_last_checkpoint_are_run_again_once(tmp_path):
    """A run that died after logging steps past its last checkpoint: those steps are moved to
    metrics.rolled_back.jsonl and run again, so metrics.jsonl holds each step once."""
    out = tmp_path / "run"
    assert main([*TRAIN, "--out", str(out), "--steps", "5", "--save-every", "3"]) == 0
    shutil.rmtree(out / "final")  # as if killed at once after step 5
    assert run_dir.latest_checkpoint(out).name == "checkpoint-3"
    before = metrics(out)
    assert main([*TRAIN, "--out", str(out), "--steps", "6", "--resume"]) == 0
    after = metrics(out)
    assert [r["step"] for r in after] == [1, 2, 3, 4, 5, 6]
    rolled = [json.loads(x) for x in (out / "metrics.rolled_back.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rolled] == [4, 5]
    assert after[3]["loss"] == pytest.approx(before[3]["loss"], abs=1e-6)  # step 4 again


def start_run(out: Path, *extra: str) -> subprocess.Popen:
    """A long run in a child process, returned once it has logged two steps; its stderr goes
    to out.stderr (a file, to be read while it runs)."""
    command = [sys.executable, "-m", "fgrpo_kernels.cli", "train", "--out", str(out)]
    command += ["--steps", "100000", "--no-progress", *extra]
    err = open(out.with_suffix(".stderr"), "w")  # noqa: SIM115 - the child holds it
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True, env=shell_env())
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        log = out / "metrics.jsonl"
        if log.exists() and len(log.read_text().splitlines()) >= 2:
            return proc
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"the run never logged two steps: {stderr_of(out)}")


def stderr_of(out: Path) -> str:
    return out.with_suffix(".stderr").read_text()


def wait_for(proc, out: Path, text: str) -> None:
    deadline = time.monotonic() + 60
    while text not in stderr_of(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_finishes_the_step_and_writes_final_summary_and_plots(tmp_path, sig):
    out = tmp_path / "run"
    proc = start_run(out)
    proc.send_signal(sig)
    stdout, _ = proc.communicate(timeout=120)
    stderr = stderr_of(out)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and f"{sig.name}: finishing this step" in stderr
    steps = [r["step"] for r in metrics(out)]
    assert steps == list(range(1, len(steps) + 1))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted_by"] == sig.name and summary["steps"] == steps[-1]
    assert (out / "training.png").stat().st_size > 10_000
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "final")  # loadable
    assert model.config.vocab_size == 19
    assert run_dir.checkpoint_step(out / "final") == steps[-1]
    assert f"stopped by {sig.name} at step {steps[-1]}" in stdout


def test_a_second_signal_stops_at_once(tmp_path):
    out = tmp_path / "run"
    proc = start_run(out)
    proc.send_signal(signal.SIGINT)
    wait_for(proc, out, "SIGINT: finishing this step")  # signals sent together may merge
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    stderr = stderr_of(out)
    assert proc.returncode == 130 and "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1].startswith("fgrpo train: stopped at once"), stderr


def test_the_two_commands_as_a_user_types_them(tmp_path, monkeypatch):
    """`fgrpo train --out D --steps 30 --save-every 10`, then `fgrpo train --out D --steps 60
    --resume`: steps 1..60 once each, and step 31 equals an uninterrupted 60-step run's
    (run here, in-process, on the same CPU path as the shell's)."""
    d, whole = str(tmp_path / "D"), str(tmp_path / "whole")
    first = fgrpo("train", "--out", d, "--steps", "30", "--save-every", "10", "--no-progress")
    assert first.returncode == 0, first.stderr
    second = fgrpo("train", "--out", d, "--steps", "60", "--resume", "--no-progress")
    assert second.returncode == 0, second.stderr
    assert "30 steps in" in second.stdout and "(steps 31-60, resumed)" in second.stdout
    monkeypatch.setenv("FGRPO_CPU_BACKEND", "torch")
    assert main([*TRAIN, "--out", whole, "--steps", "60"]) == 0
    resumed, uninterrupted = metrics(Path(d)), metrics(Path(whole))
    assert [r["step"] for r in resumed] == list(range(1, 61))
    assert resumed[30]["step"] == 31
    assert resumed[30]["loss"] == pytest.approx(uninterrupted[30]["loss"], abs=1e-6)
    assert resumed[30]["loss"] != 0.0
    assert [r["reward_mean"] for r in resumed] == [r["reward_mean"] for r in uninterrupted]
    names = sorted(p.name for p in Path(d).glob("checkpoint-*"))
    assert names == [f"checkpoint-{n}" for n in (10, 20, 30, 40, 50, 60)]
    assert run_dir.checkpoint_step(Path(d) / "final") == 60


FINALISER = """
import os, signal, time
from fgrpo_kernels.trainer.signals import GracefulStop

class Dropped:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C lands inside a finaliser
        time.sleep(1)

with GracefulStop(lambda: print("finishing", flush=True), None, "stopped at once"):
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1)
    Dropped()
    print("went on", flush=True)
"""


def test_regression_a_second_signal_inside_a_finaliser_still_stops():
    """A KeyboardInterrupt raised in a __del__ is printed with a traceback and dropped (seen in
    test_a_second_signal_stops_at_once under load); the second signal exits at once instead."""
    done = subprocess.run(
        [sys.executable, "-c", FINALISER], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 130, done.stderr
    assert done.stdout.splitlines() == ["finishing"], done.stdout
    assert done.stderr.strip() == "stopped at once" and "Traceback" not in done.stderr
