"""`fgrpo train` data-parallel on 2 CPU ranks (gloo): torchrun runs of DDP and FSDP2 (rank 0
alone logs one line per step and writes the checkpoints; a resume under torchrun repeats the
steps exactly; a signal to one rank stops both after the same step), and the Trainer's ranks
holding identical parameters after an update on different prompts, FSDP2's equal to DDP's."""

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

from fgrpo_kernels.trainer import run_dir  # noqa: E402

from .ranks import free_port, run_ranks  # noqa: E402
from .trainer_common import cpu_path, metrics  # noqa: E402, F401

pytestmark = pytest.mark.usefixtures("cpu_path")

SMALL = ["--no-progress", "--prompts-per-step", "4", "--num-generations", "4"]


def torchrun_command(out: Path, *args: str) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    launcher += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    return [*launcher, "-m", "fgrpo_kernels.cli", "train", "--out", str(out), *SMALL, *args]


def env() -> dict:
    # the chunked CPU path: no C++ build in the ranks
    return dict(os.environ, FGRPO_BACKEND="cpu", FGRPO_CPU_BACKEND="torch")


def torchrun(out: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    command = torchrun_command(out, *args)
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env())


def test_torchrun_ddp_logs_once_per_step_and_resumes_exactly(tmp_path):
    """Rank 0 alone writes: one metrics line per step with the global rollout count, one
    summary line; a run killed after step 4 resumes from checkpoint-2 and logs steps 3 and 4
    again exactly (every rank's random streams restored), each step once."""
    out = tmp_path / "run"
    done = torchrun(out, "--steps", "4", "--save-every", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "error" not in done.stderr.lower(), done.stderr[-3000:]
    first = metrics(out)
    assert [r["step"] for r in first] == [1, 2, 3, 4]
    assert all(r["rollouts"] == 2 * 4 * 4 for r in first)  # both ranks' completions
    assert done.stdout.count("4 steps in") == 1
    assert run_dir.checkpoint_step(out / "final") == 4
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    for name in ("final", "checkpoint-4"):  # as if killed at once after step 4
        shutil.rmtree(out / name)
    again = torchrun(out, "--steps", "4", "--resume")
    assert again.returncode == 0 and "error" not in again.stderr.lower(), again.stderr[-3000:]
    assert "(steps 3-4, resumed)" in again.stdout
    resumed = metrics(out)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(first, resumed):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6), a["step"]
        assert a["reward_mean"] == b["reward_mean"] and a["sample"] == b["sample"]
    assert resumed[3]["loss"] != 0.0


def rank_process(launcher: subprocess.Popen, rank: int) -> int:
    """The pid of torchrun's worker of `rank` (read from /proc)."""
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    for pid in children:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(pid)
    raise AssertionError(f"no worker of rank {rank} among {children}")


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads worker pids from /proc")
def test_torchrun_fsdp_trains_and_a_signal_to_one_rank_stops_both(tmp_path):
    """FSDP2 run; SIGINT to rank 1 alone: rank 0 learns of it through the per-step agreement,
    both stop after the same step, and rank 0 writes a loadable final checkpoint (an FSDP2
    collective: it needs both ranks) and a summary naming the signal."""
    out = tmp_path / "run"
    command = torchrun_command(out, "--steps", "100000", "--fsdp")
    err = open(tmp_path / "stderr", "w")  # noqa: SIM115 - the launcher holds it
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True, env=env())
    try:
        deadline = time.monotonic() + 180
        log = out / "metrics.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:
            if log.exists() and len(log.read_text().splitlines()) >= 2:
                break
            time.sleep(0.05)
        assert proc.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
        os.kill(rank_process(proc, 1), signal.SIGINT)
        stdout, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = (tmp_path / "stderr").read_text()
    steps = [r["step"] for r in metrics(out)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 2, stderr[-3000:]
    assert re.search(rf"{len(steps)} steps in .* \(stopped by SIGINT at step {len(steps)} ", stdout)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted_by"] == "SIGINT" and summary["steps"] == len(steps)
    assert run_dir.checkpoint_step(out / "final") == len(steps)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.lm_head.weight.shape == (19, 64)  # the whole head, gathered from both shards
    state = run_dir.load_state(out / "final")
    assert len(state["rng_ranks"]) == 2
    assert "lm_head.weight" in state["optimizer"]["state"]  # FSDP2's full optimizer state


def test_torchrun_user_error_is_one_line_from_rank_0(tmp_path):
    done = torchrun(tmp_path / "run", "--num-generations", "1", timeout=120)
    assert done.returncode != 0
    lines = [x for x in done.stderr.splitlines() if "fgrpo train: error" in x]
    assert lines == ["fgrpo train: error: --num-generations: expected an int >= 2 (advantages "
                     "compare the completions of one prompt; a group of one learns nothing); "
                     "got 1"], done.stderr[-3000:]  # fmt: skip
    assert not (tmp_path / "run").exists()


def _full_parameters(model) -> dict[str, torch.Tensor]:
    from fgrpo_kernels.backends.distributed import is_dtensor

    return {
        n: (p.full_tensor() if is_dtensor(p) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def first_digit(prompts, completions):
    """A dense reward (the untrained model rarely scores on the digit task)."""
    return [int(c[0]) / 9 if c[:1].isdigit() else 0.0 for c in completions]


def _update_on_each_rank(rank, world):
    """Each rank samples its own prompts; one update (two micro-batches: the first's gradient
    stays local) by DDP, then the same rollouts by FSDP2 from the same start."""
    import torch.distributed as dist

    from fgrpo_kernels.trainer import TrainConfig, Trainer
    from fgrpo_kernels.trainer.task import PatternTask
    from fgrpo_kernels.trainer.tiny import tiny_model, tiny_tokenizer

    task = PatternTask()

    def trainer(fsdp: bool) -> Trainer:
        cfg = TrainConfig(
            out_dir="unused", prompts_per_step=4, num_generations=4, grad_accum=2, lr=1e-2,
            scale_rewards="batch", fsdp=fsdp, seed=7, progress=False,
        )  # fmt: skip
        return Trainer(tiny_model(0), tiny_tokenizer(), first_digit, task.prompts, cfg)

    ddp = trainer(False)
    assert ddp.ranks.mode == "ddp" and ddp.ranks.world == 2
    torch.manual_seed(rank)
    rollout, prompts, _, _ = ddp.rollout()
    start = _full_parameters(ddp.model)
    ddp.update(rollout)
    after = _full_parameters(ddp.model)
    every = [None] * world
    dist.all_gather_object(every, (prompts, after))
    (prompts_0, params_0), (prompts_1, params_1) = every
    assert prompts_0 != prompts_1  # different data per rank
    for name, value in params_0.items():
        assert torch.equal(value, params_1[name]), name  # gradients synchronised
    assert max((after[n] - start[n]).abs().max() for n in start) > 1e-3  # it moved
    # batch-scaled advantages: the σ of both ranks' rewards together
    global_r = torch.cat([r.cpu() for r in ddp.ranks.gather(rollout.rewards.cpu())])
    sigma = global_r.std()
    mine = rollout.rewards.reshape(-1, 4)
    expected = ((mine - mine.mean(-1, keepdim=True)) / (sigma + 1e-4)).reshape(-1)
    torch.testing.assert_close(rollout.advantages, expected.to(rollout.advantages.dtype))
    local = (mine - mine.mean(-1, keepdim=True)) / (rollout.rewards.std() + 1e-4)
    assert not torch.allclose(local.reshape(-1), expected)  # the gather matters here

    fsdp = trainer(True)
    assert type(fsdp.model.lm_head.weight).__name__ == "DTensor"
    fsdp.update(rollout)
    sharded = _full_parameters(fsdp.model)
    for name, value in after.items():
        torch.testing.assert_close(sharded[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_ranks_hold_identical_parameters_after_an_update_and_fsdp_equals_ddp():
    run_ranks(_update_on_each_rank, 2, timeout=240, torch_holds_group=True)  # FSDP2


_LEAVE = """
import os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
from fgrpo_kernels.trainer import parallel
assert parallel.init(parallel.Launch(0, 1, 0))
import torch
import torch._dynamo  # what the model's first forward and fully_shard import, after init
from torch.distributed.fsdp import fully_shard
if sys.argv[2] == "fsdp":
    fully_shard(torch.nn.Linear(3, 4))
print(parallel.shutdown(True))
"""


@pytest.mark.parametrize(("mode", "gone"), [("ddp", "True"), ("fsdp", "False")])
def test_regression_the_trainers_group_ends_with_it(mode, gone):
    """torch._dynamo and torch.distributed.fsdp imported after init_process_group held the
    default group past destroy_process_group (torch.distributed.nn.functional's default
    arguments): its threads then met the interpreter's teardown, which aborts now and then.
    `parallel.init` imports them first; FSDP2 still holds the group, which `shutdown` reports so
    that `fgrpo train` leaves with os._exit."""
    done = subprocess.run(
        [sys.executable, "-c", _LEAVE, str(free_port()), mode],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [gone], done.stdout
