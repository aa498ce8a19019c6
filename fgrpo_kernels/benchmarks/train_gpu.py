"""The `train-gpu` workload: one GRPO optimizer step (forward, loss, backward, AdamW) of a
Qwen2.5-1.5B-shaped model, as a user deciding whether to switch would run it.

The model is Qwen2ForCausalLM with Qwen2.5-1.5B's shape (H 1536, 28 layers, 12 heads, 2 KV
heads, MLP 8960, V 151,936, tied embeddings) at random init, in the case's dtype (bf16 on the
GPU), built on the device, gradient checkpointing on (non-reentrant). H other than 1536 gives a
2-layer toy of it (`--tiny`, on the CPU). One step = TRL's `_compute_loss` on a fixed batch of B
completions of T tokens (dapo, token level, β 0.04, old and reference log-probs given) +
backward + `torch.optim.AdamW.step` + `zero_grad`; the reference model is not built (the batch
gives its log-probs; see `_trainer`). Impls:

- `trl`: TRL's GRPOTrainer as shipped (its chunked fused log-prob head);
- `trl_liger_kernel`: GRPOTrainer with `use_liger_kernel=True` (TRL 1.16 then applies Liger's
  layer kernels: RMSNorm, RoPE, SwiGLU, as `Trainer.train` would; the loss stays TRL's) — CUDA
  only (on the CPU an `unavailable` row);
- `ours`: `fgrpo_kernels.integrations.trl.FusedGRPOTrainer` (the drop-in).

Rows give the step time (median of the timed steps, after one warm-up step that also allocates
AdamW's state), peak memory beyond the model's weights and the batch, and tokens/s. A case
whose estimated memory (`memory_bytes`) exceeds the GPU's free memory is skipped, its note
giving both numbers.
"""

from __future__ import annotations

import tempfile

import torch

from .train_step import batch
from .workload import GRPO_BETA

IMPLS = ("trl", "trl_liger_kernel", "ours")
QWEN25_1_5B = dict(
    hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
    num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
)  # fmt: skip


def config(vocab: int, hidden: int, positions: int):
    """Qwen2.5-1.5B's config at H 1536, else a 2-layer toy of width `hidden`."""
    from transformers import Qwen2Config

    shape = dict(QWEN25_1_5B)
    if hidden != QWEN25_1_5B["hidden_size"]:
        shape.update(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return Qwen2Config(vocab_size=vocab, max_position_embeddings=positions, use_cache=False,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2, **shape)  # fmt: skip


def parameters(cfg) -> int:
    """The model's parameter count (tied head counted once)."""
    H, L, V, F = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.intermediate_size
    kv = H // cfg.num_attention_heads * cfg.num_key_value_heads
    layer = H * H + H + 2 * (H * kv + kv) + H * H + 3 * H * F + 2 * H
    return V * H * (1 if cfg.tie_word_embeddings else 2) + L * layer + H


def step_flops(case) -> float:
    """Matmul FLOPs of one step: 8·P·N (forward, recomputed forward, backward) + attention."""
    cfg = config(case.vocab, case.hidden, case.seq_len + 64)
    B, T, H, L = case.generations, case.seq_len, cfg.hidden_size, cfg.num_hidden_layers
    return 8 * parameters(cfg) * case.tokens + 8 * B * T * T * H * L  # causal: half of 4·2·T²·H


def memory_bytes(case) -> int:
    """Estimated peak: weights, gradients and AdamW's two moments in the model's dtype, the
    checkpointed hidden states, one layer's recomputed activations, the log-prob head's chunk."""
    cfg = config(case.vocab, case.hidden, case.seq_len + 64)
    size = torch.empty((), dtype=getattr(torch, case.dtype)).element_size()
    N, H, L = case.tokens, cfg.hidden_size, cfg.num_hidden_layers
    states = 4 * parameters(cfg) * size
    acts = N * H * size * L + N * (6 * H + 3 * cfg.intermediate_size) * size
    return int(states + acts + 4 * N * 4096 * 4)


def unavailable(case) -> str | None:
    """Why `case` cannot run here (None: it can)."""
    if case.impl not in IMPLS:
        return f"no train-gpu impl named {case.impl!r} (expected one of {IMPLS})"
    if case.impl == "trl_liger_kernel" and case.device != "cuda":
        # NB: not even under TRITON_INTERPRET=1: one of Liger's layer kernels fails there
        return "use_liger_kernel swaps in Liger's Triton layer kernels: CUDA only"
    if case.device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        need = memory_bytes(case)
        if need > 0.95 * free:
            return (f"skipped: needs ~{need / 2**30:.0f} GiB (estimate), "
                    f"{free / 2**30:.0f} GiB free")  # fmt: skip
    return None


def _trainer(case, model, path: str):
    from datasets import Dataset

    from fgrpo_kernels.integrations.trl import FusedGRPOConfig, FusedGRPOTrainer
    from fgrpo_kernels.trainer.tiny import tiny_tokenizer

    B, T, cuda = case.generations, case.seq_len, case.device == "cuda"
    args = FusedGRPOConfig(
        output_dir=path, per_device_train_batch_size=B, num_generations=B,
        max_completion_length=T, beta=0.0, loss_type="dapo", bf16=cuda and
        case.dtype == "bfloat16", use_cpu=not cuda, report_to="none", save_strategy="no",
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
        use_liger_kernel=case.impl == "trl_liger_kernel",
    )  # fmt: skip
    if case.impl == "ours":
        cls = FusedGRPOTrainer
    else:
        from trl import GRPOTrainer as cls
    trainer = cls(
        model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
        train_dataset=Dataset.from_dict({"prompt": ["1"] * B}), processing_class=tiny_tokenizer(),
    )  # fmt: skip
    trainer.current_gradient_accumulation_steps = 1
    # NB: built with β 0 so that TRL loads no reference model from the hub name of the model
    # (there is none: random init); the batch carries the reference log-probs, so β 0.04 after
    # construction gives the step its KL term, as a trainer with a reference model computes it.
    trainer.beta = GRPO_BETA
    if args.use_liger_kernel:  # what Trainer.train() does first (transformers 5)
        from transformers.integrations.liger import apply_liger_kernel

        apply_liger_kernel(trainer.model, args.liger_kernel_config)
    if case.impl == "ours":
        trainer._fgrpo_loss = trainer._fgrpo_build_loss()
    return trainer


class TrainGpuJob:
    """Builds the model, trainer, optimizer and batch of `case`; `run()` is one optimizer step."""

    def __init__(self, case):
        from transformers import Qwen2ForCausalLM

        why = unavailable(case)
        if why is not None:
            raise ValueError(f"case: {why}")
        dev, dtype = torch.device(case.device), getattr(torch, case.dtype)
        self._dir = tempfile.TemporaryDirectory(prefix="fgrpo-train-gpu-")
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.manual_seed(case.seed)
            with dev:
                model = Qwen2ForCausalLM(config(case.vocab, case.hidden, case.seq_len + 64))
        model = model.to(dtype)
        if hasattr(model, "activation_checkpointing_enable"):  # transformers ≥ 5 name
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        self.trainer = _trainer(case, model, self._dir.name)
        self.model = self.trainer.model.to(dev)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-6)
        inputs = batch(case.generations, case.seq_len, case.vocab, case.seed)
        self.inputs = {k: v.to(dev) if torch.is_tensor(v) else v for k, v in inputs.items()}
        cfg = self.model.config
        self.note = (f"{parameters(cfg) / 1e9:.3g}B parameters, {cfg.num_hidden_layers} layers, "
                     "gradient checkpointing, AdamW")  # fmt: skip

    def run(self, small: bool = False) -> float:
        loss = self.trainer._compute_loss(self.model, self.inputs)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def reset(self) -> None:
        pass
