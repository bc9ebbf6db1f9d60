#!/usr/bin/env bash
# ReMax (greedy-response reward as the baseline) with the KL penalty in the reward, on CPU.
set -euo pipefail
${PYTHON:-python3} -m verl.trainer.main_ppo \
    --config-name=arith_demo \
    algorithm.adv_estimator=remax \
    algorithm.use_kl_in_reward=True \
    algorithm.kl_penalty=kl \
    algorithm.kl_ctrl.kl_coef=0.001 \
    data.train_batch_size=32 \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.actor.optim.lr=1e-4 \
    trainer.device=cpu \
    trainer.n_gpus_per_node=2 \
    trainer.experiment_name=remax_arith_tiny \
    "$@"
