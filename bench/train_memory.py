"""Peak host memory of one GRPO training step: the fused loss (TRL drop-in) vs TRL's own loss.

    python bench/train_memory.py                      # V 32768, H 64, 4 × 4096 completion tokens
    python bench/train_memory.py --variants fused,trl,logits --batch 2
    python bench/train_memory.py --vllm-is sequence_mask   # with TRL's vLLM IS correction on

One step = TRL's `_compute_loss` + backward on a fixed synthetic batch (dapo, token level, with
old and reference log-probs), for a tiny Llama (2 layers, hidden H) with a real-size vocabulary
V and a long completion. Variants, each in a fresh subprocess:

- `fused`: FusedGRPOTrainer (fgrpo_kernels' FusedLinearGRPOLoss on the last hidden state);
- `trl`: TRL's GRPOTrainer as shipped (its chunked log-prob head, `add_fused_lm_head`);
- `logits`: the textbook pipeline that materialises the [B, T, V] logits, then log_softmax;
- `backbone`: the backbone alone (forward + backward of a mean of its last hidden state), the
  floor every variant shares.

`--vllm-is MODE` turns on TRL's vLLM importance-sampling correction (`use_vllm`,
`vllm_importance_sampling_correction`, the given mode) with sampling log-probs 0.1 off the old
ones, as a vLLM rollout gives; `--bias-correction-kl` turns on TRL's default bias-corrected KL.

Peak = VmHWM − VmRSS around the step, with the high-water mark reset (/proc/self/clear_refs)
after the model, trainer and batch were built. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

VARIANTS = ("fused", "trl", "logits", "backbone")
VLLM_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def _batch(args, torch):
    g = torch.Generator().manual_seed(0)
    B, P, T, V = args.batch, args.prompt_length, args.completion_length, args.vocab
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1::2, T - T // 4 :] = 0  # ragged: every other completion ends early
    batch = {
        "prompt_ids": torch.randint(3, V, (B, P), generator=g),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.randint(3, V, (B, T), generator=g),
        "completion_mask": mask,
        "advantages": torch.randn(B, generator=g),
        "num_items_in_batch": mask.sum(),
        "old_per_token_logps": (-12.0 + 0.3 * torch.randn(B, T, generator=g)) * mask,
        "ref_per_token_logps": (-12.0 + 0.3 * torch.randn(B, T, generator=g)) * mask,
    }
    if args.vllm_is:  # TRL's ratio from the rollout engine's log-probs, in the given mode
        old = batch["old_per_token_logps"]
        sampling = old + 0.1 * torch.randn(B, T, generator=g)
        diff = (old - sampling) * mask
        if args.vllm_is.startswith("sequence"):
            diff = diff.sum(-1, keepdim=True)
        ratio = torch.exp(diff)
        if args.vllm_is.endswith("truncate"):
            ratio = ratio.clamp(max=3.0)
        else:
            ratio = ratio.masked_fill(ratio > 3.0, 0.0)
        batch.update(sampling_per_token_logps=sampling, importance_sampling_ratio=ratio)
    return batch


def child(args) -> dict:
    """Build everything, reset the high-water mark, run one step, report the peak increase."""
    os.environ.setdefault("FGRPO_BACKEND", "cpu")
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from trl import GRPOTrainer

    from fgrpo_kernels import reference
    from fgrpo_kernels.bench.process_memory import PeakRSS
    from fgrpo_kernels.integrations.trl import FusedGRPOConfig, FusedGRPOTrainer
    from fgrpo_kernels.trainer.tiny import tiny_model, tiny_tokenizer

    path = tempfile.mkdtemp(prefix="fgrpo-mem-")
    positions = args.prompt_length + args.completion_length + 8
    model = tiny_model(
        0, vocab_size=args.vocab, hidden_size=args.hidden, max_position_embeddings=positions
    )
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    config = FusedGRPOConfig(
        output_dir=path, per_device_train_batch_size=args.batch, num_generations=args.batch,
        max_completion_length=args.completion_length, beta=args.beta, loss_type="dapo",
        use_bias_correction_kl=args.bias_correction_kl, bf16=False, use_cpu=True,
        report_to="none", save_strategy="no",
    )  # fmt: skip
    cls = FusedGRPOTrainer if args.child == "fused" else GRPOTrainer
    trainer = cls(
        model=path, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=config,
        train_dataset=Dataset.from_dict({"prompt": ["1"] * args.batch}),
        processing_class=tiny_tokenizer(),
    )  # fmt: skip
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    if args.vllm_is:  # as GRPOConfig(use_vllm=True, ...) would set, without a vLLM server
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
        trainer.vllm_importance_sampling_mode = args.vllm_is
    batch = _batch(args, torch)
    T = args.completion_length

    def logits_loss(model, inputs):
        ids, mask = inputs["completion_ids"], inputs["completion_mask"]
        out = model(
            input_ids=torch.cat([inputs["prompt_ids"], ids], 1),
            attention_mask=torch.cat([inputs["prompt_mask"], mask], 1),
        )
        logp = torch.log_softmax(out.logits[:, -T - 1 : -1].float(), -1)
        logps = logp.gather(-1, ids[..., None])[..., 0] * mask
        return reference.grpo_loss(
            logps, inputs["old_per_token_logps"], inputs["ref_per_token_logps"],
            inputs["advantages"], mask, "dapo", args.beta,
            use_bias_correction_kl=args.bias_correction_kl,
            vllm_is_ratio=inputs.get("importance_sampling_ratio"),
        )  # fmt: skip

    def backbone_only(model, inputs):
        ids, mask = inputs["completion_ids"], inputs["completion_mask"]
        out = model.model(
            input_ids=torch.cat([inputs["prompt_ids"], ids], 1),
            attention_mask=torch.cat([inputs["prompt_mask"], mask], 1),
        )
        return out.last_hidden_state[:, -T - 1 : -1].float().mean()

    step = {"logits": logits_loss, "backbone": backbone_only}.get(args.child, trainer._compute_loss)
    peak = PeakRSS()
    start = time.perf_counter()
    loss = step(trainer.model, batch)
    loss.backward()
    seconds = time.perf_counter() - start
    return {
        "variant": args.child,
        "peak_mib": round(peak.extra() / 2**20, 1),
        "seconds": round(seconds, 2),
        "loss": float(loss),
        "tokens": int(batch["completion_mask"].sum()),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variants", default="fused,trl", help=f"comma list of {VARIANTS}")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="completions (one group)")
    p.add_argument("--prompt-length", type=int, default=16)
    p.add_argument("--completion-length", type=int, default=4096)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vllm-is", choices=VLLM_MODES, help="TRL's vLLM IS correction in this mode")
    p.add_argument("--bias-correction-kl", action="store_true", help="TRL's default KL")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)


def run(args) -> int:
    if args.child:
        print(json.dumps(child(args)))
        return 0
    rows = []
    options = ("vocab", "hidden", "batch", "prompt_length", "completion_length", "beta", "threads")
    passthrough = [x for k in options for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
    passthrough += ["--vllm-is", args.vllm_is] if args.vllm_is else []
    passthrough += ["--bias-correction-kl"] if args.bias_correction_kl else []
    for variant in args.variants.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), *passthrough, "--child", variant]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            rows.append({"variant": variant, "error": done.stderr.strip().splitlines()[-1:]})
        else:
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    shape = (
        f"V={args.vocab} H={args.hidden} B={args.batch} T={args.completion_length} "
        f"(prompt {args.prompt_length}), dapo, beta={args.beta}, fp32, CPU"
        f"{', vLLM IS ' + args.vllm_is if args.vllm_is else ''}"
        f"{', bias-corrected KL' if args.bias_correction_kl else ''}"
    )
    print(f"one training step (loss + backward), peak RSS increase; {shape}")
    print("| variant | peak MiB | seconds | loss |\n|---|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | error: {r['error']} | | |")
        else:
            print(
                f"| {r['variant']} | {r['peak_mib']:.1f} | {r['seconds']:.2f} | {r['loss']:.6f} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": shape, "rows": rows}, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
