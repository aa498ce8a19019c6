"""The TRL drop-in: TRL's GRPOTrainer trains with the fused loss, and on one fixed batch the
fused loss and gradients equal TRL's own `_compute_loss`."""

import math
import random

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from trl import GRPOTrainer  # noqa: E402

from fgrpo_kernels.integrations.trl import (  # noqa: E402
    FusedGRPOConfig,
    FusedGRPOTrainer,
    use_fused_loss,
)
from fgrpo_kernels.trainer.task import PatternTask  # noqa: E402
from fgrpo_kernels.trainer.tiny import tiny_model, tiny_tokenizer  # noqa: E402

TASK = PatternTask()
TOL = 1e-4


def reward(prompts, completions, **kwargs):
    return TASK.reward(prompts, completions)


def digit_reward(prompts, completions, **kwargs):
    """Dense: 1 − |first digit − answer| / 9, so that every group has a spread."""
    out = []
    for prompt, completion in zip(prompts, completions):
        c = completion.strip()[:1]
        out.append(1.0 - abs(int(c) - int(TASK.answer(prompt))) / 9 if c.isdigit() else 0.0)
    return out


@pytest.fixture(autouse=True)
def _cpu_path(monkeypatch):
    monkeypatch.setenv("FGRPO_BACKEND", "cpu")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny model saved to disk: TRL builds its reference model from the path."""
    path = tmp_path_factory.mktemp("tiny")
    tiny_model(0).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


def make_trainer(checkpoint, tmp_path, cls=FusedGRPOTrainer, peft_config=None, **options):
    args = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
        max_completion_length=4, max_steps=2, logging_steps=1, report_to="none", use_cpu=True,
        save_strategy="no", learning_rate=1e-3, seed=0, beta=0.04, loss_type="dapo",
        bf16=False,
    )  # fmt: skip
    # NB: fp32. Under CPU bf16 autocast TRL's own chunked head rounds the logits to bf16 (its
    # log-probs are ~1e-3 off an fp64 reference; ours, with fp32 products, ~1e-7), so a 1e-4
    # comparison is only meaningful in fp32.
    args.update(options)
    dataset = datasets.Dataset.from_dict({"prompt": TASK.prompts(16, random.Random(0))})
    return cls(
        model=checkpoint, reward_funcs=[reward, digit_reward], args=FusedGRPOConfig(**args),
        train_dataset=dataset, processing_class=tiny_tokenizer(), peft_config=peft_config,
    )  # fmt: skip


def fixed_batch(trainer, perturb_old=True):
    """One generated and scored batch; old and reference log-probs perturbed so that the ratio
    clips and the KL term has a gradient."""
    torch.manual_seed(0)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2  # exercise TRL's normalisers
    prompts = TASK.prompts(2, random.Random(1))
    batch = trainer._generate_and_score_completions(
        [{"prompt": p} for p in prompts for _ in "1234"]
    )
    if perturb_old:  # the policy equals the reference here: move old and ref off it
        mask = batch["completion_mask"]
        gen = torch.Generator().manual_seed(2)
        noise = 0.3 * torch.randn(mask.shape, generator=gen)
        ref = batch.get("ref_per_token_logps")
        batch["old_per_token_logps"] = ((ref if ref is not None else 0.0) + noise) * mask
        if ref is not None:
            batch["ref_per_token_logps"] = (
                ref + 0.3 * torch.randn(mask.shape, generator=gen)
            ) * mask
    return batch


def loss_and_grads(trainer, batch, compute_loss):
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    loss = compute_loss(trainer.model, batch)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return loss.detach(), [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


def assert_parity(trainer, batch):
    fused_loss, fused_grads = loss_and_grads(trainer, batch, trainer._compute_loss)
    trainer._metrics["train"].clear()
    stock = GRPOTrainer._compute_loss.__get__(trainer)
    trl_loss, trl_grads = loss_and_grads(trainer, batch, stock)
    assert abs(float(fused_loss) - float(trl_loss)) <= TOL * max(1.0, abs(float(trl_loss)))
    err = max(float((a - b).abs().max()) for a, b in zip(fused_grads, trl_grads))
    scale = max(float(b.abs().max()) for b in trl_grads)
    assert err <= TOL * max(scale, 1.0), (err, scale)
    assert scale > 0.0  # the batch carries a gradient
    return float(fused_loss), err


@pytest.mark.parametrize(
    "options",
    [
        dict(loss_type="dapo"),
        dict(loss_type="dapo", use_bias_correction_kl=False),
        dict(loss_type="dapo", beta=0.0),
        dict(loss_type="grpo", use_bias_correction_kl=False),
        dict(loss_type="bnpo"),
        dict(loss_type="dr_grpo", use_bias_correction_kl=False),
        dict(loss_type="grpo", importance_sampling_level="sequence"),
    ],
    ids=lambda o: "-".join(f"{v}" for v in o.values()),
)
def test_fixed_batch_loss_and_grads_equal_trl(checkpoint, tmp_path, options):
    trainer = make_trainer(checkpoint, tmp_path, **options)
    assert_parity(trainer, fixed_batch(trainer))


def test_fused_metrics_equal_trl_metrics(checkpoint, tmp_path):
    trainer = make_trainer(checkpoint, tmp_path, use_bias_correction_kl=False)
    batch = fixed_batch(trainer)
    logged = []
    for fn in (trainer._compute_loss, GRPOTrainer._compute_loss.__get__(trainer)):
        trainer._metrics["train"].clear()
        fn(trainer.model, batch)
        logged.append({k: v[-1] for k, v in trainer._metrics["train"].items()})
    fused, trl = logged
    names = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean")
    names += ("clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max")
    for name in names:
        assert math.isclose(fused[name], trl[name], rel_tol=1e-4, abs_tol=1e-6), name
    assert trl["clip_ratio/region_mean"] > 0.0  # the perturbation clips some tokens


def test_two_training_steps_with_the_drop_in(checkpoint, tmp_path):
    trainer = make_trainer(checkpoint, tmp_path)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    for h in logs:
        assert math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"])
        assert {"kl", "entropy", "clip_ratio/region_mean", "reward"} <= h.keys()


@pytest.mark.parametrize("loss_type", ["fgrpo", "gift"])
def test_extra_loss_types_train(checkpoint, tmp_path, loss_type):
    trainer = make_trainer(checkpoint, tmp_path, loss_type=loss_type, beta=0.1)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    assert {"kl", "entropy", f"{loss_type}/implicit_reward"} <= logs[-1].keys()
    moved = any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert moved


def test_extra_loss_types_need_beta(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="^beta"):
        make_trainer(checkpoint, tmp_path, loss_type="fgrpo", beta=0.0)


def test_peft_frozen_lm_head_parity_and_steps(checkpoint, tmp_path):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = make_trainer(checkpoint, tmp_path, peft_config=lora)
    head = trainer.model.get_base_model().get_output_embeddings()
    assert not head.weight.requires_grad  # the lm_head is frozen under LoRA
    _, err = assert_parity(trainer, fixed_batch(trainer))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)


def test_frozen_lm_head_and_use_fused_loss_patch(checkpoint, tmp_path):
    trainer = make_trainer(checkpoint, tmp_path, cls=GRPOTrainer)
    trainer.model.get_output_embeddings().weight.requires_grad_(False)
    use_fused_loss(trainer)
    assert isinstance(trainer, GRPOTrainer) and type(trainer).__name__ == "FusedGRPOTrainer"
    assert_parity(trainer, fixed_batch(trainer))


def test_unsupported_option_falls_back_to_trl(checkpoint, tmp_path):
    trainer = make_trainer(checkpoint, tmp_path, delta=1.5)
    batch = fixed_batch(trainer)
    with pytest.warns(UserWarning, match="delta"):
        loss = trainer._compute_loss(trainer.model, batch)
    trl = GRPOTrainer._compute_loss(trainer, trainer.model, batch)
    assert float(loss) == float(trl)
