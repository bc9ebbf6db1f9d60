#!/usr/bin/env bash
# GRPO on the bundled tiny model and the arithmetic task, on CPU with 2 worker processes.
# Extra Hydra overrides are appended: bash run_arith_tiny_cpu.sh trainer.total_training_steps=50
set -euo pipefail
${PYTHON:-python3} -m verl.trainer.main_ppo \
    --config-name=arith_demo \
    algorithm.adv_estimator=grpo \
    data.train_batch_size=32 \
    data.max_prompt_length=32 \
    data.max_response_length=8 \
    actor_rollout_ref.rollout.name=hf \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.actor.optim.lr=1e-4 \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.use_kl_loss=False \
    trainer.device=cpu \
    trainer.n_gpus_per_node=2 \
    trainer.nnodes=1 \
    trainer.project_name=verl_examples \
    trainer.experiment_name=grpo_arith_tiny \
    "$@"
