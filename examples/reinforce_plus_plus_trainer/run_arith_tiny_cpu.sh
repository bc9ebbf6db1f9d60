#!/usr/bin/env bash
# REINFORCE++ (globally whitened discounted returns) with a low-variance KL loss against the
# reference policy, on the bundled tiny model and the arithmetic task, on CPU.
set -euo pipefail
${PYTHON:-python3} -m verl.trainer.main_ppo \
    --config-name=arith_demo \
    algorithm.adv_estimator=reinforce_plus_plus \
    data.train_batch_size=32 \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.actor.optim.lr=1e-4 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=mse \
    trainer.device=cpu \
    trainer.n_gpus_per_node=2 \
    trainer.experiment_name=reinforce_pp_arith_tiny \
    "$@"
