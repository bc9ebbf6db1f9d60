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
    with pytest.raises(ValueError, match="Unknown reward manager: nope "):
        load_reward_manager(_config(manager="nope"), char_tokenizer, 0)


# A reward file that registers its own manager beside its function, as upstream's collabllm recipe
# does (`@register("collabllm")` in the file named by custom_reward_function.path).
REGISTERING_FILE = """
import torch

from verl.workers.reward_manager import register


def exact(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth)


@register("file_registered_test")
class WeightedLastToken:
    def __init__(self, tokenizer, num_examine, compute_score=None, reward_fn_key="data_source", weight=1.0):
        self.tokenizer, self.compute_score, self.weight = tokenizer, compute_score, weight

    def __call__(self, data, return_dict=False):
        prompt_len = data.batch["prompts"].shape[-1]
        lengths = data.batch["attention_mask"][:, prompt_len:].sum(-1)
        reward = torch.zeros_like(data.batch["responses"], dtype=torch.float32)
        for i in range(len(data)):
            ids = data.batch["responses"][i, : lengths[i]]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            score = self.compute_score("arith", text, data.non_tensor_batch["reward_model"][i]["ground_truth"])
            reward[i, lengths[i] - 1] = self.weight * score
        return {"reward_tensor": reward} if return_dict else reward
"""


@pytest.fixture
def registering_file(tmp_path):
    from verl.workers.reward_manager import REWARD_MANAGER_REGISTRY

    path = tmp_path / "registering_reward.py"
    path.write_text(REGISTERING_FILE)
    yield str(path)
    REWARD_MANAGER_REGISTRY.pop("file_registered_test", None)  # the registry is process-wide


def test_a_manager_registered_by_the_custom_reward_file_is_found(registering_file, char_tokenizer, make_batch):
    from verl.trainer.config import validate_ppo_config
    from verl.trainer.config.loader import compose_config
    from verl.workers.reward_manager import REWARD_MANAGER_REGISTRY

    overrides = [
        "trainer.device=cpu",
        "actor_rollout_ref.rollout.name=hf",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        f"custom_reward_function.path={registering_file}",
        "custom_reward_function.name=exact",
        "reward_model.reward_manager=file_registered_test",
        "+reward_model.reward_kwargs.weight=0.5",
    ]
    config = compose_config(overrides, config_name="ppo_trainer")
    # the name is not registered before the file is imported, and validation does not import it
    assert "file_registered_test" not in REWARD_MANAGER_REGISTRY
    validate_ppo_config(config)
    manager = load_reward_manager(config, char_tokenizer, 0)
    assert type(manager).__name__ == "WeightedLastToken" and manager.weight == 0.5
    reward, _ = compute_reward(make_batch(["12<eos>", "7<eos>"], ["12", "8"]), manager)
    expected = torch.zeros(2, 8)
    expected[0, 2] = 0.5  # "12<eos>": right, weight 0.5 on its last token (index 2)
    assert torch.equal(reward, expected)


def test_a_name_the_custom_reward_file_does_not_register_says_the_file_was_imported(reward_file, char_tokenizer):
    with pytest.raises(ValueError, match=r"Unknown reward manager: elsewhere .*length_reward.py' was imported"):
        load_reward_manager(_config(reward_file, "length_score", manager="elsewhere"), char_tokenizer, 0)
