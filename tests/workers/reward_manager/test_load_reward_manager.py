"""load_reward_manager / compute_reward (verl/trainer/ppo/reward.py) with real managers and batches."""

import pytest
import torch
from omegaconf import OmegaConf

from verl.trainer.ppo.reward import compute_reward, load_reward_manager
from verl.workers.reward_manager import DAPORewardManager, NaiveRewardManager

LENGTH_REWARD = """
def length_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": len(solution_str) / 10, "length": len(solution_str)}
"""


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "length_reward.py"
    path.write_text(LENGTH_REWARD)
    return str(path)


def _config(path=None, name=None, manager="naive", manager_kwargs=None):
    return OmegaConf.create(
        {
            "data": {"reward_fn_key": "data_source"},
            "reward_model": {"reward_manager": manager, "reward_kwargs": manager_kwargs or {}},
            # a key left out takes the YAML's value (name: compute_score)
            "custom_reward_function": {"path": path, **({"name": name} if name else {})},
        }
    )


def test_load_reward_manager_wires_name_function_and_options(reward_file, char_tokenizer, make_batch):
    manager = load_reward_manager(
        _config(reward_file, "length_score", manager="naive", manager_kwargs={"on_error": "zero"}), char_tokenizer, 0
    )
    assert isinstance(manager, NaiveRewardManager) and manager.on_error == "zero"
    reward, extra = compute_reward(make_batch(["abc<eos>"], ["1"]), manager)
    assert torch.isclose(reward[0, 3], torch.tensor(0.3))
    assert extra["length"] == [3] and extra["reward_error"] == [0]


def test_load_reward_manager_defaults_to_naive_with_builtin_rules(char_tokenizer, make_batch):
    manager = load_reward_manager(OmegaConf.create({"data": {}}), char_tokenizer, 0)
    assert isinstance(manager, NaiveRewardManager)
    assert manager(make_batch(["5<eos>"], ["5"])).sum() == 1.0


def test_load_reward_manager_passes_explicit_kwargs(char_tokenizer):
    manager = load_reward_manager(
        _config(manager="dapo"), char_tokenizer, 0, max_resp_len=8, overlong_buffer_cfg={"enable": True, "len": 2}
    )
    assert isinstance(manager, DAPORewardManager) and manager.max_resp_len == 8


def test_load_reward_manager_rejects_options_the_manager_does_not_take(char_tokenizer):
    with pytest.raises(TypeError, match=r"'naive' \(NaiveRewardManager\) does not take the options \['timeout'\]"):
        load_reward_manager(_config(manager_kwargs={"timeout": 3}), char_tokenizer, 0)
    with pytest.raises(ValueError, match="unknown reward manager 'nope'"):
        load_reward_manager(_config(manager="nope"), char_tokenizer, 0)
