#!/usr/bin/env bash
# Upstream's fully-asynchronous entry point on the bundled tiny model and the arithmetic task, on CPU: one trainer
# process and one rollout process. A step trains ppo_mini_batch_size x require_batches = 8 prompts; the rollout
# pool generates up to (1 + staleness_threshold) x trigger_parameter_sync_step steps' prompts per weight version
# (docs/async.md, "Upstream's async entry points"). Extra Hydra overrides are appended.
set -euo pipefail
${PYTHON:-python3} -m verl.experimental.fully_async_policy.fully_async_main \
    +demo=arith \
    algorithm.adv_estimator=grpo \
    data.train_batch_size=0 \
    data.max_prompt_length=32 \
    data.max_response_length=8 \
    actor_rollout_ref.hybrid_engine=False \
    actor_rollout_ref.rollout.name=hf \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.calculate_log_probs=True \
    actor_rollout_ref.actor.optim.lr=1e-4 \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \
    actor_rollout_ref.actor.use_kl_loss=False \
    async_training.require_batches=1 \
    async_training.staleness_threshold=0.5 \
    async_training.trigger_parameter_sync_step=2 \
    async_training.partial_rollout=True \
    rollout.nnodes=1 \
    rollout.n_gpus_per_node=1 \
    rollout.total_rollout_steps=4800 \
    rollout.test_freq=25 \
    trainer.device=cpu \
    trainer.n_gpus_per_node=1 \
    trainer.nnodes=1 \
    trainer.project_name=verl_examples \
    trainer.experiment_name=fully_async_arith_tiny \
    "$@"
