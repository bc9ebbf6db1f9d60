"""Upstream's reward-loop classes one sample at a time (`run_single` on a one-row DataProto) and their
registry. The policy's tokenizer is the bundled arith model's, one token per character, so a response's
valid length is its character count and every expected score below is worked by hand."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl.experimental.reward_loop.reward_manager import (
    DAPORewardManager,
    NaiveRewardManager,
    RateLimitedRewardManager,
    RemoteRewardManager,
    RewardManagerBase,
    get_reward_manager_cls,
    register,
)
from verl.models import bundled_model_path
from verl.protocol import DataProto


@pytest.fixture(scope="module")
def tok():
    from verl.utils.tokenizer import hf_tokenizer

    return hf_tokenizer(bundled_model_path())


def make_rows(tok, responses, ground_truths, data_source="openai/gsm8k", response_len=10, extra_infos=None, **cols):
    """A rollout-shaped batch: left-padded prompts of 4 tokens, right-padded responses of `response_len`."""
    n, prompt_len, pad = len(responses), 4, tok.pad_token_id
    prompts = torch.full((n, prompt_len), pad)
    response_ids = torch.full((n, response_len), pad)
    mask = torch.zeros((n, prompt_len + response_len), dtype=torch.long)
    for i, text in enumerate(responses):
        p = tok("Q?", add_special_tokens=False)["input_ids"]
        prompts[i, prompt_len - len(p) :] = torch.tensor(p)
        mask[i, prompt_len - len(p) : prompt_len] = 1
        r = tok(text, add_special_tokens=False)["input_ids"]
        assert len(r) == len(text) <= response_len  # one token per character
        response_ids[i, : len(r)] = torch.tensor(r)
        mask[i, prompt_len : prompt_len + len(r)] = 1
    non_tensors = {
        "data_source": np.array([data_source] * n, dtype=object),
        "reward_model": np.array([{"ground_truth": g} for g in ground_truths], dtype=object),
        "extra_info": np.array(extra_infos or [{"index": i} for i in range(n)], dtype=object),
        **{k: np.array(v, dtype=object) for k, v in cols.items()},
    }
    return DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": response_ids,
            "input_ids": torch.cat([prompts, response_ids], -1),
            "attention_mask": mask,
        },
        non_tensors=non_tensors,
    )


def run(manager, data):
    async def go():
        return await manager.run_single(data)

    return asyncio.run(go())


CONFIG = OmegaConf.create({"reward_model": {"num_workers": 2, "reward_kwargs": {}}, "data": {}})


def test_the_registry_names_upstreams_classes_and_refuses_a_taken_or_unknown_name():
    assert get_reward_manager_cls("naive") is NaiveRewardManager
    assert get_reward_manager_cls("dapo") is DAPORewardManager
    assert get_reward_manager_cls("remote") is RemoteRewardManager
    assert get_reward_manager_cls("rate_limited") is RateLimitedRewardManager
    assert register("naive")(NaiveRewardManager) is NaiveRewardManager  # the same class again: fine

    class Other(RewardManagerBase):
        async def run_single(self, data):
            return {"reward_score": 0.0}

    with pytest.raises(ValueError, match="already been registered"):
        register("naive")(Other)
    assert get_reward_manager_cls("naive") is NaiveRewardManager
    with pytest.raises(ValueError, match="Unknown reward manager: nope"):
        get_reward_manager_cls("nope")


def test_naive_scores_with_the_default_scorer_and_reports_acc(tok):
    data = make_rows(tok, ["so #### 7", "so #### 8"], ["7", "7"])
    manager = NaiveRewardManager(CONFIG, tok)
    assert run(manager, data[0:1]) == {"reward_score": 1.0, "reward_extra_info": {"acc": 1.0}}
    assert run(manager, data[1:2]) == {"reward_score": 0.0, "reward_extra_info": {"acc": 0.0}}
    with pytest.raises(ValueError, match="one sample; got a batch of 2"):
        run(manager, data)


def test_naive_takes_sync_and_async_functions_and_reports_a_dicts_keys(tok):
    seen = []

    def by_length(data_source, solution_str, ground_truth, extra_info):
        seen.append(dict(extra_info))
        return {"score": len(solution_str) / 10, "gt": ground_truth}

    async def async_by_length(data_source, solution_str, ground_truth, extra_info):
        await asyncio.sleep(0)
        return len(solution_str) * 2.0

    data = make_rows(tok, ["abcd"], ["x"], __num_turns__=[3], reward_scores=[{"tool": 0.5}])
    out = run(NaiveRewardManager(CONFIG, tok, by_length), data)
    assert out == {"reward_score": 0.4, "reward_extra_info": {"score": 0.4, "gt": "x"}}
    # upstream's rollout fields reach the function in extra_info
    assert seen == [{"index": 0, "num_turns": 3, "rollout_reward_scores": {"tool": 0.5}}]
    out = run(NaiveRewardManager(CONFIG, tok, async_by_length), data)
    assert out == {"reward_score": 8.0, "reward_extra_info": {"acc": 8.0}}


def test_naive_passes_the_reward_model_to_the_function_and_refuses_a_non_number(tok):
    def judge(data_source, solution_str, ground_truth, extra_info, reward_router_address, reward_model_tokenizer):
        return 1.0 if reward_router_address == "host:1" and reward_model_tokenizer == "rm-tok" else -1.0

    data = make_rows(tok, ["ab"], ["x"])
    assert run(NaiveRewardManager(CONFIG, tok, judge, "host:1", "rm-tok"), data)["reward_score"] == 1.0
    with pytest.raises(ValueError, match="non-finite score nan"):
        run(NaiveRewardManager(CONFIG, tok, lambda **kw: float("nan")), data)


def _dapo_config(**reward_kwargs):
    return OmegaConf.create({"reward_model": {"reward_kwargs": reward_kwargs}, "data": {}})


def test_dapo_subtracts_the_overlong_penalty_worked_by_hand(tok):
    # max_resp_len 10, buffer 4: no penalty up to 6 tokens, then -factor * (n - 6) / 4
    cfg = _dapo_config(
        overlong_buffer_cfg={"enable": True, "len": 4, "penalty_factor": 2.0, "log": True}, max_resp_len=10
    )
    manager = DAPORewardManager(cfg, tok, lambda **kw: 1.0)
    data = make_rows(tok, ["abcdef", "abcdefgh", "abcdefghij"], ["x"] * 3)
    assert run(manager, data[0:1]) == {
        "reward_score": 1.0,
        "reward_extra_info": {"acc": 1.0, "overlong_reward": 0.0, "overlong": False},
    }
    # 8 tokens: 2 into the buffer, -2.0 * 2 / 4 = -1.0
    assert run(manager, data[1:2]) == {
        "reward_score": 0.0,
        "reward_extra_info": {"acc": 1.0, "overlong_reward": -1.0, "overlong": True},
    }
    assert run(manager, data[2:3])["reward_score"] == pytest.approx(1.0 - 2.0)  # 10 tokens: the full factor


def test_dapo_without_the_buffer_is_naive_and_falls_back_to_the_trainer_keys(tok):
    data = make_rows(tok, ["abcdefgh"], ["x"])
    assert run(DAPORewardManager(_dapo_config(), tok, lambda **kw: 1.0), data)["reward_score"] == 1.0
    # the driver's keys where reward_kwargs has none: reward_model.overlong_buffer, data.max_response_length
    cfg = OmegaConf.create(
        {
            "reward_model": {"overlong_buffer": {"enable": True, "len": 4, "penalty_factor": 1.0, "log": False}},
            "data": {"max_response_length": 10},
        }
    )
    out = run(DAPORewardManager(cfg, tok, lambda **kw: 1.0), data)
    assert out == {"reward_score": 0.5, "reward_extra_info": {"acc": 1.0}}  # 8 tokens: -1.0 * 2 / 4
    with pytest.raises(ValueError, match="must be in \\(0, max_resp_len=3\\]"):
        DAPORewardManager(_dapo_config(overlong_buffer_cfg={"enable": True, "len": 4}, max_resp_len=3), tok)


def test_remote_scores_in_ray_processes_and_refuses_an_async_function(tok, ray_session, tmp_path):
    fn_file = tmp_path / "score.py"
    fn_file.write_text(
        "import os\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return {'score': float(len(solution_str)), 'pid': os.getpid()}\n"
    )
    from verl.utils.import_utils import load_extern_object

    fn = load_extern_object(str(fn_file), "compute_score")  # a file loaded by path, as the trainer loads it
    manager = RemoteRewardManager(CONFIG, tok, fn)
    try:
        assert len(manager.reward_worker) == 2
        data = make_rows(tok, ["abc", "abcde"], ["x", "x"])

        async def both():
            return await asyncio.gather(manager.run_single(data[0:1]), manager.run_single(data[1:2]))

        outs = asyncio.run(both())
        assert [o["reward_score"] for o in outs] == [3.0, 5.0]
        pids = {o["reward_extra_info"]["pid"] for o in outs}
        assert len(pids) == 2 and os_pid() not in pids  # round-robin over the two worker processes
    finally:
        manager.shutdown()

    async def async_fn(**kw):
        return 1.0

    with pytest.raises(TypeError, match="cannot take an async def reward function"):
        RemoteRewardManager(CONFIG, tok, async_fn)


def os_pid() -> int:
    import os

    return os.getpid()
