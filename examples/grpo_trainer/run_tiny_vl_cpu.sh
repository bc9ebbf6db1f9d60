#!/usr/bin/env bash
# GRPO on a vision-language model, on CPU with 2 worker processes and the built-in engine: the tiny-vl
# preset (transformers' Qwen2.5-VL at tiny sizes, randomly initialised) learns to name the colour of a
# solid image (the synthetic vl_colors task, answered with one letter: r, g, b or y; the answer is only
# in the pixels, so a policy that ignores the image stays at 25%). The keys are those of upstream's
# examples/grpo_trainer/run_qwen2_5_vl-7b.sh, sized for a CPU. Measured curve: docs/multimodal.md.
# Until the rollout engine stops sampling vision placeholder tokens, the random policy samples
# <|image_pad|> within the first steps and the step fails (docs/multimodal.md, "Known issue").
# Extra Hydra overrides are appended: bash run_tiny_vl_cpu.sh trainer.total_training_steps=20
# VL_PRESET=tiny-qwen3-vl trains the Qwen3-VL preset instead (DeepStack, interleaved M-RoPE).
set -euo pipefail
PYTHON=${PYTHON:-python3}
PRESET=${VL_PRESET:-tiny-vl}
DEMO_DIR=${VL_DEMO_DIR:-$HOME/.cache/verl/${PRESET//-/_}_demo}
if [ ! -f "$DEMO_DIR/model/config.json" ]; then
    $PYTHON -m verl.models.make_tiny --preset "$PRESET" --out "$DEMO_DIR/model"
fi
if [ ! -f "$DEMO_DIR/data/train.parquet" ]; then
    $PYTHON examples/data_preprocess/vl_colors.py --local_save_dir "$DEMO_DIR/data" --answer_style letter
fi
$PYTHON -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$DEMO_DIR/data/train.parquet" \
    data.val_files="$DEMO_DIR/data/test.parquet" \
    data.train_batch_size=32 \
    data.max_prompt_length=40 \
    data.max_response_length=1 \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    data.image_key=images \
    data.dataloader_num_workers=0 \
    actor_rollout_ref.model.path="$DEMO_DIR/model" \
    actor_rollout_ref.actor.optim.lr=1e-3 \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=128 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.name=hf \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=128 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=128 \
    algorithm.use_kl_in_reward=False \
    trainer.device=cpu \
    trainer.n_gpus_per_node=2 \
    trainer.nnodes=1 \
    trainer.critic_warmup=0 \
    trainer.logger='[console,file]' \
    trainer.project_name=verl_examples \
    trainer.experiment_name="grpo_${PRESET//-/_}_colors" \
    trainer.total_training_steps=60 \
    trainer.test_freq=10 \
    trainer.save_freq=-1 \
    "$@"
