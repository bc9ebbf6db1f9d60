#!/usr/bin/env bash
# DAPO (Yu et al., arXiv:2503.14476) on the bundled tiny model and the arithmetic task, on CPU.
# The algorithm is config/dapo_trainer.yaml; this script runs it in the bundled demo's environment (+demo=arith) and sizes it for a laptop CPU.
# Extra Hydra overrides are appended: bash recipes/dapo/run_dapo_arith_tiny_cpu.sh trainer.total_training_steps=50
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
${PYTHON:-python3} -m verl.trainer.main_ppo \
    --config-path "$HERE/config" --config-name dapo_trainer \
    +demo=arith \
    data.train_batch_size=16 \
    data.gen_batch_size=32 \
    data.max_response_length=8 \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.optim.lr=1e-4 \
    reward_model.overlong_buffer.len=4 \
    trainer.device=cpu \
    trainer.n_gpus_per_node=2 \
    trainer.project_name=verl_recipes \
    "$@"
