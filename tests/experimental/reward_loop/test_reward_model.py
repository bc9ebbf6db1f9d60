"""A generative reward model served to the reward function (upstream's reward loop with reward_model.enable and
custom_reward_function): the function gets reward_router_address / reward_model_tokenizer and asks the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.experimental.reward_loop.greedy_reference import hf_greedy
from tests.trainer.main_ppo_runs import common_overrides, main_ppo_cmd, read_metrics, run_main_ppo
from verl.experimental.reward_loop.reward_model import serving_spec, with_reward_model
from verl.models import bundled_model_path

# A judge in the shape of verl-recipe FAPO's compute_score_fapo: async, the judge prompt's ids POSTed to
# http://{reward_router_address}/generate, the verdict decoded with the reward model's tokenizer. Here the judge
# (the bundled arithmetic model) answers the question itself and the response scores 1 when it agrees.
JUDGE = """
import json
from pathlib import Path

import aiohttp


async def compute_score(data_source, solution_str, ground_truth, extra_info, reward_router_address, reward_model_tokenizer):
    question = extra_info["question"]
    ids = reward_model_tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=True, add_generation_prompt=True
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"http://{reward_router_address}/generate",
            json={"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
        ) as resp:
            out = await resp.json()
    judge = reward_model_tokenizer.decode(out["output_ids"], skip_special_tokens=True).strip()
    score = float(solution_str.strip() == judge)
    with open(Path(__file__).with_suffix(".jsonl"), "a") as f:
        f.write(json.dumps({"prompt_ids": ids, "output_ids": out["output_ids"], "response": solution_str, "score": score}) + "\\n")
    return {"score": score, "judge_agrees": score}
"""


def _config(*overrides: str):
    from verl.trainer.config import load_ppo_config

    return load_ppo_config(
        ["reward_model.enable=true", f"reward_model.model.path={bundled_model_path()}", "reward_model.rollout.name=hf",
         "reward_model.rollout.tensor_model_parallel_size=1", *overrides],
        config_name="arith_demo",
    )  # fmt: skip


def test_replicas_follow_upstreams_rule_and_the_function_must_take_the_model():
    assert serving_spec(_config("trainer.n_gpus_per_node=2"))["num_replicas"] == 2  # trainer's workers / tp
    own = _config("reward_model.enable_resource_pool=true", "reward_model.n_gpus_per_node=3", "reward_model.nnodes=1")
    assert serving_spec(own)["num_replicas"] == 3 and serving_spec(own)["own_pool"]
    # upstream's RewardModelManager(config.reward_model): the section alone, served on its own workers
    section = serving_spec(own.reward_model)
    assert section["num_replicas"] == 3 and section["base_rollout"] is None and section["own_pool"]
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2 does not divide the 1 workers"):
        serving_spec(_config("trainer.n_gpus_per_node=1", "reward_model.rollout.tensor_model_parallel_size=2"))

    def plain(data_source, solution_str, ground_truth, extra_info=None):
        return 0.0

    with pytest.raises(TypeError, match=r"does not take \['reward_router_address', 'reward_model_tokenizer'\]"):
        with_reward_model(plain, _config())

    async def judge(data_source, solution_str, ground_truth, extra_info, **kwargs):
        return 0.0

    import inspect

    assert inspect.iscoroutinefunction(with_reward_model(judge, _config()))  # async stays async for the managers


@pytest.mark.slow
def test_grpo_scores_with_a_generative_judge_behind_the_router(tmp_path, shared_ray_cluster):
    """Two trainer workers, tp=1: two judge replicas behind the round-robin router. Every judge answer is
    transformers' greedy answer, and each step's score is the judge's agreement with the response."""
    judge = tmp_path / "judge_reward.py"
    judge.write_text(JUDGE)
    run_main_ppo(
        main_ppo_cmd(
            "arith_demo",
            *common_overrides(tmp_path, steps=2),
            "trainer.n_gpus_per_node=2",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "reward_model.enable=true",
            f"reward_model.model.path={bundled_model_path()}",
            "reward_model.rollout.name=hf",
            "reward_model.rollout.tensor_model_parallel_size=1",
            f"custom_reward_function.path={judge}",
        ),
        tmp_path,
        cluster=shared_ray_cluster,
    )
    calls = [json.loads(line) for line in Path(judge.with_suffix(".jsonl")).read_text().splitlines()]
    assert len(calls) == 2 * 4 * 2  # steps x prompts x samples: one judge call per sample
    for prompt in {tuple(c["prompt_ids"]) for c in calls}:
        expected = hf_greedy(list(prompt), 8)
        assert all(c["output_ids"] == expected for c in calls if tuple(c["prompt_ids"]) == prompt)
    steps = [r["data"] for r in read_metrics(tmp_path) if "critic/score/mean" in r["data"]]
    assert len(steps) == 2
    for step, rows in zip(steps, (calls[:8], calls[8:]), strict=True):
        assert step["critic/score/mean"] == pytest.approx(sum(c["score"] for c in rows) / 8)


# upstream's custom reward loop class (reward_loop_source=importlib), built with the router and the tokenizer
JUDGE_LOOP = """
import aiohttp

from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase


class JudgeLoop(RewardManagerBase):
    def __init__(self, config, tokenizer, compute_score=None, reward_router_address=None, reward_model_tokenizer=None):
        super().__init__(config, tokenizer)
        assert reward_router_address and reward_model_tokenizer is not None
        self.router, self.rm_tokenizer = reward_router_address, reward_model_tokenizer

    async def run_single(self, data):
        item = data[0]
        ids = self.rm_tokenizer.apply_chat_template(
            [{"role": "user", "content": item.non_tensor_batch["extra_info"]["question"]}],
            tokenize=True, add_generation_prompt=True,
        )
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://{self.router}/generate",
                                    json={"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}) as r:
                out = await r.json()
        return {"reward_score": float(len(out["output_ids"])), "reward_extra_info": {"judge_ids": out["output_ids"]}}
"""


@pytest.mark.slow
def test_a_custom_reward_loop_class_gets_the_router_of_two_replicas(tmp_path, ray_session):
    import numpy as np

    from verl.protocol import DataProto
    from verl.trainer.ppo.reward import load_reward_manager
    from verl.utils.tokenizer import hf_tokenizer

    (tmp_path / "judge_loop.py").write_text(JUDGE_LOOP)
    (tmp_path / "fn.py").write_text("def compute_score(*a, **k):\n    return 0.0\n")
    config = _config(
        "trainer.n_gpus_per_node=2",  # two replicas (tp=1) behind the router
        "reward_model.reward_loop_source=importlib",
        f"reward_model.reward_loop_module_path={tmp_path / 'judge_loop.py'}",
        "reward_model.reward_loop_class_name=JudgeLoop",
        f"custom_reward_function.path={tmp_path / 'fn.py'}",
    )
    tok = hf_tokenizer(bundled_model_path())
    manager = load_reward_manager(config, tok, num_examine=0)
    questions = ["What is 12+34?", "What is 7+58?", "What is 90+9?", "What is 3+4?"]
    responses = torch.tensor([[tok.eos_token_id, tok.pad_token_id]] * len(questions))
    data = DataProto.from_dict(
        tensors={"responses": responses, "attention_mask": torch.ones(len(questions), 4, dtype=torch.long),
                 "prompts": torch.ones(len(questions), 2, dtype=torch.long)},
        non_tensors={"extra_info": np.array([{"question": q} for q in questions], dtype=object),
                     "reward_model": np.array([{"ground_truth": "0"}] * len(questions), dtype=object),
                     "data_source": np.array(["judge"] * len(questions), dtype=object)},
    )  # fmt: skip
    result = manager(data, return_dict=True)
    for i, q in enumerate(questions):
        ids = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True)
        expected = hf_greedy(ids, 8)
        assert result["reward_extra_info"]["judge_ids"][i] == expected
        assert result["reward_tensor"][i].sum().item() == len(expected)
