"""The `train-step` workload: one GRPO training step of a Qwen2-shaped model, as a bench job.

One step = the trainer's `_compute_loss` + backward on a fixed synthetic batch (dapo, token
level, β 0.04, old and reference log-probs given, every completion T tokens long), for a
Qwen2ForCausalLM with the real vocabulary (V 151,936), GQA, 2 layers of width H, untied head, and
B completions of T tokens. Impls:

- `trl`: TRL's GRPOTrainer as shipped (its chunked log-prob head, `trl.kernels`);
- `trl_liger`: GRPOTrainer whose loss is Liger's `LigerFusedLinearGRPOLoss` on the last hidden
  state (TRL 1.16's own `use_liger_kernel` swaps Liger's layer kernels, not the loss);
- `ours`: `fgrpo_kernels.integrations.trl.FusedGRPOTrainer` (the drop-in);
- `backbone`: the backbone alone (forward + backward of a mean of its last hidden state), the
  floor every variant shares.

TRL's `use_bias_correction_kl` is off by default (`--bias-correction-kl` turns it on), and so
is its vLLM importance-sampling correction (`--vllm-is MODE`: sampling log-probs 0.1 off the old
ones, as a rollout engine gives, and the ratio TRL derives from them in that mode); every impl
gets the same options, so the three losses stay the same number.
"""

from __future__ import annotations

import tempfile

import torch

from .workload import GRPO_BETA

IMPLS = ("backbone", "trl", "trl_liger", "ours")
PROMPT = 16
VLLM_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
VLLM_IS_CAP = 3.0  # TRL's vllm_importance_sampling_cap default


def qwen2_model(vocab: int, hidden: int, positions: int, seed: int = 0):
    """A seeded Qwen2ForCausalLM: V `vocab`, 2 layers of width `hidden`, 4 heads, 2 KV heads."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)


def batch(B: int, T: int, V: int, seed: int = 0, vllm_is: str | None = None) -> dict:
    """TRL's `_compute_loss` inputs: B completions of T tokens after a PROMPT-token prompt (and
    the rollout engine's log-probs and TRL's IS ratio with `vllm_is`)."""
    g = torch.Generator().manual_seed(seed)
    # NB: no padding: with a padded mask transformers hands SDPA a [B, 1, T, T] mask (8 GiB at
    # T 32k), which would dwarf the heads compared here; unpadded, SDPA runs its flash kernel.
    mask = torch.ones(B, T, dtype=torch.long)
    out = {
        "prompt_ids": torch.randint(3, V, (B, PROMPT), generator=g),
        "prompt_mask": torch.ones(B, PROMPT, dtype=torch.long),
        "completion_ids": torch.randint(3, V, (B, T), generator=g),
        "completion_mask": mask,
        "advantages": torch.randn(B, generator=g),
        "num_items_in_batch": mask.sum(),
        "old_per_token_logps": (-12.0 + 0.3 * torch.randn(B, T, generator=g)) * mask,
        "ref_per_token_logps": (-12.0 + 0.3 * torch.randn(B, T, generator=g)) * mask,
    }
    if vllm_is:  # TRL's ratio from the rollout engine's log-probs, in the given mode
        old = out["old_per_token_logps"]
        sampling = old + 0.1 * torch.randn(B, T, generator=g)
        diff = (old - sampling) * mask
        if vllm_is.startswith("sequence"):
            diff = diff.sum(-1, keepdim=True)
        ratio = torch.exp(diff)
        if vllm_is.endswith("truncate"):
            ratio = ratio.clamp(max=VLLM_IS_CAP)
        else:
            ratio = ratio.masked_fill(ratio > VLLM_IS_CAP, 0.0)
        out.update(sampling_per_token_logps=sampling, importance_sampling_ratio=ratio)
    return out


def _backbone_hidden(model, inputs):
    ids, mask, T = (
        inputs["completion_ids"],
        inputs["completion_mask"],
        inputs["completion_ids"].shape[1],
    )
    out = model.model(
        input_ids=torch.cat([inputs["prompt_ids"], ids], 1),
        attention_mask=torch.cat([inputs["prompt_mask"], mask], 1),
    )
    return out.last_hidden_state[:, -T - 1 : -1]


def _trainer(impl: str, path: str, case):
    from datasets import Dataset
    from trl import GRPOTrainer

    from fgrpo_kernels.integrations.trl import FusedGRPOConfig, FusedGRPOTrainer
    from fgrpo_kernels.trainer.tiny import tiny_tokenizer

    B, T = case.generations, case.seq_len
    qwen2_model(case.vocab, case.hidden, PROMPT + T + 8).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    config = FusedGRPOConfig(
        output_dir=path, per_device_train_batch_size=B, num_generations=B,
        max_completion_length=T, beta=GRPO_BETA, loss_type="dapo",
        use_bias_correction_kl=case.bias_correction_kl, bf16=False, use_cpu=True,
        report_to="none", save_strategy="no",
    )  # fmt: skip
    cls = {"ours": FusedGRPOTrainer, "trl_liger": _liger_trainer_class()}.get(impl, GRPOTrainer)
    trainer = cls(
        model=path, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=config,
        train_dataset=Dataset.from_dict({"prompt": ["1"] * B}), processing_class=tiny_tokenizer(),
    )  # fmt: skip
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    if case.vllm_is:  # as GRPOConfig(use_vllm=True, ...) would set, without a vLLM server
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
        trainer.vllm_importance_sampling_mode = case.vllm_is
    return trainer


def _liger_trainer_class():
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    from trl import GRPOTrainer

    class LigerLossGRPOTrainer(GRPOTrainer):
        """GRPOTrainer whose loss is Liger's fused linear GRPO loss (dapo, token level)."""

        def _compute_loss(self, model, inputs):
            if not hasattr(self, "_liger_loss"):
                self._liger_loss = LigerFusedLinearGRPOLoss(
                    beta=self.beta, compiled=False, epsilon_low=self.epsilon_low,
                    epsilon_high=self.epsilon_high, loss_type=self.loss_type,
                    temperature=self.temperature,
                    use_bias_correction_kl=self.args.use_bias_correction_kl,
                )  # fmt: skip
            head = model.lm_head
            loss, _ = self._liger_loss(
                _backbone_hidden(model, inputs), head.weight, inputs["completion_ids"],
                inputs["completion_mask"], inputs["advantages"], head.bias,
                ref_per_token_logps=inputs["ref_per_token_logps"],
                old_per_token_logps=inputs["old_per_token_logps"],
                vllm_is_ratio=inputs.get("importance_sampling_ratio"),
            )  # fmt: skip
            return loss

    return LigerLossGRPOTrainer


class TrainStepJob:
    """Builds the model, trainer and batch of `case`; `run()` is one loss + backward."""

    def __init__(self, case):
        if case.impl not in IMPLS:
            raise ValueError(f"impl: expected one of {IMPLS} for train-step; got {case.impl!r}")
        B, T, V = case.generations, case.seq_len, case.vocab
        self._dir = tempfile.TemporaryDirectory(prefix="fgrpo-train-step-")
        self.trainer = _trainer(case.impl, self._dir.name, case)
        self.model = self.trainer.model
        self.inputs = batch(B, T, V, case.seed, case.vllm_is)
        self.small = batch(B, 64, V, case.seed + 1, case.vllm_is)
        if case.impl == "backbone":
            self.loss = lambda model, inputs: _backbone_hidden(model, inputs).float().mean()
        else:
            self.loss = self.trainer._compute_loss

    def run(self, small: bool = False) -> float:
        loss = self.loss(self.model, self.small if small else self.inputs)
        loss.backward()
        return float(loss.detach())

    def reset(self) -> None:
        self.model.zero_grad(set_to_none=True)
