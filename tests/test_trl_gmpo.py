"""The GMPOTrainer drop-in: on one fixed batch the fused GMPO loss, its gradients and its
metrics equal TRL's own `GMPOTrainer._compute_loss` (replaced by a trap while the drop-in
runs, so a fallback fails), and the trainer trains."""

import math
import random

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
gmpo = pytest.importorskip("trl.experimental.gmpo")

from fgrpo_kernels.integrations.trl_gmpo import (  # noqa: E402
    FusedGMPOTrainer,
    use_fused_gmpo_loss,
)
from fgrpo_kernels.trainer.tiny import tiny_tokenizer  # noqa: E402

from .test_trl_integration import (  # noqa: E402
    TASK,
    _cpu_path,  # noqa: F401 - the autouse fixture
    _no_fallback,
    assert_two_logged_steps,
    digit_reward,
    fixed_batch,
    loss_and_grads,
    reward,
    save_tiny,
)

TOL = 1e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny(tmp_path_factory)


def make(checkpoint, tmp_path, cls=FusedGMPOTrainer, **options):
    args = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
        max_completion_length=4, max_steps=2, logging_steps=1, report_to="none", use_cpu=True,
        save_strategy="no", learning_rate=1e-3, seed=0, beta=0.04, bf16=False,
    )  # fmt: skip
    args.update(options)
    dataset = datasets.Dataset.from_dict({"prompt": TASK.prompts(16, random.Random(0))})
    return cls(
        model=checkpoint, reward_funcs=[reward, digit_reward], args=gmpo.GMPOConfig(**args),
        train_dataset=dataset, processing_class=tiny_tokenizer(),
    )  # fmt: skip


def both(trainer, batch):
    """(fused loss, grads, metrics), (TRL's loss, grads, metrics) on `batch`."""
    stock = gmpo.GMPOTrainer._compute_loss
    out = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gmpo.GMPOTrainer, "_compute_loss", _no_fallback)
        trainer._metrics["train"].clear()
        loss, grads = loss_and_grads(trainer, batch, trainer._compute_loss)
        out.append((loss, grads, {k: v[-1] for k, v in trainer._metrics["train"].items()}))
    trainer._metrics["train"].clear()
    loss, grads = loss_and_grads(trainer, batch, stock.__get__(trainer))
    out.append((loss, grads, {k: v[-1] for k, v in trainer._metrics["train"].items()}))
    return out


@pytest.fixture(scope="module")
def shared(checkpoint, tmp_path_factory):
    trainer = make(checkpoint, tmp_path_factory.mktemp("gmpo"))
    return trainer, fixed_batch(trainer)


OPTIONS = [
    {},
    {"beta": 0.0},
    {"epsilon_low": 0.1, "epsilon_high": 0.25},
    {"top_entropy_quantile": 0.5},
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "defaults")
def test_loss_grads_and_metrics_equal_trl(shared, options):
    trainer, batch = shared
    saved = {k: getattr(trainer, k) for k in options}
    for key, value in options.items():
        setattr(trainer, key, value)
    trainer._fgrpo_loss = trainer._fgrpo_build_loss()
    try:
        (loss, grads, metrics), (want, want_grads, want_metrics) = both(trainer, batch)
    finally:
        for key, value in saved.items():
            setattr(trainer, key, value)
        trainer._fgrpo_loss = trainer._fgrpo_build_loss()
    assert abs(float(loss) - float(want)) <= TOL * max(abs(float(want)), 1e-3), (loss, want)
    err = max(float((a - b).abs().max()) for a, b in zip(grads, want_grads))
    scale = max(float(b.abs().max()) for b in want_grads)
    assert scale > 0.0 and err <= TOL * scale, (err, scale)
    assert metrics.keys() == want_metrics.keys()
    for name, value in want_metrics.items():
        assert math.isclose(metrics[name], value, rel_tol=1e-4, abs_tol=1e-6), name
    if not options:
        assert want_metrics["clip_ratio/region_mean"] > 0.0  # the batch clips


def test_the_drop_in_trains(checkpoint, tmp_path):
    trainer = make(checkpoint, tmp_path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gmpo.GMPOTrainer, "_compute_loss", _no_fallback)
        trainer.train()
    assert_two_logged_steps(trainer)


def test_use_fused_gmpo_loss_switches_a_built_trainer(checkpoint, tmp_path):
    trainer = use_fused_gmpo_loss(make(checkpoint, tmp_path, cls=gmpo.GMPOTrainer))
    assert type(trainer).__name__ == "FusedGMPOTrainer"
    assert use_fused_gmpo_loss(trainer) is trainer
    with pytest.raises(TypeError, match="^trainer: expected a GMPOTrainer"):
        use_fused_gmpo_loss(torch.nn.Linear(2, 2))
