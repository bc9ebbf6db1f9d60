#!/usr/bin/env bash
# PPO with a critic (GAE advantages) on the bundled tiny model and the arithmetic task, on CPU.
set -euo pipefail
${PYTHON:-python3} -m verl.trainer.main_ppo \
    --config-name=arith_demo \
    algorithm.adv_estimator=gae \
    algorithm.gamma=1.0 \
    algorithm.lam=0.95 \
    data.train_batch_size=64 \
    actor_rollout_ref.rollout.n=1 \
    actor_rollout_ref.actor.optim.lr=1e-4 \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    critic.optim.lr=1e-3 \
    critic.ppo_mini_batch_size=32 \
    critic.ppo_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
    trainer.critic_warmup=0 \
    trainer.device=cpu \
    trainer.n_gpus_per_node=2 \
    trainer.experiment_name=ppo_gae_arith_tiny \
    "$@"
