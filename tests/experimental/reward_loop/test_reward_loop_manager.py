"""Upstream's `RewardLoopManager` on the local Ray cluster: `compute_rm_score` gives the `rm_scores` this
project's batch reward managers give on the same batch (naive, dapo), the extra info as columns, a custom
class from a file (importlib) or registered by the reward-function file, and with a discriminative reward
model the scores of its sequence classifier (the reward-model workers the trainer scores with)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from tests.experimental.reward_loop.test_reward_loop_classes import make_rows
from verl.models import bundled_model_path


@pytest.fixture(scope="module")
def tok():
    from verl.utils.tokenizer import hf_tokenizer

    return hf_tokenizer(bundled_model_path())


@pytest.fixture(scope="module")
def base_config():
    from verl.trainer.config import load_ppo_config

    return load_ppo_config(["trainer.device=cpu"], config_name="arith_demo")


def _config(base, **keys):
    config = copy.deepcopy(base)
    if "reward_model.reward_manager" in keys:  # the loaded config is resolved: what the interpolation gave
        keys["reward_manager.name"] = keys["reward_model.reward_manager"]
    for key, value in keys.items():
        OmegaConf.update(config, key, value, force_add=True)
    return config


def _rows(tok):
    # 5 rows over 2 workers: uneven chunks; gsm8k's rule: "#### <answer>"
    return make_rows(
        tok,
        ["#### 7", "#### 8", "so #### 12", "abcdefghij", "#### 3"],
        ["7", "7", "12", "1", "3"],
    )


def _last_token_scores(rm_scores, data):
    valid = data.batch["attention_mask"][:, -data.batch["responses"].shape[-1] :].sum(-1)
    rows = torch.arange(len(data))
    last = rm_scores[rows, valid - 1].clone()
    rest = rm_scores.clone()
    rest[rows, valid - 1] = 0
    assert not rest.any(), "scores outside each row's last valid response token"
    return last


@pytest.mark.parametrize("name", ["naive", "dapo"])
def test_rm_scores_equal_the_batch_reward_managers(name, base_config, tok, ray_session):
    from verl.experimental.reward_loop import RewardLoopManager
    from verl.trainer.ppo.reward import load_reward_manager

    buffer = {"enable": True, "len": 4, "penalty_factor": 1.0, "log": True}
    config = _config(
        base_config,
        **{
            "reward_model.reward_manager": name,
            "reward_model.num_workers": 2,
            "reward_model.overlong_buffer": buffer,
            "data.max_response_length": 10,
        },
    )
    data = _rows(tok)
    manager = RewardLoopManager(config)
    try:
        assert len(manager.reward_loop_workers) == 2
        out = manager.compute_rm_score(data)
    finally:
        manager.shutdown()
    expected = load_reward_manager(config, tok, num_examine=0)(data, return_dict=True)
    torch.testing.assert_close(out.batch["rm_scores"], expected["reward_tensor"])
    last = _last_token_scores(out.batch["rm_scores"], data).tolist()
    if name == "naive":
        assert last == [1.0, 0.0, 1.0, 0.0, 1.0]
        assert out.meta_info["reward_extra_keys"] == ["acc"]
    else:  # 10 characters: 4 into the buffer of 4, the full penalty; 10 chars "so #### 12": the same
        assert last == [1.0, 0.0, 0.0, -1.0, 1.0]
        assert out.meta_info["reward_extra_keys"] == ["acc", "overlong_reward", "overlong"]
        assert out.non_tensor_batch["overlong"].tolist() == [False, False, True, True, False]
    assert out.non_tensor_batch["acc"].tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]


LOOP_FILE = """
from verl.experimental.reward_loop.reward_manager import register
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase


def compute_score(data_source, solution_str, ground_truth, extra_info):
    return float(len(solution_str))


class LengthLoop(RewardManagerBase):
    def __init__(self, config, tokenizer, compute_score=None, reward_router_address=None, reward_model_tokenizer=None):
        super().__init__(config, tokenizer)
        self.compute_score = compute_score

    async def run_single(self, data):
        mask = data.batch["attention_mask"][0][-data.batch["responses"].shape[-1]:]
        n = int(mask.sum())
        text = self.tokenizer.decode(data.batch["responses"][0][:n])
        return {"reward_score": self.compute_score(None, text, None, None) * 10, "reward_extra_info": {"n": n}}


@register("mine")
class Registered(LengthLoop):
    async def run_single(self, data):
        out = await super().run_single(data)
        return {"reward_score": -out["reward_score"], "reward_extra_info": {"n": out["reward_extra_info"]["n"]}}
"""


def test_a_custom_class_from_a_file_or_registered_by_the_reward_function_file(base_config, tok, ray_session, tmp_path):
    from verl.experimental.reward_loop import RewardLoopManager
    from verl.trainer.ppo.reward import load_reward_manager

    path = tmp_path / "my_reward.py"
    path.write_text(LOOP_FILE)
    data = _rows(tok)
    lengths = [6.0, 6.0, 10.0, 10.0, 6.0]
    importlib_config = _config(
        base_config,
        **{
            "custom_reward_function.path": str(path),
            "reward_model.reward_loop_source": "importlib",
            "reward_model.reward_loop_module_path": str(path),
            "reward_model.reward_loop_class_name": "LengthLoop",
        },
    )
    registered_config = _config(
        base_config, **{"custom_reward_function.path": str(path), "reward_model.reward_manager": "mine"}
    )
    for config, sign in ((importlib_config, 1), (registered_config, -1)):
        manager = RewardLoopManager(config)
        try:
            out = manager.compute_rm_score(data)
        finally:
            manager.shutdown()
        assert _last_token_scores(out.batch["rm_scores"], data).tolist() == [sign * 10 * n for n in lengths]
        assert out.meta_info["reward_extra_keys"] == ["n"]
        assert out.non_tensor_batch["n"].tolist() == [int(n) for n in lengths]
    # the trainer runs a class the reward-function file registers under reward_model.reward_manager too
    driver = load_reward_manager(registered_config, tok, num_examine=0)
    torch.testing.assert_close(driver(data), out.batch["rm_scores"])


def test_an_unknown_name_is_refused(base_config, tok, ray_session):
    from verl.experimental.reward_loop.reward_loop import _Worker

    with pytest.raises(ValueError, match="Unknown reward manager: nowhere"):
        _Worker(_config(base_config, **{"reward_model.reward_manager": "nowhere"}))


def test_a_discriminative_reward_model_scores_as_the_sequence_classifier(base_config, tok, ray_session, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from tests.workers.test_reward_model_worker import _make_reward_model
    from verl.experimental.reward_loop import RewardLoopManager

    rm_path = tmp_path / "rm"
    _make_reward_model(rm_path)
    config = _config(
        base_config,
        **{
            "reward_model.enable": True,
            "reward_model.model.path": str(rm_path),
            "reward_model.model.input_tokenizer": None,
            "reward_model.micro_batch_size_per_gpu": 2,
            "reward_model.n_gpus_per_node": 1,
            "reward_model.nnodes": 1,
        },
    )
    data = _rows(tok)
    manager = RewardLoopManager(config)
    try:
        assert manager.reward_loop_workers == []
        out = manager.compute_rm_score(data)
    finally:
        manager.shutdown()
    model = AutoModelForSequenceClassification.from_pretrained(rm_path).double().eval()
    with torch.no_grad():
        expected = [
            model(input_ids=data.batch["input_ids"][i][data.batch["attention_mask"][i].bool()][None]).logits[0, 0]
            for i in range(len(data))
        ]
    got = _last_token_scores(out.batch["rm_scores"], data)
    torch.testing.assert_close(got.double(), torch.stack(expected), atol=5e-5, rtol=0)
    assert np.ptp(got.numpy()) > 0.01 and out.meta_info["reward_extra_keys"] == []
