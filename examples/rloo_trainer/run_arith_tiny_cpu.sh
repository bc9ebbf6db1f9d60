#!/usr/bin/env bash
# RLOO (leave-one-out baseline) on the bundled tiny model and the arithmetic task, on CPU.
set -euo pipefail
${PYTHON:-python3} -m verl.trainer.main_ppo \
    --config-name=arith_demo \
    algorithm.adv_estimator=rloo \
    data.train_batch_size=32 \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.actor.optim.lr=1e-4 \
    trainer.device=cpu \
    trainer.n_gpus_per_node=2 \
    trainer.experiment_name=rloo_arith_tiny \
    "$@"
