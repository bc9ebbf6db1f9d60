#!/usr/bin/env bash
# PPO with a critic and GAE (arXiv:1707.06347, arXiv:1506.02438) on the bundled tiny model and
# the arithmetic task, on CPU. One sample per prompt: the critic, not a group, is the baseline.
# The algorithm is config/ppo_with_critic_trainer.yaml; this script runs it in the bundled demo's environment (+demo=arith) and sizes it for a laptop CPU
# (2 worker processes, the bundled tiny model, the arithmetic task generated on first use).
# Extra Hydra overrides are appended: bash recipes/ppo_with_critic/run_arith_tiny_cpu.sh trainer.total_training_steps=50
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
${PYTHON:-python3} -m verl.trainer.main_ppo \
    --config-path "$HERE/config" --config-name ppo_with_critic_trainer \
    +demo=arith \
    data.train_batch_size=64 \
    actor_rollout_ref.rollout.n=1 \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.actor.optim.lr=1e-4 \
    critic.optim.lr=1e-3 \
    critic.ppo_micro_batch_size_per_gpu=16 \
    trainer.device=cpu \
    trainer.n_gpus_per_node=2 \
    trainer.nnodes=1 \
    trainer.project_name=verl_recipes \
    "$@"
