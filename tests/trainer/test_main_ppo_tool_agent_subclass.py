"""`main_ppo` with a loop that subclasses `ToolAgentLoop` (one handler overridden, upstream's `run`),
registered from a config file, and a reward manager registered by the custom reward file
(`@register(name)` beside its function, then `reward_model.reward_manager=name`), as upstream's
collabllm recipe runs: real Ray, 2 FSDP2 workers, the built-in engine."""

from __future__ import annotations

import pytest

from tests.trainer.main_ppo_runs import demo_script_cmd, read_metrics, run_main_ppo

pytestmark = pytest.mark.slow  # the slow tier (make test-all, CI): see docs/testing.md

REWARD_FILE = """
import torch

from verl.workers.reward_manager import register


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 0.0


@register("sum_of_turn_scores")
class SumOfTurnScores:
    \"\"\"Scores each episode with the sum of the loop's turn scores, at its last response token.\"\"\"

    def __init__(self, tokenizer, num_examine, compute_score=None, reward_fn_key="data_source", scale=1.0):
        self.scale = scale

    def __call__(self, data, return_dict=False):
        prompt_len = data.batch["prompts"].shape[-1]
        lengths = data.batch["attention_mask"][:, prompt_len:].sum(-1)
        reward = torch.zeros_like(data.batch["responses"], dtype=torch.float32)
        for i, scores in enumerate(data.non_tensor_batch["turn_scores"]):
            reward[i, lengths[i] - 1] = self.scale * sum(scores)
        return {"reward_tensor": reward} if return_dict else reward
"""


def test_a_tool_agent_loop_subclass_and_a_reward_manager_from_the_reward_file_train(tmp_path, shared_ray_cluster):
    agents = tmp_path / "agents.yaml"
    agents.write_text(
        "- name: scores_each_turn\n  _target_: tests.experimental.agent_loop.upstream_loops.ScoresEachTurn\n"
        "  turn_score: 0.25\n"
    )
    reward = tmp_path / "turn_reward.py"
    reward.write_text(REWARD_FILE)
    cmd = demo_script_cmd(
        tmp_path,
        2,
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={agents}",
        "actor_rollout_ref.rollout.agent.default_agent_loop=scores_each_turn",
        "data.return_raw_chat=true",  # upstream-style loops read the row's messages (raw_prompt)
        f"custom_reward_function.path={reward}",
        "reward_model.reward_manager=sum_of_turn_scores",
        "+reward_model.reward_kwargs.scale=2.5",
    )
    run_main_ppo(cmd, tmp_path, timeout=600, cluster=shared_ray_cluster)

    train = [r["data"] for r in read_metrics(tmp_path) if "critic/score/mean" in r["data"]]
    assert len(train) == 2
    for data in train:
        # one model turn per episode (no tools, no simulated user), scored 0.25 by the loop's handler;
        # the file's manager scales the sum by 2.5 (the arithmetic reward function gives 0 or 1)
        assert data["critic/score/mean"] == 0.625 and data["critic/score/min"] == 0.625
        assert data["num_turns/mean"] == 2
