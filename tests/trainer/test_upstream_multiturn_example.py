"""Upstream's multi-turn GSM8K example as its users run it, on the CPU: examples/data_preprocess/
gsm8k_tool_agent_loop.py on a GSM8K snapshot (a stand-in in the hub's layout; its rows name the tool agent
loop, as upstream's agent-loop docs prepare them), then main_ppo with
--config-path=examples/sglang_multiturn/config --config-name=gsm8k_multiturn_grpo and the override set of
upstream's run_qwen2.5-3b_gsm8k_multiturn.sh (sizes, model and engine scaled to the bundled tool model)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.trainer.main_ppo_runs import ROOT, read_metrics, run_env, run_main_ppo

pytestmark = pytest.mark.slow

PROBLEMS = [(3, 4), (12, 30), (7, 8), (25, 17), (9, 9), (40, 2), (5, 6), (11, 22)]


def _gsm8k_snapshot(root) -> None:
    """GSM8K's files as the hub holds them (main/train-*.parquet, main/test-*.parquet)."""
    rows = [
        {
            "question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
            "answer": f"He has {a}+{b}=<<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}",
        }
        for a, b in PROBLEMS
    ]
    (root / "main").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), root / "main" / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:4]), root / "main" / "test-00000-of-00001.parquet")


def test_gsm8k_multiturn_with_the_tool_preprocesses_and_trains_with_upstreams_config(tmp_path, shared_ray_cluster):
    import subprocess
    import sys

    snapshot, data = tmp_path / "gsm8k_snapshot", tmp_path / "data"
    _gsm8k_snapshot(snapshot)
    subprocess.run(
        [sys.executable, "examples/data_preprocess/gsm8k_tool_agent_loop.py", "--local_dataset_path", str(snapshot),
         "--local_save_dir", str(data)],
        cwd=ROOT, env=run_env(tmp_path), check=True, capture_output=True,
    )  # fmt: skip
    dump = tmp_path / "rollouts"
    cmd = [
        sys.executable, "-m", "verl.trainer.main_ppo",
        "--config-path=examples/sglang_multiturn/config", "--config-name=gsm8k_multiturn_grpo",
        # upstream's run_qwen2.5-3b_gsm8k_multiturn.sh, less its GPU sizes, profiler and wandb
        "algorithm.adv_estimator=grpo", "data.max_prompt_length=1024", "data.filter_overlong_prompts=True",
        "data.truncation=error", "data.return_raw_chat=True", "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.over_sample_rate=0.1",
        "actor_rollout_ref.rollout.mode=async", "algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0",
        f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
        "actor_rollout_ref.rollout.multi_turn.tool_config_path="
        "examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml",
        # the CPU: the bundled tool-calling model, the built-in engine, a small batch, one step
        "actor_rollout_ref.model.path=${verl_asset:arith-tool-tiny}", "actor_rollout_ref.rollout.name=hf",
        "trainer.device=cpu", "trainer.n_gpus_per_node=2", "data.train_batch_size=4",
        "data.max_response_length=64", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "trainer.total_training_steps=1", "trainer.val_before_train=False", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.logger=[console,file]", f"trainer.rollout_data_dir={dump}",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}", f"trainer.run_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    run_main_ppo(cmd, tmp_path, cluster=shared_ray_cluster)

    (step,) = [r["data"] for r in read_metrics(tmp_path) if "actor/pg_loss" in r["data"]]
    assert "agent_loop/tool_calls" in step  # the rows' agent_name ran the tool agent loop
    rows = [json.loads(line) for line in (dump / "1.jsonl").read_text().splitlines()]
    assert len(rows) == 4 * 2
    # every prompt is the preprocessed conversation (system prompt naming the tool, then the question); the
    # bundled model's chat template does not render tool schemas, and it was not taught this tool
    assert all("calc_gsm8k_reward" in row["input"] and "Tom has" in row["input"] for row in rows)
