#!/usr/bin/env bash
# Run verl-recipe's own drivers (DAPO, entropy, SPPO with its own worker and actor) and recipe files (ReTool) unchanged against this
# checkout, two steps each, on a bundled tiny model and arithmetic data (+demo=arith), then validate
# and save a checkpoint.
#
#   bash scripts/check_verl_recipes.sh /path/to/verl-recipe [dapo|entropy|sppo|retool|char_count|r1|infigui-g1|fapo|genrm_remote|open_math_reasoning ...]
#
# The recipe checkout is put on PYTHONPATH as the package `recipe` (as upstream's README asks: clone it
# into verl/recipe); the commands run from this repository's root, where the recipes' configs find
# ppo_trainer through `file://verl/trainer/config`. The entropy recipe's reward imports math-verify,
# latex2sympy2_extended and pylatexenc (install them first); its math scorer does not know the
# arithmetic task, so its runs score with verl's default_compute_score through custom_reward_function.
# A recipe's TaskRunner asks Ray for one CPU, so Ray gets one more CPU than the two workers use.
# ReTool runs verl.trainer.main_ppo with the recipe's own dataset class (CustomRLHFDataset, reading
# parquet directories laid out as BytedTsinghua-SIA/DAPO-Math-17k and Maxwell-Jia/AIME_2024, written
# here from arithmetic problems), its reward function (compute_score, reading extra_info["num_turns"])
# and a copy of its tool config pointing at a local SandboxFusion-compatible service
# (python -m verl.tools.sandbox_fusion_service) on a free port, with the bundled tool-calling model
# arith-tool-tiny. That model was taught a calculator on bare questions; with ReTool's answer-format
# suffix on every prompt it calls no tool (every episode has num_turns=2, which ReTool's reward reads),
# so after training the recipe's tool is called directly, built from the same tool config, through its
# Ray execution pool and the service. It needs `pip install datasets`.
# char_count runs the recipe's own scripts from its folder with HOME in a scratch directory:
# create_dataset.py (a small set of short words), train_sft.sh (torchrun verl.trainer.sft_trainer, one
# step on arith-tiny), the README's `verl.model_merger merge` into the checkpoint's huggingface/, then
# train_grpo.sh with its reward_function.py. The scripts take no arguments, so `torchrun` and `python3`
# are bash functions (exported to the scripts) that append overrides: trainer.device, and for GRPO the
# size (batch 8, n=4, two steps), the built-in hf rollout instead of vllm, and the merged SFT model
# instead of the script's megatron global_step_140. The reward function is also checked on the
# dataset's own worked answers (every one scores 1).
# r1 runs data_process.py on local stand-ins of its four hub datasets (HF_DATASETS_OFFLINE=1, folders
# named as the hub ids in the working directory, configs declared in their README.md), then
# run_r1_distill_qwen.sh's verl.trainer.main_generation (smaller) and main_eval.py with
# reward_score.py, and main_eval again on hand-written responses whose scores are known (math-verify,
# the GPQA letter, LiveCodeBench programs run through prime_code.testing_util). Needs `datasets` and
# `math-verify`.
# infigui-g1 runs run_3b.sh (python3 appends the size, the hf rollout and the tiny-vl preset, or
# VL_PRESET) from a folder laid out as the verl root it expects (./data/omniact_grounding_filtered,
# ./recipe), on rows in omniact's shape (data_source "point", one image, a box as ground truth), with
# its reward_fn.py, whose AER scores are then checked on hand-written answers.
# fapo runs prepare_fapo_data.py on local stand-ins of its hub datasets, then main_ppo with the reward
# keys of run_baseline_7b.sh (the dapo manager, overlong buffer, the recipe's async
# compute_score_baseline; the script itself submits to a Ray cluster with `ray job submit`), and checks
# the recipe's scorers on known answers. compute_score_fapo's flawed-positive check asks a generative
# reward model through an SGLang-style router (`POST /generate` with input_ids); none runs here, so only
# its paths that do not call it are checked.
# fapo then runs FAPO itself (run_fapo_7b.sh's reward keys: reward_model.enable with compute_score_fapo, the
# judge, a copy of the bundled model with a 32k context, served to it behind reward_router_address) and asks the
# command-line generation server's judge once through compute_score_fapo.
# genrm_remote runs main_ppo with its reward_function.py, whose judge is an OpenAI server at localhost:30000
# (here python -m verl.experimental.reward_loop.generation_server on the bundled model), and counts the critiques.
# open_math_reasoning runs prepare_eval_dataset.py on local stand-ins of math-ai/aime24 and aime25, its
# run_generation.sh (verl.trainer.main_generation_server; python3 appends the hf engine, n=2 and a short
# response), then its run_eval.sh (verl.trainer.main_eval with compute_score.py) on known responses.
# See docs/upstream.md#recipes-own-drivers.
set -euo pipefail
RECIPES="${1:?usage: $0 VERL_RECIPE_DIR [dapo|entropy ...]}"
shift
CHECKS=("${@:-dapo entropy sppo retool char_count r1 infigui-g1 fapo genrm_remote open_math_reasoning}")
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="$(mktemp -d)"
SERVICE_PID=
trap '[ -z "$SERVICE_PID" ] || kill "$SERVICE_PID" 2>/dev/null; rm -rf "$WORK"' EXIT
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
retool_setup() {
    # data in the layouts ReTool's CustomRLHFDataset reads, the local service, the tool config copy
    ${PYTHON:-python3} - "$WORK/data" <<'EOF'
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq

root = sys.argv[1]
problems = [(12, 34, 56), (7, 8, 9), (3, 41, 5), (25, 4, 6), (9, 9, 9), (60, 2, 7), (5, 5, 5), (18, 3, 2)]
train = [
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": f"What is {a}+{b}*{c}?"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": str(a + b * c), "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": f"arith-{i}"},
    }
    for i, (a, b, c) in enumerate(problems)
]
aime = [{"ID": f"2024-I-{i}", "Problem": f"What is {a}*{b}+{c}?", "Answer": a * b + c} for i, (a, b, c) in enumerate(problems[:4])]
for sub, rows, name in (
    ("BytedTsinghua-SIA/DAPO-Math-17k", train, "train.parquet"),
    ("Maxwell-Jia/AIME_2024", aime, "aime_2024_problems.parquet"),
):
    os.makedirs(f"{root}/{sub}", exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), f"{root}/{sub}/{name}")
EOF
    local port
    port=$(${PYTHON:-python3} -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    ${PYTHON:-python3} -m verl.tools.sandbox_fusion_service --port "$port" > "$WORK/service.log" 2>&1 &
    SERVICE_PID=$!
    sed "s#http://localhost:8080/run_code#http://127.0.0.1:$port/run_code#" \
        "$WORK/recipe/retool/sandbox_fusion_tool_config.yaml" > "$WORK/sandbox_fusion_tool_config.yaml"
    grep -q "127.0.0.1:$port" "$WORK/sandbox_fusion_tool_config.yaml" \
        || { echo "retool: the tool config's URL was not replaced" >&2; exit 1; }
}

retool_tool_call() {
    # the recipe's CustomSandboxFusionTool, built from the tool config copy, runs code through its Ray pool
    ${PYTHON:-python3} - "$WORK/sandbox_fusion_tool_config.yaml" <<'EOF'
import asyncio
import sys

import ray

from verl.tools.utils.tool_registry import initialize_tools_from_config

ray.init(num_cpus=1, include_dashboard=False)
(tool,) = initialize_tools_from_config(sys.argv[1])
assert type(tool).__qualname__ == "CustomSandboxFusionTool", tool


async def call(code):
    instance_id, _ = await tool.create()
    try:
        return await tool.execute(instance_id, {"code": code})
    finally:
        await tool.release(instance_id)


response, reward, metrics = asyncio.run(call("```python\nx = 6 * 7\nx\n```"))
assert (response.text, reward, metrics) == ("42\n", None, None), (response, reward, metrics)
response, _, _ = asyncio.run(call("1/0"))
assert "ZeroDivisionError" in response.text, response
print("== verl-recipe retool: CustomSandboxFusionTool ran the code on the local service through its Ray pool")
ray.shutdown()
EOF
}

char_count_run() {
    (
        export HOME="$WORK/home_char_count"
        mkdir -p "$HOME"
        cd "$WORK/recipe/char_count"
        ${PYTHON:-python3} create_dataset.py --total_number 80 --min_length 3 --max_length 5
        # shellcheck disable=SC2317
        torchrun() { command torchrun "$@" trainer.device=auto; }
        export -f torchrun
        MODEL_ID="$ROOT/verl/assets/arith-tiny" bash train_sft.sh
        local sft="$HOME/experiments/char_count/models/sft/fsdp/global_step_1"
        ${PYTHON:-python3} -m verl.model_merger merge --backend fsdp --local_dir "$sft" --target_dir "$sft/huggingface/"
        test -f "$sft/huggingface/model.safetensors" || { echo "char_count: merge wrote no weights" >&2; exit 1; }
        ${PYTHON:-python3} - "$HOME/data/char_count/rl/train.parquet" <<'EOF'
import sys

import pandas as pd
from reward_function import char_count_reward_function as reward

rows = pd.read_parquet(sys.argv[1]).to_dict("records")
scores = [reward(r["data_source"], r["extra_info"]["response"], r["reward_model"]["ground_truth"]) for r in rows]
assert scores == [1] * len(rows), scores
assert reward("char_count", "\\boxed{99}", rows[0]["reward_model"]["ground_truth"]) == 0
print(f"== verl-recipe char_count: reward_function scores the dataset's {len(rows)} worked answers 1")
EOF
        export SFT_HF="$sft/huggingface" CKPT="$WORK/ckpt_char_count"
        # shellcheck disable=SC2317
        python3() {
            command "${PYTHON:-python3}" "$@" trainer.device=auto actor_rollout_ref.rollout.name=hf \
                actor_rollout_ref.model.path="$SFT_HF" data.train_batch_size=8 actor_rollout_ref.rollout.n=4 \
                actor_rollout_ref.actor.ppo_mini_batch_size=8 trainer.total_training_steps=2 trainer.test_freq=2 \
                trainer.save_freq=2 "trainer.logger=[console]" ray_kwargs.ray_init.num_cpus=3 \
                trainer.default_local_dir="$CKPT"
        }
        export -f python3
        bash train_grpo.sh
    )
    test -d "$WORK/ckpt_char_count/global_step_2/actor" || { echo "char_count: no step-2 checkpoint" >&2; exit 1; }
}

r1_run() {
    # local stand-ins of data_process.py's hub datasets, in their columns, loaded by hub id from the cwd
    mkdir -p "$WORK/r1/out"
    cd "$WORK/r1"
    ln -s "$WORK/recipe" recipe  # the launch script's relative custom_reward_function.path
    ${PYTHON:-python3} - <<'EOF'
import base64
import json
import os
import pickle
import zlib

import pyarrow as pa
import pyarrow.parquet as pq


def write(folder, name, rows, configs=None):
    os.makedirs(folder, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), os.path.join(folder, name))
    if configs:
        lines = ["---", "configs:"]
        for config, split, file in configs:
            lines += [f"- config_name: {config}", "  data_files:", f"  - split: {split}", f"    path: {file}"]
        with open(os.path.join(folder, "README.md"), "w") as f:
            f.write("\n".join(lines + ["---", ""]))


write("Maxwell-Jia/AIME_2024", "train.parquet",
      [{"ID": f"2024-I-{i}", "Problem": f"What is {a}*{b}?", "Answer": a * b} for i, (a, b) in enumerate([(12, 3), (7, 9)])])
write("Idavidrein/gpqa", "gpqa_diamond.parquet",
      [{"Question": "Which is a noble gas?", "Correct Answer": "Argon", "Incorrect Answer 1": "Iron",
        "Incorrect Answer 2": "Sodium", "Incorrect Answer 3": "Carbon"}],
      configs=[("gpqa_diamond", "train", "gpqa_diamond.parquet")])
write("opencompass/LiveMathBench", "cnmo_en.parquet", [{"question": "What is 2+3?", "answer": "5"}],
      configs=[("v202412_CNMO_en", "test", "cnmo_en.parquet"), ("v202412_CNMO_cn", "test", "cnmo_cn.parquet")])
write("opencompass/LiveMathBench", "cnmo_cn.parquet", [{"question": "2+4 等于多少?", "answer": "6"}])
private = base64.b64encode(zlib.compress(pickle.dumps(json.dumps([{"input": "10 20\n", "output": "30\n", "testtype": "stdin"}])))).decode()
write("livecodebench/code_generation_lite", "test.parquet", [
    {"question_content": "Read two integers and print their sum.", "starter_code": "",
     "public_test_cases": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]),
     "private_test_cases": private, "metadata": json.dumps({}), "contest_date": "2024-09-01T00:00:00"},
    {"question_content": "Outside R1's date window.", "starter_code": "",
     "public_test_cases": "[]", "private_test_cases": "[]", "metadata": "{}", "contest_date": "2023-01-01T00:00:00"},
])
EOF
    HF_DATASETS_OFFLINE=1 ${PYTHON:-python3} -m recipe.r1.data_process --local_dir out --tasks all
    # run_r1_distill_qwen.sh's generation and evaluation commands, smaller
    ${PYTHON:-python3} -m verl.trainer.main_generation trainer.nnodes=1 trainer.n_gpus_per_node=1 \
        data.path=out/test.parquet data.prompt_key=prompt data.batch_size=8 data.n_samples=2 \
        data.output_path=out/test-output-2.parquet model.path="$ROOT/verl/assets/arith-tiny" \
        rollout.temperature=0.6 rollout.top_p=0.95 rollout.prompt_length=1024 rollout.response_length=16 \
        rollout.tensor_model_parallel_size=1 rollout.gpu_memory_utilization=0.9 rollout.max_num_batched_tokens=65536
    local eval_args=(data.prompt_key=prompt data.response_key=responses
        custom_reward_function.path=recipe/r1/reward_score.py custom_reward_function.name=reward_func
        ray_kwargs.ray_init.num_cpus=2)
    ${PYTHON:-python3} -m recipe.r1.main_eval data.path=out/test-output-2.parquet "${eval_args[@]}"
    # the same evaluation on hand-written responses, whose scores are known
    ${PYTHON:-python3} - <<'EOF'
import pandas as pd

rows = pd.read_parquet("out/test.parquet").to_dict("records")
program = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
for row in rows:
    source, truth = row["data_source"], row["reward_model"]["ground_truth"]
    if source == "Maxwell-Jia/AIME_2024":
        row["responses"] = [f"so \\boxed{{{truth}}}", "so \\boxed{1}"]
    elif source == "Idavidrein/gpqa":
        row["responses"] = [f"Answer: {truth}", f"Answer: {'B' if truth == 'A' else 'A'}"]
    elif source == "opencompass/cnmo2024_en":
        row["responses"] = [f"\\boxed{{{truth}}}", f"\\boxed{{{truth}}}"]
    elif source == "opencompass/cnmo2024_zh":
        row["responses"] = ["\\boxed{7}", "no answer"]
    else:
        row["responses"] = [program, "```python\nprint(0)\n```"]
pd.DataFrame(rows).to_parquet("out/known.parquet")
EOF
    ${PYTHON:-python3} -m recipe.r1.main_eval data.path=out/known.parquet "${eval_args[@]}" | tee "$WORK/r1/known.log"
    ${PYTHON:-python3} - "$WORK/r1/known.log" <<'EOF'
import re
import sys

text = open(sys.argv[1]).read()
scores = {k: float(v) for k, v in re.findall(r"'test_score/([^']+)': (?:np\.float64\()?([0-9.]+)", text)}
expected = {"Maxwell-Jia/AIME_2024": 0.5, "Idavidrein/gpqa": 0.5, "opencompass/cnmo2024_en": 1.0,
            "opencompass/cnmo2024_zh": 0.0, "livecodebench/code_generation_lite": 0.5}
assert scores == expected, scores
print("== verl-recipe r1: main_eval's scores on known responses are", scores)
EOF
    cd "$ROOT"
}


infigui_run() {
    # run_3b.sh from a verl-root-like folder (its ./data and ./recipe paths), on omniact-shaped rows
    mkdir -p "$WORK/infigui"
    cd "$WORK/infigui"
    ln -s "$WORK/recipe" recipe
    ${PYTHON:-python3} - <<'EOF'
import io
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

# rows as InfiX-ai/omniact_grounding_filtered's: data_source "point", an image, ground truth a box
rng = random.Random(0)
folder = "data/omniact_grounding_filtered"
os.makedirs(folder, exist_ok=True)
for split, num in (("train", 8), ("val", 4)):
    rows = []
    for index in range(num):
        x1, y1 = rng.randint(0, 40), rng.randint(0, 40)
        image = Image.new("RGB", (56, 56), (230, 230, 230))
        ImageDraw.Draw(image).rectangle([x1, y1, x1 + 14, y1 + 14], fill=(200, 30, 30))
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        rows.append(
            {
                "data_source": "point",
                "prompt": [{"role": "user", "content": "<image>Point to the red button."}],
                "images": [{"bytes": buffer.getvalue(), "path": None}],
                "ability": "gui_grounding",
                "reward_model": {"style": "rule", "ground_truth": {"x1": x1, "y1": y1, "x2": x1 + 14, "y2": y1 + 14}},
                "extra_info": {"split": split, "index": index, "no_think": False},
            }
        )
    pq.write_table(pa.Table.from_pylist(rows), f"{folder}/omniact_filtered_{split}.parquet")
EOF
    ${PYTHON:-python3} -m verl.models.make_tiny --preset "${VL_PRESET:-tiny-vl}" --out "$WORK/infigui/model"
    export VLM="$WORK/infigui/model" CKPT="$WORK/ckpt_infigui"
    (
        # shellcheck disable=SC2317
        python3() {
            command "${PYTHON:-python3}" "$@" trainer.device=auto actor_rollout_ref.rollout.name=hf \
                actor_rollout_ref.model.path="$VLM" data.train_batch_size=4 actor_rollout_ref.rollout.n=4 \
                actor_rollout_ref.actor.ppo_mini_batch_size=4 data.max_prompt_length=128 data.max_response_length=16 \
                data.dataloader_num_workers=0 trainer.n_gpus_per_node=1 trainer.total_training_steps=2 \
                trainer.test_freq=2 trainer.save_freq=2 "trainer.logger=[console]" ray_kwargs.ray_init.num_cpus=3 \
                trainer.default_local_dir="$CKPT"
        }
        export -f python3
        bash recipe/infigui-g1/run_3b.sh
    )
    # the AER reward on hand-written answers: format 1 plus 1/sqrt(num_pred * rank of the first hit),
    # or -1/num_pred without a hit; -1 for a malformed answer
    PYTHONPATH="$WORK/recipe/infigui-g1:$PYTHONPATH" ${PYTHON:-python3} - <<'EOF'
from reward_fn import aer_gui_reward_function as reward

box = {"x1": 10, "y1": 10, "x2": 20, "y2": 20}
cases = {
    '<think>it is there</think>[{"point_2d": [15, 15]}]': 2.0,
    '<think>two guesses</think>[{"point_2d": [40, 40]}, {"point_2d": [12, 18]}]': 1.5,
    '<think>miss</think>[{"point_2d": [40, 40]}, {"point_2d": [0, 50]}]': 0.5,
    '<think>three on a line</think>[{"point_2d": [1, 1]}, {"point_2d": [2, 2]}, {"point_2d": [3, 3]}]': -1.0,
    "[{\"point_2d\": [15, 15]}]": -1.0,
}
for answer, expected in cases.items():
    got = reward("point", answer, box, extra_info={})["score"]
    assert abs(got - expected) < 1e-12, (answer, got, expected)
assert reward("point", '[{"point_2d": [15, 15]}]', box, extra_info={"no_think": True})["score"] == 2.0
print("== verl-recipe infigui-g1: reward_fn's scores on known answers hold")
EOF
    cd "$ROOT"
    test -d "$WORK/ckpt_infigui/global_step_2/actor" || { echo "infigui-g1: no step-2 checkpoint" >&2; exit 1; }
}

fapo_run() {
    # prepare_fapo_data.py on local stand-ins of its hub datasets, then main_ppo with the reward keys
    # of run_baseline_7b.sh (dapo manager, overlong buffer, the async compute_score_baseline)
    mkdir -p "$WORK/fapo/out"
    cd "$WORK/fapo"
    ln -s "$WORK/recipe" recipe
    ${PYTHON:-python3} - <<'EOF'
import os

import pyarrow as pa
import pyarrow.parquet as pq


def write(folder, name, rows, config=None, split="train"):
    os.makedirs(folder, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), os.path.join(folder, name))
    if config:
        with open(os.path.join(folder, "README.md"), "w") as f:
            f.write(f"---\nconfigs:\n- config_name: {config}\n  data_files:\n  - split: {split}\n    path: {name}\n---\n")


problems = [(12, 34), (7, 8), (3, 41), (25, 4)]
write("open-r1/DAPO-Math-17k-Processed", "all.parquet",
      [{"prompt": f"What is {a}+{b}?", "solution": str(a + b)} for a, b in problems], config="all")
write("Maxwell-Jia/AIME_2024", "train.parquet", [{"ID": "2024-I-1", "Problem": "What is 6*7?", "Answer": 42}])
write("yentinglin/aime_2025", "train.parquet", [{"problem": "What is 9+9?", "solution": "18"}])
write("Idavidrein/gpqa", "gpqa_diamond.parquet",
      [{"Question": "Which is a noble gas?", "Correct Answer": "Argon", "Incorrect Answer 1": "Iron",
        "Incorrect Answer 2": "Sodium", "Incorrect Answer 3": "Carbon"}], config="gpqa_diamond")
EOF
    HF_DATASETS_OFFLINE=1 ${PYTHON:-python3} -m recipe.fapo.prepare_fapo_data --local_dir out
    # run_baseline_7b.sh's data and DAPO reward keys, scaled down; both runs below share them
    local fapo_common=(
        +demo=arith trainer.device=auto algorithm.adv_estimator=grpo
        data.train_files=out/fapo-train-boxed.parquet data.val_files=out/fapo-test-full-boxed.parquet
        data.prompt_key=prompt data.max_prompt_length=128 data.max_response_length=32 data.train_batch_size=4
        data.return_raw_chat=True data.filter_overlong_prompts=True data.truncation=error
        actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.ppo_mini_batch_size=4
        algorithm.use_kl_in_reward=False actor_rollout_ref.actor.use_kl_loss=False reward_model.reward_manager=dapo
        +reward_model.reward_kwargs.overlong_buffer_cfg.enable=True +reward_model.reward_kwargs.overlong_buffer_cfg.len=8
        +reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0 +reward_model.reward_kwargs.overlong_buffer_cfg.log=True
        +reward_model.reward_kwargs.max_resp_len=32 custom_reward_function.path=recipe/fapo/reward_fn_reasoning.py
        trainer.total_training_steps=2 trainer.test_freq=2 trainer.save_freq=2 "trainer.logger=[console]"
        trainer.val_before_train=True ray_kwargs.ray_init.num_cpus=3
    )
    ${PYTHON:-python3} -m verl.trainer.main_ppo "${fapo_common[@]}" \
        actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28 \
        actor_rollout_ref.actor.loss_agg_mode=token-mean custom_reward_function.name=compute_score_baseline \
        trainer.default_local_dir="$WORK/ckpt_fapo"
    # the rule-based scorers on known answers; compute_score_fapo only on the paths that do not call
    # the generative reward model's router (test split, wrong answer)
    ${PYTHON:-python3} - <<'EOF'
import asyncio

from recipe.fapo.reward_fn_genrm import compute_score_fapo_genrm
from recipe.fapo.reward_fn_reasoning import compute_score_baseline, compute_score_fapo

assert asyncio.run(compute_score_baseline("so \\boxed{46}", "46"))["score"] == 1.0
assert asyncio.run(compute_score_baseline("so \\boxed{45}", "46"))["score"] == -1.0
no_router = {"reward_router_address": None, "reward_model_tokenizer": None}
for split, answer, expected in (("test", "\\boxed{46}", 1.0), ("train", "\\boxed{45}", -1.0)):
    info = {"question": "What is 12+34?", "split": split}
    out = asyncio.run(compute_score_fapo("math-dapo", answer, "46", info, **no_router))
    assert out["score"] == expected and out["is_flawed_positive"] is False, out
steps = {"total_steps": 4}
assert compute_score_fapo_genrm("\\boxed{-1}", -1, steps)["score"] == 1.0
assert compute_score_fapo_genrm("\\boxed{1}", 3, steps)["score"] == 0.5  # 1 - |1 - 3| / 4
assert compute_score_fapo_genrm("\\boxed{-1}", 2, steps)["score"] == -1.0
assert compute_score_fapo_genrm("\\boxed{9}", 2, steps)["score"] == -1.0  # out of range: invalid
print("== verl-recipe fapo: baseline, FAPO (no-router paths) and GenRM scores on known answers hold")
EOF
    # FAPO itself (run_fapo_7b.sh's reward keys): reward_model.enable with compute_score_fapo, the judge served
    # to it behind reward_router_address. The stand-in judge is the bundled model with a 32k context (FAPO asks
    # for 16384 new tokens; the model stops long before), so it gives no boxed step index (no flawed positive).
    ${PYTHON:-python3} - "$WORK/fapo/judge" <<'EOF'
import json
import shutil
import sys

from verl.models import bundled_model_path

shutil.copytree(bundled_model_path(), sys.argv[1])
with open(f"{sys.argv[1]}/config.json") as f:
    config = json.load(f)
config["max_position_embeddings"] = 32768
with open(f"{sys.argv[1]}/config.json", "w") as f:
    json.dump(config, f)
EOF
    ${PYTHON:-python3} -m verl.trainer.main_ppo "${fapo_common[@]}" \
        reward_model.enable=True reward_model.model.path="$WORK/fapo/judge" reward_model.rollout.name=hf \
        reward_model.rollout.gpu_memory_utilization=0.95 reward_model.rollout.tensor_model_parallel_size=1 \
        reward_model.rollout.free_cache_engine=False custom_reward_function.name=compute_score_fapo \
        trainer.default_local_dir="$WORK/ckpt_fapo_genrm"
    test -d "$WORK/ckpt_fapo_genrm/global_step_2/actor" || { echo "verl-recipe fapo (GenRM): no step-2 checkpoint" >&2; exit 1; }
    # compute_score_fapo on a correct training answer asks the judge: here the command-line server serves it
    local port
    port=$(${PYTHON:-python3} -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    ${PYTHON:-python3} -m verl.experimental.reward_loop.generation_server --model "$WORK/fapo/judge" --port "$port" \
        > "$WORK/genrm_server.log" 2>&1 &
    SERVICE_PID=$!
    ${PYTHON:-python3} - "$WORK/fapo/judge" "127.0.0.1:$port" <<'EOF'
import asyncio
import json
import sys
import time
import urllib.request

from recipe.fapo.reward_fn_reasoning import compute_score_fapo
from verl.utils.tokenizer import hf_tokenizer

judge, address = sys.argv[1:]
deadline = time.time() + 120
while True:
    try:
        health = json.loads(urllib.request.urlopen(f"http://{address}/health", timeout=5).read())
        break
    except OSError:
        if time.time() > deadline:
            raise
        time.sleep(1)
before = health["num_requests"]
info = {"question": "What is 12+34?", "split": "train"}
out = asyncio.run(compute_score_fapo("math-dapo", "so \\boxed{46}", "46", info, address, hf_tokenizer(judge)))
after = json.loads(urllib.request.urlopen(f"http://{address}/health", timeout=5).read())["num_requests"]
assert after == before + 1, (before, after)  # the judge was asked once
assert out["score"] == 1.0 and out["is_flawed_positive"] is False, out  # no boxed step index: not flawed
print("== verl-recipe fapo: trained 2 steps with compute_score_fapo and its judge served; a correct answer asks it once")
EOF
    kill "$SERVICE_PID" 2>/dev/null
    wait "$SERVICE_PID" 2>/dev/null || true
    SERVICE_PID=
    cd "$ROOT"
}

genrm_remote_run() {
    # the recipe's reward_function.py posts each training answer's critique request to an OpenAI server at
    # localhost:30000 (model genrm-demo), as its README starts with `vllm serve`; here the command-line
    # generation server on the bundled model (it answers no \boxed{True}, so the judge scores 0)
    ${PYTHON:-python3} -m verl.experimental.reward_loop.generation_server --model "$(${PYTHON:-python3} -c \
        'from verl.models import bundled_model_path; print(bundled_model_path())')" --port 30000 \
        --served-model-name genrm-demo > "$WORK/genrm_remote_server.log" 2>&1 &
    SERVICE_PID=$!
    ${PYTHON:-python3} - <<'EOF'
import time
import urllib.request

deadline = time.time() + 120
while True:
    try:
        urllib.request.urlopen("http://localhost:30000/health", timeout=5)
        break
    except OSError:
        if time.time() > deadline:
            raise
        time.sleep(1)
EOF
    ${PYTHON:-python3} -m verl.trainer.main_ppo "${COMMON[@]}" algorithm.filter_groups.enable=False \
        reward_model.reward_manager=naive custom_reward_function.path="$WORK/recipe/genrm_remote/reward_function.py" \
        custom_reward_function.name=compute_score trainer.default_local_dir="$WORK/ckpt_genrm_remote"
    ${PYTHON:-python3} - <<'EOF'
import json
import urllib.request

served = json.loads(urllib.request.urlopen("http://localhost:30000/health", timeout=5).read())["num_requests"]
assert served == 2 * 16 * 4, served  # two steps of data.gen_batch_size=16 prompts x 4 samples, each judged once
print(f"== verl-recipe genrm_remote: the remote judge served {served} critiques")
EOF
    kill "$SERVICE_PID" 2>/dev/null
    wait "$SERVICE_PID" 2>/dev/null || true
    SERVICE_PID=
}

open_math_reasoning_run() {
    (
        export HOME="$WORK/home_omr"
        mkdir -p "$HOME"
        # local stand-ins of math-ai/aime24 (problem, solution) and math-ai/aime25 (problem, answer)
        ${PYTHON:-python3} - "$WORK/omr_raw" <<'EOF'
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq

root = sys.argv[1]
for name, rows in {
    "aime24": [{"problem": "What is 6*6?", "solution": "\\boxed{36}"}, {"problem": "What is 7+8?", "solution": "\\boxed{15}"}],
    "aime25": [{"problem": "What is 9-4?", "answer": "5"}],
}.items():
    os.makedirs(f"{root}/math-ai/{name}", exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), f"{root}/math-ai/{name}/test.parquet")
EOF
        cd "$WORK"  # the verl root the scripts expect (recipe/ beside it)
        ${PYTHON:-python3} recipe/open_math_reasoning/prepare_eval_dataset.py --local_dataset_path "$WORK/omr_raw"
        # run_generation.sh as written, with the engine, size and device appended
        # shellcheck disable=SC2317
        python3() {
            command "${PYTHON:-python3}" "$@" actor_rollout_ref.rollout.name=hf trainer.device=auto \
                actor_rollout_ref.rollout.n=2 actor_rollout_ref.rollout.response_length=16
        }
        export -f python3
        MODEL_PATH="$ROOT/verl/assets/arith-tiny" NGPUS_PER_NODE=1 bash recipe/open_math_reasoning/run_generation.sh
        # shellcheck disable=SC2317
        python3() { command "${PYTHON:-python3}" "$@"; }  # run_eval.sh as written
        ${PYTHON:-python3} - "$HOME/data/gen/qwen_8b_gen_test.parquet" <<'EOF'
import sys

import pandas as pd

frame = pd.read_parquet(sys.argv[1])
assert list(frame["data_source"]) == ["aime24", "aime24", "aime25"], frame["data_source"]
assert all(len(r) == 2 for r in frame["responses"]), frame["responses"]
# known responses for run_eval.sh: 1 of 4 right for aime24, 2 of 2 for aime25
frame["responses"] = [["\\boxed{36}", "\\boxed{1}"], ["\\boxed{2}", "\\boxed{3}"], ["\\boxed{5}", "\\boxed{5}"]]
frame.to_parquet(sys.argv[1])
print("== verl-recipe open_math_reasoning: main_generation_server wrote 3 rows x 2 responses")
EOF
        bash recipe/open_math_reasoning/run_eval.sh | tee "$WORK/omr_eval.log"
        ${PYTHON:-python3} - "$WORK/omr_eval.log" <<'EOF'
import re
import sys

text = open(sys.argv[1]).read()
scores = {k: float(v) for k, v in re.findall(r"^(\S+) \(\d+ prompts x 2\): mean@2=([0-9.]+)", text, re.M)}
assert scores == {"aime24": 0.25, "aime25": 1.0}, scores
print("== verl-recipe open_math_reasoning: main_eval's scores on known responses are", scores)
EOF
    )
}

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
        sppo)
            # SPPO's own driver, trainer, worker (upstream's legacy init_model over _build_model_optimizer) and
            # actor (its update_policy over _forward_micro_batch / _optimizer_step); its config's sglang with
            # tp=2 replaced by the built-in engine. Its fit() logs, checks for the last step and counts steps once
            # per epoch, not per batch (its loop's indentation; the same on upstream), validating after every batch
            # of an epoch: a 16-prompt training set keeps that to two batches.
            ${PYTHON:-python3} -m recipe.sppo.main_sppo +demo=arith trainer.device=auto \
                actor_rollout_ref.rollout.name=hf actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
                data.train_batch_size=8 data.train_max_samples=16 data.val_max_samples=64 actor_rollout_ref.rollout.n=1 \
                actor_rollout_ref.actor.ppo_mini_batch_size=8 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
                trainer.total_training_steps=2 trainer.test_freq=2 trainer.save_freq=2 "trainer.logger=[console]" \
                trainer.val_before_train=True ray_kwargs.ray_init.num_cpus=3 \
                trainer.default_local_dir="$WORK/ckpt_sppo" 2>&1 | tee "$WORK/sppo.log"
            grep -q 'actor/preference_mean' "$WORK/sppo.log" \
                || { echo "sppo: no actor/preference_mean metric (the recipe's update_policy did not run)" >&2; exit 1; }
            if grep -E 'actor/grad_norm=(nan|inf)' "$WORK/sppo.log"; then
                echo "sppo: a non-finite gradient norm" >&2; exit 1
            fi ;;
        retool)
            retool_setup
            ${PYTHON:-python3} -m verl.trainer.main_ppo +demo=arith trainer.device=auto \
                algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False \
                data.train_files="['$WORK/data/BytedTsinghua-SIA/DAPO-Math-17k']" \
                data.val_files="['$WORK/data/Maxwell-Jia/AIME_2024']" \
                data.return_raw_chat=True data.train_batch_size=4 data.max_prompt_length=128 \
                data.max_response_length=96 data.filter_overlong_prompts=True data.truncation=error \
                data.custom_cls.path="$WORK/recipe/retool/retool.py" data.custom_cls.name=CustomRLHFDataset \
                custom_reward_function.path="$WORK/recipe/retool/retool.py" custom_reward_function.name=compute_score \
                actor_rollout_ref.model.path='${verl_asset:arith-tool-tiny}' \
                actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.ppo_mini_batch_size=4 \
                actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
                actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
                actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
                actor_rollout_ref.rollout.n=4 actor_rollout_ref.rollout.multi_turn.enable=True \
                actor_rollout_ref.rollout.multi_turn.max_user_turns=4 \
                actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4 \
                actor_rollout_ref.rollout.multi_turn.tool_config_path="$WORK/sandbox_fusion_tool_config.yaml" \
                actor_rollout_ref.rollout.multi_turn.format=hermes \
                trainer.total_training_steps=2 trainer.test_freq=2 trainer.save_freq=2 "trainer.logger=[console]" \
                trainer.val_before_train=True ray_kwargs.ray_init.num_cpus=3 \
                trainer.default_local_dir="$WORK/ckpt_retool"
            retool_tool_call ;;
        char_count) char_count_run; echo "== verl-recipe char_count: SFT, merge, GRPO 2 steps"; continue ;;
        r1) r1_run; echo "== verl-recipe r1: data_process, main_generation, main_eval"; continue ;;
        infigui-g1) infigui_run; echo "== verl-recipe infigui-g1: run_3b.sh 2 steps on ${VL_PRESET:-tiny-vl}"; continue ;;
        fapo) fapo_run ;;
        genrm_remote) genrm_remote_run ;;
        open_math_reasoning) open_math_reasoning_run; echo "== verl-recipe open_math_reasoning: prepare, generate, eval"; continue ;;
        *) echo "unknown check '$check' (dapo, entropy, sppo, retool, char_count, r1, infigui-g1, fapo, genrm_remote, open_math_reasoning)" >&2; exit 2 ;;
    esac
    test -d "$WORK/ckpt_$check/global_step_2/actor" || { echo "verl-recipe $check: no step-2 checkpoint" >&2; exit 1; }
    echo "== verl-recipe $check: trained 2 steps, validated, saved global_step_2"
done
