"""`fgrpo train` left alone: bounded disk (--save-total-limit), one writer per run folder (the
lock), a full disk that loses nothing (fault injection at every kind of write, and a real small
tmpfs where the machine lets a user namespace mount one), TensorBoard logging, and the
messages of a finished or never-saved run."""

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from fgrpo_kernels.cli import main  # noqa: E402
from fgrpo_kernels.trainer import lock, report, run_dir, writes  # noqa: E402

from .test_trainer_resume import shell_env, start_run  # noqa: E402
from .trainer_common import TRAIN, cpu_path, metrics  # noqa: E402, F401

pytestmark = pytest.mark.usefixtures("cpu_path", "torch_cpu_path")
SMALL = ["--prompts-per-step", "4", "--num-generations", "4", "--chance-samples", "0"]


@pytest.fixture
def torch_cpu_path(monkeypatch):
    """The chunked CPU path, as in the child processes (`shell_env`): a run that a child
    starts and this process resumes repeats an uninterrupted one float for float."""
    monkeypatch.setenv("FGRPO_CPU_BACKEND", "torch")


def train(out: Path, *args: str) -> int:
    return main([*TRAIN, "--out", str(out), *SMALL, *args])


def checkpoints(out: Path) -> list[str]:
    return sorted((p.name for p in out.glob("checkpoint-*")), key=lambda n: int(n.split("-")[1]))


def assert_same_run(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert ra["loss"] == pytest.approx(rb["loss"], abs=1e-6), ra["step"]
        assert (ra["sample"], ra["reward_mean"]) == (rb["sample"], rb["reward_mean"]), ra["step"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The metrics of an uninterrupted 5-step run (checkpoints at 2 and 4)."""
    out = tmp_path_factory.mktemp("whole") / "run"
    mp = pytest.MonkeyPatch()
    mp.setenv("FGRPO_BACKEND", "cpu")
    mp.setenv("FGRPO_CPU_BACKEND", "torch")
    try:
        assert train(out, "--steps", "5", "--save-every", "2") == 0
    finally:
        mp.undo()
    return metrics(out)


# --- 1. rotation ----------------------------------------------------------------------------


def test_save_total_limit_keeps_the_newest_checkpoints_and_final(tmp_path, uninterrupted):
    out = tmp_path / "run"
    assert train(out, "--steps", "4", "--save-every", "1", "--save-total-limit", "2") == 0
    assert checkpoints(out) == ["checkpoint-3", "checkpoint-4"]
    assert run_dir.checkpoint_step(out / "final") == 4
    assert train(out, "--resume", "--steps", "5", "--save-total-limit", "1") == 0
    assert checkpoints(out) == ["checkpoint-5"] and (out / "final").is_dir()
    assert_same_run(metrics(out), uninterrupted)


KILL_IN_ROTATION = """
import os, signal, sys
from fgrpo_kernels.cli import main
from fgrpo_kernels.trainer import run_dir

real = run_dir._remove_checkpoint

def killed(path):
    if {halfway}:  # the old checkpoint unmarked and half deleted
        (path / run_dir.STATE_JSON).unlink()
        (path / "model.safetensors").unlink()
    os.kill(os.getpid(), signal.SIGKILL)

run_dir._remove_checkpoint = killed
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("halfway", [False, True], ids=["before-deleting", "halfway-deleting"])
def test_sigkill_in_the_middle_of_a_rotation_still_resumes(tmp_path, uninterrupted, halfway):
    """SIGKILL after checkpoint-3 is renamed into place, while checkpoint-2 goes: the resume
    continues from checkpoint-3 and repeats the uninterrupted run."""
    out = tmp_path / "run"
    script = tmp_path / "kill.py"
    script.write_text(KILL_IN_ROTATION.format(halfway=halfway))
    args = ["train", "--no-progress", "--out", str(out), *SMALL, "--steps", "5"]
    args += ["--save-every", "1", "--save-total-limit", "2"]
    proc = subprocess.run(
        [sys.executable, str(script), *args], env=shell_env(), capture_output=True, timeout=180
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert run_dir.latest_checkpoint(out).name == "checkpoint-3"
    assert train(out, "--resume") == 0
    assert checkpoints(out) == ["checkpoint-4", "checkpoint-5"]
    assert_same_run(metrics(out), uninterrupted)


# --- 2. the lock ----------------------------------------------------------------------------


def test_a_second_process_on_a_running_folder_is_refused_with_the_pid(tmp_path, capsys):
    out = tmp_path / "run"
    proc = start_run(out, *SMALL, "--save-every", "1")
    try:
        for extra in (["--resume", "--steps", "1"], ["--overwrite", "--steps", "1"], []):
            assert train(out, *extra) == 2, extra
            err = capsys.readouterr().err
            assert len(err.strip().splitlines()) == 1, err
            assert re.match(r"fgrpo train: error: --out: .* is in use by another fgrpo train "
                            rf"\(PID {proc.pid} on ", err), err  # fmt: skip
        assert (out / "metrics.jsonl").is_file()  # --overwrite deleted nothing
    finally:
        proc.kill()
        proc.wait(timeout=60)
    done = run_dir.checkpoint_step(run_dir.latest_checkpoint(out))
    assert train(out, "--resume", "--steps", str(done + 1)) == 0
    err = capsys.readouterr().err
    assert f"taking over {out / lock.NAME}, left by PID {proc.pid} on " in err, err
    assert [r["step"] for r in metrics(out)] == list(range(1, done + 2))
    assert (out / lock.NAME).read_text() == ""  # released at the end


def test_a_lock_file_of_a_process_that_is_gone_is_taken_over(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--steps", "1") == 0
    (out / lock.NAME).write_text("4242424 somehost 2026-12-04 10:00:00\n")  # after a reboot
    assert train(out, "--resume", "--steps", "2") == 0
    err = capsys.readouterr().err
    assert "taking over" in err and "left by PID 4242424 on somehost" in err


def test_lock_check_names_a_live_holder(tmp_path):
    held = lock.RunLock(tmp_path).acquire()
    try:
        with pytest.raises(ValueError, match=rf"^out: .* \(PID {os.getpid()} on "):
            lock.check(tmp_path)
        with pytest.raises(ValueError, match="in use by another fgrpo train"):
            lock.RunLock(tmp_path).acquire()
    finally:
        held.release()
    lock.check(tmp_path)  # free again


# --- 3. a full disk -------------------------------------------------------------------------


def enospc(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def fail_on_call(monkeypatch, owner, name: str, nth: int, when=lambda *a, **k: True):
    """Patch owner.name so that its nth call for which `when` holds raises ENOSPC."""
    real, seen = getattr(owner, name), []

    def patched(*args, **kwargs):
        if when(*args, **kwargs):
            seen.append(1)
            if len(seen) == nth:
                enospc()
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, patched)


def half_then_enospc(monkeypatch, nth_line: int):
    """The nth metrics line is half written, then the disk is full."""
    real, seen = writes._write_all, []

    def patched(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(run_dir.METRICS):
            seen.append(1)
            if len(seen) == nth_line:
                os.write(fd, data[: len(data) // 2])
                enospc()
        real(fd, data)

    monkeypatch.setattr(writes, "_write_all", patched)


def inject(kind: str, monkeypatch):
    """A full disk at: the trainer state of checkpoint-4, its weights, step 5's metrics line,
    final/'s trainer state, summary.json, training.png. Returns (the file the error names,
    the checkpoint left to resume from)."""
    from transformers import PreTrainedModel

    if kind == "checkpoint-state":
        fail_on_call(monkeypatch, torch, "save", 2)
        return "checkpoint-4.tmp/trainer_state.pt", "checkpoint-2"
    if kind == "checkpoint-weights":
        fail_on_call(monkeypatch, PreTrainedModel, "save_pretrained", 2)
        return "checkpoint-4.tmp", "checkpoint-2"
    if kind == "metrics-line":
        half_then_enospc(monkeypatch, 5)
        return run_dir.METRICS, "checkpoint-4"
    if kind == "final":
        fail_on_call(monkeypatch, torch, "save", 3)
        return "final.tmp/trainer_state.pt", "checkpoint-4"
    if kind == "summary":
        is_summary = lambda self, *a, **k: self.name == "summary.json.tmp"  # noqa: E731
        fail_on_call(monkeypatch, Path, "write_text", 1, is_summary)
        return "summary.json", "final"
    import matplotlib.figure

    fail_on_call(monkeypatch, matplotlib.figure.Figure, "savefig", 1)
    return "training.png", "final"


KINDS = ["checkpoint-state", "checkpoint-weights", "metrics-line", "final", "summary", "plot"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_full_disk_stops_with_one_line_and_loses_nothing(
    tmp_path, monkeypatch, capsys, uninterrupted, kind
):
    out = tmp_path / "run"
    with monkeypatch.context() as m:
        named, left = inject(kind, m)
        assert train(out, "--steps", "5", "--save-every", "2") == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert re.fullmatch(
        rf"fgrpo train: error: --out: cannot write \S*{re.escape(named)}: No space left on "
        r"device \([\d.]+ \w+ free\)", err
    ), err  # fmt: skip
    assert not list(out.glob("*.tmp"))  # a failed checkpoint gives its space back
    assert run_dir.latest_checkpoint(out).name == left
    run_dir.load_state(out / left)  # intact and loadable
    text = (out / run_dir.METRICS).read_text()
    assert text.endswith("\n") and all(json.loads(x) for x in text.splitlines())
    code = train(out, "--resume")
    assert code == 0
    assert_same_run(metrics(out), uninterrupted)


def test_append_line_cuts_a_failed_line_back(tmp_path, monkeypatch):
    path = tmp_path / "m.jsonl"
    writes.append_line(path, '{"step": 1}')
    half_then_enospc(monkeypatch, 1)
    monkeypatch.setattr(run_dir, "METRICS", "m.jsonl")
    with pytest.raises(writes.RunFolderError, match=r"^out: cannot write .*m.jsonl"):
        writes.append_line(path, '{"step": 2}')
    assert path.read_text() == '{"step": 1}\n'


TMPFS = """
set -e
mount -t tmpfs -o size={size} tmpfs {mnt}
set +e
{python} -m fgrpo_kernels.cli train --no-progress --out {mnt}/run {args}
code=$?
cp -a {mnt}/run {copy}
exit $code
"""


def on_tmpfs(tmp_path: Path, size: str, *args: str) -> subprocess.CompletedProcess:
    """`fgrpo train` on a fresh tmpfs of `size` (a user namespace of its own); the run folder
    is copied to tmp_path/copy afterwards. Skips where the machine allows no such mount."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) to mount a small tmpfs")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"user namespaces are not allowed here: {probe.stderr.decode().strip()}")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = TMPFS.format(
        size=size, mnt=mnt, python=sys.executable, args=" ".join(args), copy=tmp_path / "copy"
    )
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], env=shell_env(), capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip


def test_a_real_full_tmpfs_then_resume_elsewhere(tmp_path, uninterrupted):
    """A 3 MiB tmpfs holds two checkpoints of the tiny model (1.3 MB each) but not the third:
    one line names the file, and the copied folder resumes to the uninterrupted result."""
    args = [*SMALL, "--steps", "5", "--save-every", "1"]
    proc = on_tmpfs(tmp_path, "3m", *args)
    assert proc.returncode == 1, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert re.match(r"fgrpo train: error: --out: cannot write .*: No space left on device \(",
                    line), proc.stderr  # fmt: skip
    copy = tmp_path / "copy"
    assert run_dir.latest_checkpoint(copy) is not None
    assert train(copy, "--resume", "--save-every", "2") == 0
    assert_same_run(metrics(copy), uninterrupted)


def test_rotation_keeps_a_long_run_inside_a_small_tmpfs(tmp_path):
    proc = on_tmpfs(tmp_path, "6m", *SMALL, "--steps", "8", "--save-every", "1",
                    "--save-total-limit", "1")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert checkpoints(tmp_path / "copy") == ["checkpoint-8"]


# --- 4. TensorBoard -------------------------------------------------------------------------


def tensorboard_scalars(out: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / report.TENSORBOARD_DIR))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_tensorboard_logs_every_metric_under_trl_names_and_resumes(tmp_path):
    out = tmp_path / "run"
    assert train(out, "--steps", "3", "--save-every", "2", "--report-to", "tensorboard") == 0
    shutil.rmtree(out / "final")  # killed after step 3: step 3 is trained again
    assert train(out, "--steps", "4", "--resume") == 0
    logged = tensorboard_scalars(out)
    rows = metrics(out)
    for name in (
        "train/reward",
        "train/loss",
        "train/kl",
        "train/learning_rate",
        "train/completions/mean_length",
        "train/grad_norm",
        "train/reward_std",
    ):
        assert name in logged, sorted(logged)  # fmt: skip
    for key, value in report.scalars(rows[0]).items():
        assert logged[key][0] == (1, pytest.approx(value, rel=1e-6)), key
    assert [s for s, _ in logged["train/reward"]] == [1, 2, 3, 4]  # step 3 once
    assert logged["train/reward"][2][1] == pytest.approx(rows[2]["reward_mean"], rel=1e-6)


def test_report_names_map_to_trl():
    record = {"step": 3, "reward_mean": 0.5, "lr": 1e-3, "eval/pass_rate": 0.25, "sample": "x",
              "completion_length": 2.0, "kl": float("nan")}  # fmt: skip
    assert report.scalars(record) == {
        "train/reward": 0.5, "train/learning_rate": 1e-3, "eval/pass_rate": 0.25,
        "train/completions/mean_length": 2.0,
    }  # fmt: skip


def test_report_to_wandb_without_the_package_is_one_line(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a)
    )
    assert train(tmp_path / "r", "--report-to", "wandb") == 2
    assert "--report-to: fgrpo train needs the wandb package (pip install wandb)" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "r").exists()  # refused before anything was written


# --- finished and never-saved runs ----------------------------------------------------------


def test_resume_of_a_finished_run_says_complete_and_exits_0(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--steps", "2") == 0
    capsys.readouterr()
    assert train(out, "--resume") == 0
    assert "is complete: it has done 2 steps (--steps 2)" in capsys.readouterr().out
    assert train(out, "--resume", "--steps", "3") == 0
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]


def test_resume_of_a_run_that_never_saved_says_how_to_start_again(tmp_path, capsys):
    out = tmp_path / "run"
    proc = start_run(out, *SMALL)
    proc.kill()
    proc.wait(timeout=60)
    assert train(out, "--resume") == 2
    err = capsys.readouterr().err
    assert "never saved a checkpoint" in err and "--overwrite instead of --resume" in err, err
    assert train(out, "--overwrite", "--steps", "1") == 0  # as the message says


def test_run_json_has_no_stale_out_dir(tmp_path):
    out = tmp_path / "run"
    assert train(out, "--steps", "1") == 0
    options = json.loads((out / "run.json").read_text())["options"]
    assert "out_dir" not in options and "progress" not in options
    assert options["out"] == str(out.resolve())


def test_the_cpp_build_is_its_own_phase_not_step_1(tmp_path, monkeypatch, capsys):
    """A first run builds the C++ backend before step 1: its seconds are stated apart and
    counted neither in the steps' time_s nor in the summary's wall time."""
    import time

    from fgrpo_kernels.backends import cpu

    monkeypatch.delenv("FGRPO_CPU_BACKEND")
    built = []

    def slow_build():  # the first call builds
        if not built:
            time.sleep(1.0)
            built.append(time.perf_counter())
        return cpu.chunked

    monkeypatch.setattr(cpu, "backend_module", slow_build)
    monkeypatch.setattr(cpu, "cpp_build_seconds", lambda: 1.0)
    out = tmp_path / "run"
    assert train(out, "--steps", "2") == 0
    assert len(built) == 1
    assert "2 steps in 0 s (after 1 s building the C++ CPU backend)" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cpp_build_s"] == 1.0 and summary["wall_s"] < 1.0
    assert metrics(out)[0]["time_s"] < 1.0
