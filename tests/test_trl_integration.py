"""The TRL drop-in: TRL's GRPOTrainer trains with the fused loss, and on one fixed batch the
fused loss and gradients equal TRL's own `_compute_loss`."""

import math
import random

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from trl import GRPOTrainer  # noqa: E402

from fgrpo_kernels.core import options as O  # noqa: E402
from fgrpo_kernels.integrations.trl import (  # noqa: E402
    FusedGRPOConfig,
    FusedGRPOTrainer,
    use_fused_loss,
)
from fgrpo_kernels.trainer.task import PatternTask  # noqa: E402
from fgrpo_kernels.trainer.tiny import TOKENS, tiny_model, tiny_tokenizer  # noqa: E402

TASK = PatternTask()
TOL = 1e-5


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
    return save_tiny(tmp_path_factory)


def save_tiny(tmp_path_factory) -> str:
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


def _no_fallback(*args, **kwargs):
    raise AssertionError("the fused loss fell back to TRL's _compute_loss")


def assert_parity(trainer, batch, tol=TOL):
    """The drop-in's loss and gradients equal TRL's own `_compute_loss` on the same batch; the
    drop-in runs with TRL's loss replaced by a trap, so that any fallback fails the test."""
    stock = GRPOTrainer._compute_loss
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GRPOTrainer, "_compute_loss", _no_fallback)
        fused_loss, fused_grads = loss_and_grads(trainer, batch, trainer._compute_loss)
    trainer._metrics["train"].clear()
    try:
        trl_loss, trl_grads = loss_and_grads(trainer, batch, stock.__get__(trainer))
    except ValueError as exc:
        if "Unknown loss type" in str(exc):
            pytest.skip(f"TRL has no loss_type {trainer.loss_type!r}")
        raise
    assert abs(float(fused_loss) - float(trl_loss)) <= tol * max(abs(float(trl_loss)), 1e-3), (
        float(fused_loss),
        float(trl_loss),
    )
    err = max(float((a - b).abs().max()) for a, b in zip(fused_grads, trl_grads))
    scale = max(float(b.abs().max()) for b in trl_grads)
    assert err <= tol * scale, (err, scale)
    assert scale > 0.0  # the batch carries a gradient
    return float(fused_loss), err


# ----------------------------------------------------------------------------- one trainer


@pytest.fixture(scope="module")
def shared(checkpoint, tmp_path_factory):
    """One drop-in trainer (β = 0.04, so TRL loads a reference model) and one generated batch;
    each parity case sets its options on both (TRL reads them from the trainer and its args)."""
    trainer = make_trainer(checkpoint, tmp_path_factory.mktemp("shared"))
    return trainer, fixed_batch(trainer), dict(vars(trainer)), dict(vars(trainer.args))


@pytest.fixture
def trainer_and_batch(shared):
    trainer, batch, state, args = shared
    yield trainer, {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()}
    trainer.__dict__.update(state)
    trainer.args.__dict__.update(args)
    trainer._metrics["train"].clear()


def configure(trainer, **options):
    """Set GRPOConfig options on a built trainer the way its __init__ would, then rebuild the
    fused loss."""
    for key, value in options.items():
        if key == "epsilon":
            trainer.epsilon_low = value
        elif key in vars(trainer.args):
            setattr(trainer.args, key, value)
        if key in vars(trainer) or key in ("use_vllm",):
            setattr(trainer, key, value)
    a = trainer.args
    trainer.epsilon_high = a.epsilon_high if a.epsilon_high is not None else trainer.epsilon_low
    trainer._entropy_bonus_enabled = trainer.entropy_coef != 0.0 or trainer.use_adaptive_entropy
    trainer._fgrpo_setup()
    return trainer


def vllm_inputs(batch, mode, clip_min=None, clip_max=3.0, seed=3):
    """The rollout engine's log-probs (the old ones, perturbed; one unscored NaN) and TRL's
    importance-sampling ratio for `mode` (token/sequence × truncate/mask), as TRL computes it."""
    mask = batch["completion_mask"]
    gen = torch.Generator().manual_seed(seed)
    sampling = batch["old_per_token_logps"] + 0.3 * torch.randn(mask.shape, generator=gen)
    sampling[0, 0] = float("nan")
    diff = torch.nan_to_num((batch["old_per_token_logps"] - sampling) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    if mode.endswith("truncate"):
        ratio = ratio.clamp(min=clip_min, max=clip_max)
    else:
        ratio = ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)
    batch.update(sampling_per_token_logps=sampling, importance_sampling_ratio=ratio)
    return batch


LOSS_TYPES = list(O.LOSS_TYPES)  # a loss type TRL lacks is skipped (nothing to compare)
VLLM_MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
# Each GRPOConfig option the issue lists, alone and together (TRL's defaults besides: β 0.04,
# use_bias_correction_kl=True, gradient accumulation 2).
OPTIONS = [
    *[dict(loss_type=t) for t in LOSS_TYPES],
    *[dict(loss_type=t, importance_sampling_level="sequence") for t in ("grpo", "luspo", "dapo")],
    dict(loss_type="dapo", use_bias_correction_kl=False),
    dict(loss_type="grpo", beta=0.0),
    dict(loss_type="cispo", epsilon_high=1.1),
    dict(loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0),
    dict(loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_pos=0.5),
    dict(loss_type="dapo", delta=1.1),
    dict(loss_type="grpo", delta=1.1, importance_sampling_level="sequence"),
    dict(loss_type="dapo", entropy_coef=0.05),
    dict(loss_type="grpo", top_entropy_quantile=0.2),
    dict(loss_type="bnpo", top_entropy_quantile=0.5, entropy_coef=0.05),
    dict(loss_type="dapo", off_policy_mask_threshold=0.05, vllm="token_truncate"),
    dict(loss_type="grpo", off_policy_mask_threshold=0.05),
    *[dict(loss_type="dapo", vllm=m) for m in VLLM_MODES],
    dict(loss_type="grpo", vllm="token_mask", vllm_importance_sampling_clip_min=0.8),
    dict(loss_type="vespo", vllm="token_mask", vllm_importance_sampling_clip_min=0.8),
    dict(loss_type="cispo", vllm="sequence_mask", vllm_importance_sampling_clip_max=1.2),
    dict(loss_type="dapo", num_items_in_batch=3),
    dict(
        loss_type="luspo", importance_sampling_level="sequence", delta=1.2, vllm="token_truncate",
        entropy_coef=0.02, top_entropy_quantile=0.5, off_policy_mask_threshold=0.05,
    ),
]  # fmt: skip


def _id(options):
    return "-".join(f"{k}={v}" if k != "loss_type" else v for k, v in options.items())


@pytest.mark.parametrize("options", OPTIONS, ids=[_id(o) for o in OPTIONS])
def test_fixed_batch_loss_and_grads_equal_trl(trainer_and_batch, options):
    trainer, batch = trainer_and_batch
    options = dict(options)
    mode = options.pop("vllm", None)
    if mode is not None:
        options.update(use_vllm=True, vllm_importance_sampling_correction=True)
        options.setdefault("vllm_importance_sampling_mode", mode)
    if "num_items_in_batch" in options:
        batch["num_items_in_batch"] = torch.tensor(options.pop("num_items_in_batch"))
    configure(trainer, **options)
    if mode is not None:
        a = trainer.args
        vllm_inputs(
            batch, mode, a.vllm_importance_sampling_clip_min, a.vllm_importance_sampling_clip_max
        )
    assert_parity(trainer, batch)


def test_adaptive_entropy_control_equals_trl(trainer_and_batch):
    """The coefficient applied and the controller's update (entropy_coef, the window's entropy)
    are TRL's; the bonus only applies once the last step's entropy is below the target."""
    trainer, batch = trainer_and_batch
    configure(trainer, loss_type="dapo", use_adaptive_entropy=True, entropy_coef=0.1,
              entropy_target=0.5, top_entropy_quantile=0.5)  # fmt: skip
    states = []
    for compute in (trainer._compute_loss, GRPOTrainer._compute_loss.__get__(trainer)):
        trainer._last_world_entropy, trainer.entropy_coef = 0.3, 0.1
        trainer._entropy_window_stats = None
        loss, grads = loss_and_grads(trainer, batch, compute)
        states.append((float(loss), grads, trainer.entropy_coef, trainer._last_world_entropy))
    (loss, grads, coef, world), (trl_loss, trl_grads, trl_coef, trl_world) = states
    assert loss == pytest.approx(trl_loss, rel=TOL)
    assert max(float((a - b).abs().max()) for a, b in zip(grads, trl_grads)) <= TOL * max(
        float(b.abs().max()) for b in trl_grads
    )
    assert coef == pytest.approx(trl_coef) and world == pytest.approx(trl_world, rel=1e-5)


def test_mask_truncated_completions_equals_trl(trainer_and_batch):
    trainer, _ = trainer_and_batch
    configure(trainer, loss_type="dapo", mask_truncated_completions=True)
    batch = fixed_batch(trainer)
    assert int(batch["completion_mask"].sum()) < batch["completion_mask"].numel()
    assert_parity(trainer, batch)


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo", "sapo"])
def test_fused_metrics_equal_trl_metrics(trainer_and_batch, loss_type):
    trainer, batch = trainer_and_batch
    configure(trainer, loss_type=loss_type, use_vllm=True, vllm_importance_sampling_correction=True,
              vllm_importance_sampling_mode="token_truncate", entropy_coef=0.01)  # fmt: skip
    vllm_inputs(batch, "token_truncate")
    logged = []
    for fn in (trainer._compute_loss, GRPOTrainer._compute_loss.__get__(trainer)):
        trainer._metrics["train"].clear()
        fn(trainer.model, batch)
        logged.append({k: v[-1] for k, v in trainer._metrics["train"].items()})
    fused, trl = logged
    assert fused.keys() == trl.keys()
    for name in trl:
        assert math.isclose(fused[name], trl[name], rel_tol=1e-4, abs_tol=1e-6), name
    if loss_type == "dapo":
        assert trl["clip_ratio/region_mean"] > 0.0  # the perturbation clips some tokens


def test_two_training_steps_with_the_drop_in(checkpoint, tmp_path):
    trainer = make_trainer(checkpoint, tmp_path)
    trainer.train()
    assert_two_logged_steps(trainer)


def assert_two_logged_steps(trainer) -> None:
    """Two finite logged steps, each with TRL's loss metrics."""
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


def test_soft_capped_logits_raise_at_construction(tmp_path):
    path = tmp_path / "capped"
    model = tiny_model(0)
    model.config.final_logit_softcapping = 30.0
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    with pytest.raises(NotImplementedError, match="^final_logit_softcapping"):
        make_trainer(str(path), tmp_path / "out")


def test_scaled_logits_equal_trl(tmp_path):
    """A config `logit_scale` (Cohere-style): TRL's fused head multiplies the logits by it; the
    drop-in folds it into the temperature."""
    path = tmp_path / "scaled"
    model = tiny_model(0)
    model.config.logit_scale = 0.5
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    trainer = make_trainer(str(path), tmp_path / "out", temperature=0.8)
    assert trainer._fgrpo_loss.temperature == pytest.approx(1.6)
    assert_parity(trainer, fixed_batch(trainer))


def test_moe_load_balancing_loss_equals_trl(tmp_path):
    """A Mixture-of-Experts model (a one-layer Mixtral with four experts): TRL adds the router's
    load-balancing loss; so does the drop-in, from the same forward."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=len(TOKENS), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        router_aux_loss_coef=0.02, output_router_logits=True, max_position_embeddings=64,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 2
    model.save_pretrained(tmp_path / "moe")
    tiny_tokenizer().save_pretrained(tmp_path / "moe")
    trainer = make_trainer(str(tmp_path / "moe"), tmp_path / "out")
    assert trainer.aux_loss_enabled
    assert_parity(trainer, fixed_batch(trainer))
    assert trainer._metrics["train"]["aux_loss"]


def test_fgrpo_loss_type_takes_the_vllm_ratio_and_entropy_bonus(trainer_and_batch):
    """loss_type "fgrpo" weighs each token by TRL's vLLM IS ratio and subtracts the entropy
    bonus (both f-GRPO options); the GRPO-only options raise at construction, naming them."""
    trainer, batch = trainer_and_batch
    configure(trainer, loss_type="fgrpo", beta=0.1)
    plain = trainer._compute_loss(trainer.model, batch)
    configure(trainer, loss_type="fgrpo", beta=0.1, use_vllm=True, entropy_coef=0.05,
              vllm_importance_sampling_correction=True)  # fmt: skip
    vllm_inputs(batch, "token_truncate")
    assert trainer._fgrpo_loss.opts.entropy_coef == 0.05
    weighted = trainer._compute_loss(trainer.model, batch)
    assert torch.isfinite(weighted) and float(weighted) != float(plain)
    with pytest.raises(NotImplementedError, match="^loss_type: .*top_entropy_quantile"):
        configure(trainer, loss_type="gift", beta=0.1, top_entropy_quantile=0.5)
