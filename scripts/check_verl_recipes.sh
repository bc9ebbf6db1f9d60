#!/usr/bin/env bash
# Run verl-recipe's own drivers (DAPO, entropy) unchanged against this checkout, two steps each, on
# the bundled tiny model and arithmetic data (+demo=arith), then validate and save a checkpoint.
#
#   bash scripts/check_verl_recipes.sh /path/to/verl-recipe [dapo|entropy ...]
#
# The recipe checkout is put on PYTHONPATH as the package `recipe` (as upstream's README asks: clone it
# into verl/recipe); the commands run from this repository's root, where the recipes' configs find
# ppo_trainer through `file://verl/trainer/config`. The entropy recipe's reward imports math-verify,
# latex2sympy2_extended and pylatexenc (install them first); its math scorer does not know the
# arithmetic task, so its runs score with verl's default_compute_score through custom_reward_function.
# A recipe's TaskRunner asks Ray for one CPU, so Ray gets one more CPU than the two workers use.
# See docs/upstream.md#recipes-own-drivers.
set -euo pipefail
RECIPES="${1:?usage: $0 VERL_RECIPE_DIR [dapo|entropy ...]}"
shift
CHECKS=("${@:-dapo entropy}")
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
ln -s "$(cd "$RECIPES" && pwd)" "$WORK/recipe"
cat > "$WORK/arith_reward.py" <<'EOF'
from verl.utils.reward_score import default_compute_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
EOF
cd "$ROOT"
export PYTHONPATH="$WORK:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
COMMON=(
    +demo=arith trainer.device=auto algorithm.adv_estimator=grpo
    data.gen_batch_size=16 data.train_batch_size=8 actor_rollout_ref.rollout.n=4
    actor_rollout_ref.actor.ppo_mini_batch_size=8 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16
    algorithm.filter_groups.enable=True algorithm.filter_groups.metric=seq_reward
    algorithm.filter_groups.max_num_gen_batches=10
    trainer.total_training_steps=2 trainer.test_freq=2 trainer.save_freq=2 "trainer.logger=[console]"
    trainer.val_before_train=True ray_kwargs.ray_init.num_cpus=3
)
for check in ${CHECKS[*]}; do
    echo "== verl-recipe $check"
    case "$check" in
        dapo)
            ${PYTHON:-python3} -m recipe.dapo.main_dapo "${COMMON[@]}" \
                reward_model.overlong_buffer.enable=True reward_model.overlong_buffer.len=4 \
                reward_model.overlong_buffer.penalty_factor=1.0 \
                trainer.default_local_dir="$WORK/ckpt_dapo" ;;
        entropy)
            ${PYTHON:-python3} -m recipe.entropy.main_entropy "${COMMON[@]}" \
                actor_rollout_ref.rollout.mode=sync \
                actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov \
                actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.002 \
                actor_rollout_ref.actor.policy_loss.ppo_kl_coef=1 \
                custom_reward_function.path="$WORK/arith_reward.py" \
                trainer.default_local_dir="$WORK/ckpt_entropy" ;;
        *) echo "unknown check '$check' (dapo, entropy)" >&2; exit 2 ;;
    esac
    test -d "$WORK/ckpt_$check/global_step_2/actor" || { echo "verl-recipe $check: no step-2 checkpoint" >&2; exit 1; }
    echo "== verl-recipe $check: trained 2 steps, validated, saved global_step_2"
done
