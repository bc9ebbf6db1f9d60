"""A custom reward loop class (reward_model.reward_loop_source=importlib): loaded from its file,
checked for upstream's interface, run as the driver's reward manager, its scores in the batch."""

from __future__ import annotations

import pickle

import pytest
import torch
from omegaconf import OmegaConf

from verl.trainer.ppo.reward import load_reward_manager
from verl.trainer.ppo.rollout_source import RewardScorer, StepState
from verl.workers.reward_manager import RewardFunctionError
from verl.workers.reward_manager.reward_loop import RewardLoopManager

# upstream's interface: built as cls(config, tokenizer, compute_score, router, rm_tokenizer); an
# async run_single per one-row DataProto. Blocking work goes through the loop it was built in.
LOOP_FILE = """
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase


class LengthLoop(RewardManagerBase):
    def __init__(self, config, tokenizer, compute_score=None, reward_router_address=None, reward_model_tokenizer=None):
        super().__init__(config, tokenizer)
        self.bonus = config.reward_model.reward_kwargs.get("bonus", 0.0)
        self.compute_score = compute_score

    async def run_single(self, data):
        assert len(data) == 1
        item = data[0]
        length = int(item.batch["attention_mask"][-item.batch["responses"].shape[-1]:].sum())
        text = await self.loop.run_in_executor(None, lambda: self.tokenizer.decode(item.batch["responses"][:length]))
        truth = item.non_tensor_batch["reward_model"]["ground_truth"]
        score = (1.0 if text.startswith(truth) else 0.0) + self.bonus
        if text.startswith("!"):
            raise ValueError("bang")
        if text.startswith("?"):
            return {"score": score}
        return {"reward_score": score, "reward_extra_info": {"length": length}}


def not_a_class():
    pass


class Synchronous:
    def __init__(self, config, tokenizer, compute_score=None, reward_router_address=None, reward_model_tokenizer=None):
        pass

    def run_single(self, data):
        return {"reward_score": 0.0}


class TwoArguments(RewardManagerBase):
    def __init__(self, config, tokenizer):
        super().__init__(config, tokenizer)

    async def run_single(self, data):
        return {"reward_score": 0.0}


class Abstract(RewardManagerBase):
    pass
"""


@pytest.fixture
def loop_file(tmp_path):
    path = tmp_path / "my_loop.py"
    path.write_text(LOOP_FILE)
    return str(path)


def _config(path, name="LengthLoop", on_error="raise", bonus=0.0):
    return OmegaConf.create(
        {
            "data": {"reward_fn_key": "data_source"},
            "reward_model": {
                "reward_loop_source": "importlib",
                "reward_loop_module_path": path,
                "reward_loop_class_name": name,
                "reward_kwargs": {"bonus": bonus},
            },
            "custom_reward_function": {"path": None, "on_error": on_error},
        }
    )


def test_custom_loop_scores_reach_the_batch_at_each_last_response_token(loop_file, char_tokenizer, make_batch):
    manager = load_reward_manager(_config(loop_file, bonus=0.5), char_tokenizer, 0)
    assert isinstance(manager, RewardLoopManager)
    batch = make_batch(["12<eos>", "7", "12345"], ["12", "8", "12"])
    scores = RewardScorer(manager)(batch, StepState()).batch["token_level_scores"]
    expected = torch.zeros(3, 8)
    expected[0, 2], expected[1, 0], expected[2, 4] = 1.5, 0.5, 1.5  # 3, 1 and 5 valid tokens
    assert torch.equal(scores, expected)
    assert batch.non_tensor_batch["length"].tolist() == [3, 1, 5]
    # shipped to another process (launch_reward_fn_async) it rebuilds its loop and instance there
    again = pickle.loads(pickle.dumps(manager))
    assert torch.equal(again(make_batch(["12<eos>", "7", "12345"], ["12", "8", "12"])), expected)


def test_a_failing_or_malformed_run_single_follows_on_error(loop_file, char_tokenizer, make_batch):
    batch = make_batch(["!1", "?1", "1"], ["1", "1", "1"])
    with pytest.raises(
        RewardFunctionError, match=r"reward loop LengthLoop .* sample 0 of 3: LengthLoop.run_single raised"
    ):
        load_reward_manager(_config(loop_file), char_tokenizer, 0)(batch)
    result = load_reward_manager(_config(loop_file, on_error="zero"), char_tokenizer, 0)(batch, return_dict=True)
    assert result["reward_extra_info"]["reward_error"] == [1, 1, 0]
    assert result["reward_tensor"].sum().item() == 1.0


@pytest.mark.parametrize(
    "name, match",
    [
        ("Missing", r"reward_loop_class_name='Missing' is not defined in .*defines: \[.*'LengthLoop'"),
        ("not_a_class", "is a function, not a class"),
        ("Synchronous", r"has no coroutine `async def run_single\(self, data\)`"),
        ("TwoArguments", r"cannot be built as upstream builds a reward loop, cls\(config, tokenizer, compute_score"),
        ("Abstract", "leaves run_single abstract"),
    ],
)
def test_a_class_without_upstreams_interface_is_refused_when_loading(loop_file, char_tokenizer, name, match):
    with pytest.raises((AttributeError, TypeError), match=match):
        load_reward_manager(_config(loop_file, name=name), char_tokenizer, 0)


def test_a_missing_file_names_the_key(tmp_path, char_tokenizer):
    with pytest.raises(FileNotFoundError, match="reward_model.reward_loop_module_path=.*does not exist"):
        load_reward_manager(_config(str(tmp_path / "nope.py")), char_tokenizer, 0)


def test_the_config_check_refuses_an_incomplete_or_ignored_custom_loop():
    from verl.trainer.config import ConfigError, load_ppo_config

    importlib = "reward_model.reward_loop_source=importlib"
    named = ["reward_model.reward_loop_module_path=loop.py", "reward_model.reward_loop_class_name=Loop"]
    cases = [
        ([importlib], "needs reward_model.reward_loop_module_path"),
        ([importlib, *named, "reward_model.use_reward_loop=false"], "use_reward_loop=false: the custom reward loop"),
        ([importlib, *named, "reward_model.enable=true", "reward_model.model.path=x"], "with reward_model.enable=true"),
        (
            # both spell upstream v0.9's reward.reward_manager.module.path, with different files
            [importlib, *named, "reward_manager.source=importlib", "reward_manager.module.path=m.py"],
            "reward_model.reward_loop_module_path='loop.py', reward_manager.module.path='m.py' set one setting",
        ),
    ]
    for overrides, match in cases:
        with pytest.raises(ConfigError, match=match):
            load_ppo_config(overrides, config_name="arith_demo")
    load_ppo_config([importlib, *named], config_name="arith_demo")  # complete: accepted (the file is read later)


def test_a_reward_model_with_a_custom_reward_function_is_served_to_it_or_refused_without_the_loop(tmp_path):
    from verl.trainer.config import ConfigError, load_ppo_config

    fn = tmp_path / "score.py"
    fn.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n    return 0.0\n"
    )
    both = ["reward_model.enable=true", "reward_model.model.path=x", f"custom_reward_function.path={fn}"]
    # upstream's reward loop serves the model to the function: its engine must be named
    with pytest.raises(ConfigError, match="reward_model.rollout.name must name its engine"):
        load_ppo_config(both, config_name="arith_demo")
    load_ppo_config([*both, "reward_model.rollout.name=hf"], config_name="arith_demo")
    # without the loop, upstream's managers return the model's scores and never call the function
    with pytest.raises(ConfigError, match="so the function would never be called"):
        load_ppo_config(
            [*both, "reward_model.rollout.name=hf", "reward_model.use_reward_loop=false"], config_name="arith_demo"
        )
    load_ppo_config(both[:2], config_name="arith_demo")  # the model alone
    load_ppo_config(both[2:], config_name="arith_demo")  # the function alone
