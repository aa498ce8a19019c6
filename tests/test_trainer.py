"""The thin trainer's loop: a few seeded steps of each loss learn an easy task; gradient
accumulation; the PEFT reference; configuration errors name the argument."""

import math
import random

import pytest
import torch

pytest.importorskip("transformers")

from fgrpo_kernels.trainer import TrainConfig, Trainer, hf  # noqa: E402
from fgrpo_kernels.trainer.task import PatternTask  # noqa: E402
from fgrpo_kernels.trainer.tiny import tiny_model, tiny_tokenizer  # noqa: E402

from .trainer_common import cpu_path  # noqa: E402, F401

pytestmark = pytest.mark.usefixtures("cpu_path")

TASK = PatternTask()


def always_seven(prompts, completions):
    """An easy task: the answer is "7" whatever the prompt."""
    return [1.0 if c == "7" else 0.5 if c[:1] == "7" else 0.0 for c in completions]


def seven_pairs(n, rng):
    return [
        {"prompt": p, "chosen": "7", "rejected": str(rng.randrange(7))}
        for p in TASK.prompts(n, rng)
    ]


def p_first_seven(model, tokenizer):
    """Mean probability that the first completion token is "7", on fixed prompts."""
    probe = hf.encode(tokenizer, TASK.prompts(16, random.Random(1)), ["7"] * 16)
    return hf.logps_no_grad(model, probe, 1.0)[:, 0].exp().mean().item()


@pytest.mark.parametrize(
    "options",
    [
        dict(loss="fgrpo", divergence="pearson"),
        dict(loss="grpo", loss_type="dapo"),
        dict(loss="gift"),
        dict(loss="fhal", divergence="pearson", pref_batch_size=4),
    ],
    ids=lambda o: o["loss"],
)
def test_each_loss_learns_an_easy_task(tmp_path, options):
    cfg = TrainConfig(
        out_dir=str(tmp_path), steps=10, prompts_per_step=4, num_generations=8, lr=1e-2,
        seed=3, progress=False, **options,
    )  # fmt: skip
    model, tokenizer = tiny_model(0), tiny_tokenizer()
    before = p_first_seven(model, tokenizer)
    history = Trainer(
        model, tokenizer, always_seven, TASK.prompts, cfg, preference_data=seven_pairs
    ).train()
    after = p_first_seven(model, tokenizer)
    assert len(history) == 10
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in history)
    rewards = [r["reward_mean"] for r in history]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.15, rewards
    assert after > 5 * before, (before, after)
    assert (tmp_path / "final" / "config.json").exists()


def test_grad_accum_and_several_updates(tmp_path):
    cfg = TrainConfig(
        out_dir=str(tmp_path), loss="grpo", loss_type="bnpo", steps=2, prompts_per_step=4,
        num_generations=4, grad_accum=2, num_updates=2, save_every=1, progress=False,
    )  # fmt: skip
    trainer = Trainer(tiny_model(0), tiny_tokenizer(), always_seven, TASK.prompts, cfg)
    history = trainer.train()
    assert [r["step"] for r in history] == [1, 2]
    assert trainer.scheduler.last_epoch == 4  # two optimizer updates per rollout
    assert (tmp_path / "checkpoint-1").is_dir() and (tmp_path / "checkpoint-2").is_dir()


def test_dapo_grad_accum_equals_one_batch():
    """dapo over two micro-batches (whole-rollout token count) = dapo on the whole batch."""
    torch.manual_seed(0)
    grads = []
    for accum in (1, 2):
        cfg = TrainConfig(loss="grpo", prompts_per_step=4, num_generations=4, grad_accum=accum)
        trainer = Trainer(tiny_model(0), tiny_tokenizer(), TASK.reward, TASK.prompts, cfg)
        if accum == 1:
            torch.manual_seed(1)
            rollout = trainer.rollout()[0]
        for group in trainer.optimizer.param_groups:
            group["lr"] = 0.0  # keep the parameters, read the gradients
        trainer.update(rollout)
        grads.append([p.grad.clone() for p in trainer.model.parameters()])
    for g1, g2 in zip(*grads):
        torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-7)


def test_peft_reference_is_the_adapter_disabled_model(tmp_path):
    peft = pytest.importorskip("peft")
    base = tiny_model(0)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(base, lora)
    cfg = TrainConfig(
        out_dir=str(tmp_path), loss="fgrpo", steps=3, prompts_per_step=4, num_generations=4,
        lr=1e-2, progress=False,
    )  # fmt: skip
    trainer = Trainer(model, tiny_tokenizer(), always_seven, TASK.prompts, cfg)
    assert trainer.ref_is_adapter and trainer.ref_model is None
    assert not hf.causal_lm(model).get_output_embeddings().weight.requires_grad
    trainer.train()
    rollout = trainer.rollout()[0]
    with model.disable_adapter():
        frozen = hf.logps_no_grad(model, rollout, 1.0)
    torch.testing.assert_close(rollout.ref_logps, frozen)
    assert not torch.allclose(hf.logps_no_grad(model, rollout, 1.0), frozen)  # the adapter moved
    assert (tmp_path / "final" / "adapter_config.json").exists()


def test_pattern_task_reward():
    assert TASK.answer("2345?") == "6" and TASK.answer("210?") == "9"
    assert TASK.reward(["2345?"] * 4, ["6", "6?", "5", ""]) == [1.0, 0.5, 0.0, 0.0]
    prompts = TASK.prompts(50, random.Random(0))
    assert all(p.endswith("?") and 3 <= len(p) - 1 <= 4 for p in prompts)


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        (dict(loss="ppo"), "loss"),
        (dict(divergence="kl2"), "divergence"),
        (dict(prompts_per_step=6, grad_accum=4), "grad_accum"),
        (dict(num_generations=0), "num_generations"),
        (dict(num_generations=1), "num_generations"),
        (dict(rollouts_per_step=12), "rollouts_per_step"),
        (dict(eval_every=-1), "eval_every"),
        (dict(reward_weights=[1.0, float("nan")]), "reward_weights"),
        (dict(lr=-1.0), "lr"),
        (dict(level="sequence", reduction="token_mean"), "reduction"),
    ],
)
def test_config_errors_name_the_argument(kwargs, arg):
    with pytest.raises((ValueError, TypeError), match=f"^{arg}"):
        TrainConfig(**kwargs)


def test_fhal_needs_preference_data():
    with pytest.raises(ValueError, match="^preference_data"):
        cfg = TrainConfig(loss="fhal")
        Trainer(tiny_model(0), tiny_tokenizer(), TASK.reward, TASK.prompts, cfg)


def test_rollouts_per_step_fixes_the_completions_per_step():
    cfg = TrainConfig(num_generations=2, rollouts_per_step=64)
    assert cfg.prompts_per_step == 32
    cfg = TrainConfig(num_generations=8, rollouts_per_step=64)
    assert cfg.prompts_per_step == 8
    rollout = Trainer(tiny_model(0), tiny_tokenizer(), TASK.reward, TASK.prompts, cfg).rollout()[0]
    assert rollout.completion_ids.shape[0] == 64
