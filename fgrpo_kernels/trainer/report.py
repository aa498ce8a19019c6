"""`--report-to`: every number of a metrics.jsonl record also goes to TensorBoard or Weights &
Biases, under the names a TRL GRPOTrainer run logs there (HF's callbacks: `train/<name>`,
`eval/<name>`), so that our curves sit beside a TRL run's. A resumed run continues the same
run: TensorBoard drops what was logged after the checkpoint (purge_step), and W&B reopens the
run id kept in the run folder."""

from __future__ import annotations

import math
from pathlib import Path

from . import writes

# metrics.jsonl name -> TRL's name, where they differ; the rest keep their own name
TRL_NAMES = {
    "reward_mean": "reward",
    "completion_length": "completions/mean_length",
    "lr": "learning_rate",
}
TENSORBOARD_DIR = "runs"  # DIR/runs/, as HF's default logging_dir sits under output_dir
WANDB_ID = "wandb_id.txt"


def scalars(record: dict) -> dict[str, float]:
    """The record's numbers under TRL's names with HF's train/ or eval/ prefix (the step
    itself, strings and non-finite values are left out)."""
    out = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value):
            continue
        name = key if key.startswith("eval/") else f"train/{TRL_NAMES.get(key, key)}"
        out[name] = float(value)
    return out


class NoReport:
    def log(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoard:
    def __init__(self, out: Path, done: int):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ValueError(
                "report_to: 'tensorboard' needs the tensorboard package: pip install tensorboard"
            ) from None
        # steps after `done` were logged by a session that died before its next checkpoint:
        # they are trained again, so their old events go
        with writes.writing(out / TENSORBOARD_DIR):
            self.writer = SummaryWriter(str(out / TENSORBOARD_DIR), purge_step=done + 1)

    def log(self, record: dict) -> None:
        with writes.writing(Path(self.writer.log_dir)):
            for name, value in scalars(record).items():
                self.writer.add_scalar(name, value, record["step"])
            self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB:
    def __init__(self, out: Path, done: int, config: dict):
        try:
            import wandb
        except ImportError:
            raise ValueError(
                "report_to: 'wandb' needs the wandb package: pip install wandb"
            ) from None
        id_file = out / WANDB_ID
        run_id = id_file.read_text().strip() if id_file.is_file() else wandb.util.generate_id()
        writes.replace_text(id_file, run_id + "\n")
        self.run = wandb.init(id=run_id, resume="allow", dir=str(out), config=config)

    def log(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


def open_report(report_to: str, out: Path, done: int, config: dict):
    """The reporter of `report_to` ("none", "tensorboard", "wandb") for a run that has done
    `done` steps."""
    if report_to == "tensorboard":
        return TensorBoard(out, done)
    if report_to == "wandb":
        return WandB(out, done, config)
    return NoReport()
