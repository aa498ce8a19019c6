#!/usr/bin/env bash
# A verl 0.9.1 GRPO run (GSM8K, Qwen2-7B-Instruct, one node of 8 GPUs) whose actor and reference
# log-probs come from our fused head: verl's fused-kernel backend "fgrpo".
#
# NOT RUN HERE: it needs GPUs, Ray and vLLM (the rollout). What has run is the CPU smoke test
# of the actor update below verl's workers: examples/verl/smoke_update_policy.py (README.md).
#
# The three lines marked "fgrpo" are what a verl run adds for our head (README.md says what
# each does). The rest is a trimmed GRPO config after verl's stock GRPO example,
# examples/grpo_trainer/run_qwen2-7b.sh in github.com/volcengine/verl. To run that stock
# script itself with our head and nothing else changed, point STOCK at it: it ends in "$@",
# so it receives the three lines as overrides.
# Every Ray worker must be able to import this package (pip install it in the workers'
# environment): verl imports external_lib in each worker before it patches the model.
#
# Usage: bash examples/verl/run_grpo_fgrpo.sh [more verl overrides]
#   MODEL, TRAIN, VAL: the model and the parquet files (verl's examples/data_preprocess/gsm8k.py)
#   STOCK=/path/to/verl/examples/grpo_trainer/run_qwen2-7b.sh: run the stock script instead
#   LOSS=fgrpo_pearson (or any fgrpo_<div> / fgrpo_<div>_seq): an f-GRPO run, i.e. two more
#     lines, our policy loss and our advantage estimator (Hydra: the later override wins)
set -euo pipefail

FGRPO_LINES=(
    actor_rollout_ref.model.external_lib=fgrpo_kernels.integrations.verl_enable
    actor_rollout_ref.model.use_fused_kernels=True
    actor_rollout_ref.model.fused_kernel_options.impl_backend=fgrpo
)
if [[ -n "${LOSS:-}" ]]; then
    FGRPO_LINES+=(
        actor_rollout_ref.actor.policy_loss.loss_mode="$LOSS"
        algorithm.adv_estimator=fgrpo
    )
fi
if [[ -n "${STOCK:-}" ]]; then
    exec bash "$STOCK" "${FGRPO_LINES[@]}" "$@"
fi

MODEL=${MODEL:-Qwen/Qwen2-7B-Instruct}
TRAIN=${TRAIN:-$HOME/data/gsm8k/train.parquet}
VAL=${VAL:-$HOME/data/gsm8k/test.parquet}

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    data.train_files="$TRAIN" \
    data.val_files="$VAL" \
    data.train_batch_size=1024 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.model.use_remove_padding=True \
    "${FGRPO_LINES[@]}" `# fgrpo` \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    trainer.logger='["console"]' \
    trainer.project_name=fgrpo_verl_grpo \
    trainer.experiment_name=qwen2_7b_gsm8k_fgrpo_head \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.total_epochs=15 \
    "$@"
