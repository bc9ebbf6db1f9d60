#!/usr/bin/env bash
# Upstream's one-step-off-policy entry point on the bundled tiny model and the arithmetic task, on CPU: batch t+1
# is generated in the rollout process while batch t trains in the trainer process (docs/async.md, "Upstream's
# async entry points"). Extra Hydra overrides are appended.
set -euo pipefail
${PYTHON:-python3} -m verl.experimental.one_step_off_policy.main_ppo \
    +demo=arith \
    algorithm.adv_estimator=grpo \
    data.train_batch_size=8 \
    data.max_prompt_length=32 \
    data.max_response_length=8 \
    actor_rollout_ref.hybrid_engine=False \
    actor_rollout_ref.rollout.name=hf \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.actor.optim.lr=1e-4 \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \
    actor_rollout_ref.actor.use_kl_loss=False \
    rollout.nnodes=1 \
    rollout.n_gpus_per_node=1 \
    trainer.device=cpu \
    trainer.n_gpus_per_node=1 \
    trainer.nnodes=1 \
    trainer.total_training_steps=600 \
    trainer.test_freq=50 \
    trainer.project_name=verl_examples \
    trainer.experiment_name=one_step_off_arith_tiny \
    "$@"
