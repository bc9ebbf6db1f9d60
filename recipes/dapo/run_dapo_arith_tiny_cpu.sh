#!/usr/bin/env bash
# DAPO (Yu et al., arXiv:2503.14476) on the bundled tiny model and the arithmetic task, on CPU:
# clip-higher, token-level loss, dynamic sampling (drop groups whose accuracy does not vary) and
# the soft overlong penalty, all from core pieces selected by config.
set -euo pipefail
${PYTHON:-python3} -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    algorithm.filter_groups.enable=True \
    algorithm.filter_groups.metric=seq_final_reward \
    algorithm.filter_groups.max_num_gen_batches=10 \
    data.train_batch_size=16 \
    data.gen_batch_size=32 \
    data.max_response_length=8 \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.clip_ratio_low=0.2 \
    actor_rollout_ref.actor.clip_ratio_high=0.28 \
    actor_rollout_ref.actor.clip_ratio_c=10.0 \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.optim.lr=1e-4 \
    reward_model.reward_manager=dapo \
    reward_model.overlong_buffer.enable=True \
    reward_model.overlong_buffer.len=4 \
    reward_model.overlong_buffer.penalty_factor=0.5 \
    trainer.device=cpu \
    trainer.n_gpus_per_node=2 \
    trainer.experiment_name=dapo_arith_tiny \
    "$@"
