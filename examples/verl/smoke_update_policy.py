"""CPU smoke run of verl 0.9.1's actor update with our fused head (fused-kernel backend "fgrpo").

verl 0.9.1 has no `DataParallelPPOActor` (`verl/workers/actor/dp_actor.py` is gone): its actor
update is `ActorRolloutRefWorker.update_actor` -> `TrainingWorker.train_mini_batch` ->
`train_batch` -> the FSDP engine's `train_batch(data, loss_function=partial(ppo_loss, config))`,
and `compute_log_prob` is `TrainingWorker.infer_batch` -> the engine's `infer_batch`. The worker
module cannot be imported without verl's rollout server stack (uvicorn, needed by
`verl.checkpoint_engine`) and starts a Ray-style process group, so this script drives the
smallest entry point below it that runs on a CPU: verl's own `FSDPEngineWithLMHead`, built from
verl's own Hydra config (`verl/trainer/config/ppo_trainer.yaml` plus overrides, as
`python3 -m verl.trainer.main_ppo` does), FSDP2-wrapped over a one-process gloo group, with
verl's `ppo_loss` and its optimizer step. The data takes the trainer's path
(`RayPPOTrainer._compute_old_log_prob` / `_update_actor`): a padded `DataProto` ->
`left_right_2_no_padding` -> the engine. Advantages are verl's GRPO outcome advantages
(`compute_grpo_outcome_advantage`, groups by `uid`); old log-probs come from the actor's own
`compute_log_prob`, as in the trainer.

What verl needs on a CPU (nothing of it is ours): a CPU `PlatformBase` (verl's platform plugin
point, `set_platform`; without a GPU verl falls back to its CUDA platform), the FSDP engine
registered for the device "cpu" (`EngineRegistry`), FSDP2 (verl's FSDP1 path refuses CPU
parameters), fp32 mixed precision, sdpa attention (no flash-attn), no torch.compile.

Cases (CASES): a tied lm_head, rmpad (`use_remove_padding=True`) and padded; an untied lm_head,
rmpad, where FSDP2 hands the patched forward the lm_head weight as a sharded DTensor. In each,
the run with our three config lines is compared with references from the same saved weights:
verl's torch fused-kernel backend (tied only: it does not take the DTensor) and stock verl
(no fused kernels). Checks (`failures`):
- our head ran: `fgrpo_kernels.integrations.verl.linear_cross_entropy` is counted, once per
  micro-batch forward in `compute_log_prob` and in the update, while verl's own Triton and torch
  kernels raise if reached;
- log-probs and entropies from `compute_log_prob`, the `actor/entropy_loss` metric and every
  parameter's gradient in the update equal each reference's (fp32, relative error <= 1e-5);
- `actor/pg_loss` is finite, every parameter's gradient is finite and nonzero, every parameter
  changed in the optimizer step.

Run (in the verl venv, bench/verl_env.sh):
    python examples/verl/smoke_update_policy.py [--layout rmpad|padded|all] [--json out.json]
Exit status 0 when every check passes, 1 otherwise. `--backend stock` leaves our three lines
out: the negative control, it must fail ("our head was called 0 times").
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import socket
import sys
import tempfile
import types
from functools import partial

import torch

LAYOUTS = ("rmpad", "padded")
TOLERANCE = 1e-5
TEMPERATURE = 0.7
PROMPT_LENS = (6, 6, 3, 3, 1, 1, 4, 4)  # left-padded to 6; one prompt per group
RESPONSE_LENS = (5, 2, 4, 3, 1, 5, 3, 2)  # right-padded to 5
GROUP = 2  # rollout.n: responses per prompt, one uid per group
REWARDS = (1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0)  # no group constant: no zero advantages
VOCAB = 64
MICRO_BATCH = 4  # two micro-batches per forward: gradient accumulation is exercised
# parameter names with no gradient, a non-finite one, an all-zero one, no change in the step
GRADIENT_CHECKS = ("grads_missing", "grads_nonfinite", "grads_zero", "unchanged")


_UNPATCHED = {}  # Qwen2ForCausalLM.forward before verl's monkey patch first replaced it


class SmokeFailure(AssertionError):
    pass


class VerlKernelCalled(RuntimeError):
    pass


def _trap(*args, **kwargs):
    raise VerlKernelCalled("verl's own linear_cross_entropy kernel ran under the fgrpo backend")


# --------------------------------------------------------------------------- verl on a CPU


def _cpu_platform():
    """verl's PlatformBase for a CPU: device "cpu", gloo, no device memory to report."""
    from verl.plugin.platform.platform_base import PlatformBase

    def zero(*args, **kwargs):
        return 0

    memory = types.SimpleNamespace(
        max_memory_allocated=zero,
        max_memory_reserved=zero,
        memory_allocated=zero,
        memory_reserved=zero,
        mem_get_info=lambda *a: (0, 0),
        reset_peak_memory_stats=lambda *a: None,
        empty_cache=lambda: None,
        synchronize=lambda *a: None,
        is_available=lambda: True,
        device_count=lambda: 1,
        current_device=lambda: "cpu",
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
    )

    class PlatformCPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = memory

        def is_available(self):
            return True

        def current_device(self):
            return "cpu"

        def device_count(self):
            return 1

        def set_device(self, device_index):
            pass

        def synchronize(self, device_index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            pass

        def empty_cache(self):
            pass

        def get_device_capability(self, device_index=0):
            return None, None

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg):
            return contextlib.nullcontext()

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def ray_resource_name(self):
            return "CPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

    return PlatformCPU()


def _verl_on_cpu():
    """Point verl at the CPU and start a one-process gloo group (what a Ray worker gets)."""
    from verl.plugin.platform import platform_manager

    platform_manager.set_platform(_cpu_platform())
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    registry = EngineRegistry._engines["language_model"]
    for strategy in ("fsdp", "fsdp2"):
        registry.setdefault(strategy, {}).setdefault("cpu", FSDPEngineWithLMHead)
    if not torch.distributed.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for key, value in dict(RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1").items():
            os.environ.setdefault(key, str(value))
        os.environ["MASTER_PORT"] = str(port)
        from verl.utils.distributed import initialize_global_process_group_ray

        initialize_global_process_group_ray(backend="gloo")


# --------------------------------------------------------------------------- model, config, data


def _tiny_qwen2(path: str, tied: bool):
    """A random fp32 Qwen2 (2 layers, hidden 32, vocabulary 64; lm_head tied to the embedding as
    in Qwen2-0.5B/1.5B, or untied as in Qwen2-7B) and a character tokenizer, saved where
    `actor_rollout_ref.model.path` points."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fgrpo_kernels.trainer.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return tokenizer


# the lines of examples/verl/run_grpo_fgrpo.sh that differ from verl's stock GRPO example
OUR_LINES = (
    "actor_rollout_ref.model.external_lib=fgrpo_kernels.integrations.verl_enable",
    "actor_rollout_ref.model.use_fused_kernels=True",
    "actor_rollout_ref.model.fused_kernel_options.impl_backend={backend}",
)


def _verl_config(model_path: str, backend: str, rmpad: bool, loss_mode: str):
    """verl's Hydra trainer config (ppo_trainer.yaml) for a CPU-sized run, with our three lines
    for the fused-kernel backend `backend`, or without them (backend "stock")."""
    import verl
    from hydra import compose, initialize_config_dir

    overrides = [
        "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.model.path={model_path}",
        f"actor_rollout_ref.model.use_remove_padding={rmpad}",
        *(() if backend == "stock" else (line.format(backend=backend) for line in OUR_LINES)),
        # CPU smoke sizes: no flash-attn, fp32, no torch.compile, a visible optimizer step
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={len(PROMPT_LENS) // GROUP}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MICRO_BATCH}",
        f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.optim.weight_decay=0",
        f"actor_rollout_ref.rollout.n={GROUP}",
        f"actor_rollout_ref.rollout.temperature={TEMPERATURE}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={MICRO_BATCH}",
    ]
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_trainer", overrides=overrides)


def _engine(config):
    """The actor's FSDP engine and its ActorConfig, built as ActorRolloutRefWorker.init_model
    and TrainingWorker.__init__ build them."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine import EngineRegistry

    ar = config.actor_rollout_ref
    model_config = omega_conf_to_dataclass(ar.model)  # imports external_lib
    actor_config = omega_conf_to_dataclass(ar.actor)
    actor_config.model_config = model_config
    engine_config = actor_config.engine
    engine_config.use_dynamic_bsz = ar.actor.use_dynamic_bsz
    engine_config.infer_max_token_len_per_gpu = ar.rollout.log_prob_max_token_len_per_gpu
    engine_config.infer_micro_batch_size_per_gpu = ar.rollout.log_prob_micro_batch_size_per_gpu
    engine_config.max_token_len_per_gpu = ar.actor.ppo_max_token_len_per_gpu
    engine_config.micro_batch_size_per_gpu = ar.actor.ppo_micro_batch_size_per_gpu
    engine_config.use_remove_padding = model_config.use_remove_padding
    engine_config.use_fused_kernels = model_config.use_fused_kernels
    model_config.model_type = "language_model"
    engine = EngineRegistry.new(
        model_type="language_model",
        backend=engine_config.strategy,
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=actor_config.optim,
        checkpoint_config=actor_config.checkpoint,
    )
    engine.initialize()
    return engine, actor_config


def _rollout_batch(pad_token_id: int):
    """A padded DataProto as the trainer holds it after rollout and reward: left-padded prompts,
    right-padded responses, `uid` per group, token-level rewards on each response's last token."""
    import numpy as np
    from verl import DataProto

    g = torch.Generator().manual_seed(1)
    n, p, r = len(PROMPT_LENS), max(PROMPT_LENS), max(RESPONSE_LENS)
    prompt_mask = (torch.arange(p) >= p - torch.tensor(PROMPT_LENS)[:, None]).long()
    response_mask = (torch.arange(r) < torch.tensor(RESPONSE_LENS)[:, None]).long()
    prompts = torch.randint(4, VOCAB, (n // GROUP, p), generator=g).repeat_interleave(GROUP, 0)
    prompts = torch.where(prompt_mask.bool(), prompts, pad_token_id)
    responses = torch.where(
        response_mask.bool(), torch.randint(4, VOCAB, (n, r), generator=g), pad_token_id
    )
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    rewards = torch.zeros(n, r)
    rewards[torch.arange(n), torch.tensor(RESPONSE_LENS) - 1] = torch.tensor(REWARDS)
    return DataProto.from_dict(
        tensors=dict(
            prompts=prompts,
            responses=responses,
            input_ids=torch.cat([prompts, responses], 1),
            attention_mask=attention_mask,
            position_ids=(attention_mask.cumsum(1) - 1).clamp_min(0),
            response_mask=response_mask.float(),
            token_level_rewards=rewards,
        ),
        non_tensors=dict(uid=np.repeat(np.arange(n // GROUP), GROUP).astype(str)),
        meta_info={"temperature": TEMPERATURE},
    )


def _worker_keys(engine, rmpad: bool, infer: bool) -> dict:
    """What TrainingWorker.train_batch / infer_batch add to the batch before the engine runs."""
    ec = engine.engine_config
    return dict(
        use_remove_padding=rmpad,
        use_dynamic_bsz=ec.use_dynamic_bsz,
        max_token_len_per_gpu=ec.infer_max_token_len_per_gpu if infer else ec.max_token_len_per_gpu,
        micro_batch_size_per_gpu=(
            ec.infer_micro_batch_size_per_gpu if infer else ec.micro_batch_size_per_gpu
        ),
        use_fused_kernels=ec.use_fused_kernels,
        temperature=TEMPERATURE,
    )


def _compute_log_prob(engine, batch, rmpad: bool):
    """RayPPOTrainer._compute_old_log_prob -> ActorRolloutRefWorker.compute_log_prob: padded
    [B, R] log-probs and entropies of the responses."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False)
    tu.assign_non_tensor(td, **_worker_keys(engine, rmpad, infer=True))
    with engine.eval_mode():
        out = engine.infer_batch(td, loss_function=None)
    out = out["model_output"]
    return no_padding_2_padding(out["log_probs"], td), no_padding_2_padding(out["entropy"], td)


def _update_actor(engine, actor_config, batch, rmpad: bool):
    """RayPPOTrainer._update_actor -> update_actor -> train_mini_batch -> train_batch, one
    mini-batch, one PPO epoch. Returns the metrics and each parameter's gradient as the optimizer
    saw it (after verl's clipping)."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric import Metric
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding

    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(
        td,
        calculate_entropy=True,
        global_batch_size=len(batch),
        compute_loss=True,
        global_token_num=list(td["input_ids"].offsets().diff().tolist()),
        update_lr_scheduler=True,
        disable_auto_offload=True,
    )
    tu.assign_non_tensor(td, **_worker_keys(engine, rmpad, infer=False))
    grads = {}

    def capture(optimizer, args, kwargs):
        for name, p in engine.module.named_parameters():
            grads[name] = None if p.grad is None else _full(p.grad).clone()

    hook = engine.optimizer.register_step_pre_hook(capture)
    try:
        with engine.train_mode(disable_auto_offload=True):
            out = engine.train_batch(td, loss_function=partial(ppo_loss, config=actor_config))
        engine.lr_scheduler_step()
    finally:
        hook.remove()
    metrics = {}
    for key, value in out["metrics"].items():
        if isinstance(value, list):
            value = Metric.aggregate_dp(value) if value and isinstance(value[0], Metric) else value
        metrics[key] = value.aggregate() if isinstance(value, Metric) else value
    metrics["loss"] = float(sum(out["loss"]) if isinstance(out["loss"], list) else out["loss"])
    return metrics, grads


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _params(engine) -> dict:
    return {n: _full(p.detach()).clone() for n, p in engine.module.named_parameters()}


# --------------------------------------------------------------------------- the run


@contextlib.contextmanager
def _count_our_head(trap_verl: bool):
    """Count the calls of our head; with trap_verl, verl's own kernels raise."""
    from verl.utils.experimental import torch_functional
    from verl.utils.kernel.linear_cross_entropy import LinearCrossEntropy

    from fgrpo_kernels.integrations import verl as ours

    calls = []
    real = ours.linear_cross_entropy

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    saved = (LinearCrossEntropy.forward, torch_functional.FusedLinearForPPOFunction.forward)
    ours.linear_cross_entropy = counted
    if trap_verl:
        LinearCrossEntropy.forward = staticmethod(_trap)
        torch_functional.FusedLinearForPPOFunction.forward = staticmethod(_trap)
    try:
        yield calls
    finally:
        ours.linear_cross_entropy = real
        LinearCrossEntropy.forward = staticmethod(saved[0])
        torch_functional.FusedLinearForPPOFunction.forward = staticmethod(saved[1])


def _rel(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _advantages(batch):
    """verl's GRPO outcome advantage (algorithm.adv_estimator=grpo), grouped by uid."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    adv, _ = compute_grpo_outcome_advantage(
        token_level_rewards=batch.batch["token_level_rewards"],
        response_mask=batch.batch["response_mask"],
        index=batch.non_tensor_batch["uid"],
    )
    return adv


def run_case(model_path, tokenizer, tied, layout, backend, loss_mode, references):
    """One layout of one model: each reference (verl's torch backend "torch", or "stock": verl
    without fused kernels, the stock GRPO config), then `backend` with verl's kernels trapped."""
    from transformers import Qwen2ForCausalLM

    rmpad = layout == "rmpad"
    batch = _rollout_batch(tokenizer.pad_token_id)
    runs = {}
    forward = _UNPATCHED.setdefault("forward", Qwen2ForCausalLM.forward)
    for name in (*references, "ours"):
        impl = backend if name == "ours" else name
        config = _verl_config(model_path, impl, rmpad, loss_mode)
        # verl's monkey patch replaces the model class's forward; each run here is a fresh
        # verl process's, so it starts from the unpatched class
        Qwen2ForCausalLM.forward = forward
        engine, actor_config = _engine(config)
        patched = getattr(engine.module, "_verl_fused_kernels_backend", "stock")
        if patched != impl:
            raise SmokeFailure(f"the model's fused-kernel backend is {patched!r}, not {impl!r}")
        with _count_our_head(trap_verl=name == "ours") as calls:
            logp, entropy = _compute_log_prob(engine, batch, rmpad)
            calls_log_prob = len(calls)
            step = _rollout_batch(tokenizer.pad_token_id).union(  # union is in place
                type(batch).from_dict(
                    tensors=dict(old_log_probs=logp.float(), advantages=_advantages(batch))
                )
            )
            before = _params(engine)
            metrics, grads = _update_actor(engine, actor_config, step, rmpad)
            after = _params(engine)
        runs[name] = dict(
            logp=logp,
            entropy=entropy,
            metrics=metrics,
            grads=grads,
            changed={n: bool((after[n] - before[n]).abs().max() > 0) for n in before},
            calls_log_prob=calls_log_prob,
            calls_update=len(calls) - calls_log_prob,
        )
    ours = runs.pop("ours")
    mask = batch.batch["response_mask"].bool()
    grads = ours["grads"]
    present = [n for n in grads if grads[n] is not None]
    return dict(
        layout=layout,
        tied=tied,
        backend=backend,
        loss_mode=loss_mode,
        metrics={k: v for k, v in ours["metrics"].items() if isinstance(v, int | float)},
        micro_batches=math.ceil(len(batch) / MICRO_BATCH),
        head_calls_compute_log_prob=ours["calls_log_prob"],
        head_calls_update=ours["calls_update"],
        references={
            name: dict(
                pg_loss=ref["metrics"].get("actor/pg_loss"),
                entropy_loss_rel_err=_rel(
                    torch.tensor(ours["metrics"]["actor/entropy_loss"]),
                    torch.tensor(ref["metrics"]["actor/entropy_loss"]),
                ),
                head_calls=ref["calls_log_prob"] + ref["calls_update"],
                logp_rel_err=_rel(ours["logp"][mask], ref["logp"][mask]),
                entropy_rel_err=_rel(ours["entropy"][mask], ref["entropy"][mask]),
                grad_rel_err={n: _rel(grads[n], ref["grads"][n]) for n in present},
            )
            for name, ref in runs.items()
        },
        params=sorted(grads),
        grads_missing=sorted(n for n, g in grads.items() if g is None),
        grads_nonfinite=sorted(n for n in present if not grads[n].isfinite().all()),
        grads_zero=sorted(n for n in present if not grads[n].abs().max() > 0),
        unchanged=sorted(n for n, c in ours["changed"].items() if not c),
    )


def failures(result: dict) -> list[str]:
    """What one case's result gets wrong; empty when every check passes."""
    bad = []
    loss = result["metrics"].get("actor/pg_loss")
    if not isinstance(loss, float) or not math.isfinite(loss):
        bad.append(f"actor/pg_loss: expected a finite float; got {loss!r}")
    n = result["micro_batches"]
    for key in ("head_calls_compute_log_prob", "head_calls_update"):
        if result[key] != n:
            bad.append(f"{key}: our head was called {result[key]} times, expected {n}")
    if not result["references"]:
        bad.append("no reference run")
    for name, ref in result["references"].items():
        if ref["head_calls"]:
            bad.append(f"our head ran in the reference run {name!r}")
        for key in ("logp_rel_err", "entropy_rel_err", "entropy_loss_rel_err"):
            if not ref[key] <= TOLERANCE:
                bad.append(f"{key}: {ref[key]:.3g} > {TOLERANCE} against {name!r}")
        worst = {k: v for k, v in ref["grad_rel_err"].items() if not v <= TOLERANCE}
        if worst:
            bad.append(f"gradients differ from {name!r}: {worst}")
    for key in GRADIENT_CHECKS:
        if result[key]:
            bad.append(f"{key}: {result[key]}")
    if not result["params"]:
        bad.append("no parameters")
    return bad


def _loss_mode(name: str) -> str:
    from verl.trainer.ppo import core_algos

    if name not in core_algos.POLICY_LOSS_REGISTRY and importlib.util.find_spec(
        "fgrpo_kernels.integrations.verl_losses"
    ):
        from fgrpo_kernels.integrations import verl_losses

        verl_losses.register_losses()
    if name not in core_algos.POLICY_LOSS_REGISTRY:
        raise ValueError(
            f"loss_mode: {name!r} is not in verl's POLICY_LOSS_REGISTRY "
            f"({sorted(core_algos.POLICY_LOSS_REGISTRY)})"
        )
    return name


# (tied lm_head, layout, references). Tied: the lm_head weight is the embedding's, in FSDP2's
# root unit, a plain tensor in the patched forward, so verl's torch backend runs beside ours.
# Untied: FSDP2 makes lm_head its own unit and the patched root forward sees its weight as a
# sharded DTensor, which verl 0.9.1's torch backend does not take (aten.mm with a Tensor and a
# DTensor) and our head gathers; the reference there is stock verl (no fused kernels).
CASES = (
    (True, "rmpad", ("torch", "stock")),
    (True, "padded", ("torch", "stock")),
    (False, "rmpad", ("stock",)),
)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=(*LAYOUTS, "all"), default="all")
    parser.add_argument(
        "--backend",
        choices=("fgrpo", "stock"),
        default="fgrpo",
        help="stock: verl without our lines (the negative control: it must fail)",
    )
    parser.add_argument("--loss-mode", default="vanilla", help="actor.policy_loss.loss_mode")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    _verl_on_cpu()
    loss_mode = _loss_mode(args.loss_mode)
    results = []
    for tied, layout, references in CASES:
        if args.layout not in ("all", layout):
            continue
        with tempfile.TemporaryDirectory() as model_path:
            tokenizer = _tiny_qwen2(model_path, tied)
            result = run_case(
                model_path, tokenizer, tied, layout, args.backend, loss_mode, references
            )
        result["failures"] = failures(result)
        results.append(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    for r in results:
        m = r["metrics"]
        head = "tied" if r["tied"] else "untied (DTensor)"
        sound = not any(
            r[k] for k in ("grads_missing", "grads_nonfinite", "grads_zero", "unchanged")
        )
        print(
            f"[{r['layout']}, lm_head {head}] backend={r['backend']} loss_mode={r['loss_mode']} "
            f"actor/pg_loss={m.get('actor/pg_loss'):.6g} "
            f"actor/entropy_loss={m.get('actor/entropy_loss'):.6g} "
            f"grad_norm={m.get('grad_norm'):.4g}; "
            f"our head called {r['head_calls_compute_log_prob']}x in compute_log_prob, "
            f"{r['head_calls_update']}x in update_actor; {len(r['params'])} parameters, "
            f"all with finite nonzero gradients and changed: {sound}"
        )
        for name, ref in r["references"].items():
            print(
                f"    vs {name}: actor/pg_loss {ref['pg_loss']:.6g}, relative error logp "
                f"{ref['logp_rel_err']:.1e}, entropy {ref['entropy_rel_err']:.1e}, entropy_loss "
                f"{ref['entropy_loss_rel_err']:.1e}, gradients "
                f"{max(ref['grad_rel_err'].values(), default=float('nan')):.1e}"
            )
        for line in r["failures"]:
            print(f"    FAIL {line}", file=sys.stderr)
    return results


if __name__ == "__main__":
    sys.exit(1 if any(r["failures"] for r in main()) else 0)
