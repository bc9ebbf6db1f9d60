"""verl.experimental.reward_loop.reward_manager.limited.RateLimitedRewardManager: upstream's reward-loop
form of the rate-limited manager, alone (run_single) and as a custom reward loop of the driver."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import torch
from omegaconf import OmegaConf

import verl.experimental.reward_loop.reward_manager.limited as limited_module
from verl.experimental.reward_loop.reward_manager.limited import RateLimitedRewardManager
from verl.trainer.ppo.reward import load_reward_manager
from verl.workers.reward_manager.limited import AsyncTokenBucket


@pytest.fixture(autouse=True)
def fresh_class_state():
    for name in ("_semaphore", "_rpm_limiter", "_tpm_limiter", "_max_rpm", "_max_tpm"):
        setattr(RateLimitedRewardManager, name, None)
    RateLimitedRewardManager._class_initialized = False
    yield
    RateLimitedRewardManager._class_initialized = False


def _config(**limits):
    return OmegaConf.create({"reward_model": limits})


def exact(data_source, solution_str, ground_truth, extra_info, **kwargs):
    return float(solution_str == ground_truth)


async def judged(data_source, solution_str, ground_truth, extra_info, **kwargs):
    if solution_str == "boom":
        raise RuntimeError("judge unavailable")
    if solution_str == "slow":
        await asyncio.sleep(5)
    return {"score": 2.0 if solution_str == ground_truth else -1.0, "source": data_source, **extra_info}


def test_the_token_bucket_is_the_driver_managers():
    assert limited_module.AsyncTokenBucket is AsyncTokenBucket


def test_run_single_scores_with_a_plain_or_async_function_and_reports_extra_info(char_tokenizer, make_batch):
    async def run():
        plain = RateLimitedRewardManager(_config(), char_tokenizer, exact)
        judge = RateLimitedRewardManager(_config(), char_tokenizer, judged)
        batch = make_batch(["12<eos>", "7"], ["12", "8"], extra_infos=[{"id": 1}, {"id": 2}])
        return [await plain.run_single(batch[i : i + 1]) for i in range(2)] + [
            await judge.run_single(batch[i : i + 1]) for i in range(2)
        ]

    assert asyncio.run(run()) == [
        {"reward_score": 1.0, "reward_extra_info": {"acc": 1.0}},  # "<eos>" is dropped when decoding
        {"reward_score": 0.0, "reward_extra_info": {"acc": 0.0}},
        {"reward_score": 2.0, "reward_extra_info": {"score": 2.0, "source": "arith", "id": 1}},
        {"reward_score": -1.0, "reward_extra_info": {"score": -1.0, "source": "arith", "id": 2}},
    ]


def test_a_failing_or_slow_call_scores_zero_and_says_why(char_tokenizer, make_batch):
    async def run():
        manager = RateLimitedRewardManager(_config(timeout=0.2), char_tokenizer, judged)
        batch = make_batch(["boom", "slow"], ["x", "x"])
        return await asyncio.gather(*(manager.run_single(batch[i : i + 1]) for i in range(2)))

    assert asyncio.run(run()) == [
        {"reward_score": 0.0, "reward_extra_info": {"error": "judge unavailable", "acc": 0.0}},
        {"reward_score": 0.0, "reward_extra_info": {"timeout": True, "acc": 0.0}},
    ]


def test_requests_per_minute_pace_the_calls_after_a_one_second_burst(char_tokenizer, make_batch):
    async def run():
        manager = RateLimitedRewardManager(_config(max_rpm=240, max_concurrent=8), char_tokenizer, exact)
        batch = make_batch(["1"], ["1"])
        start = time.monotonic()
        await asyncio.gather(*(manager.run_single(batch) for _ in range(6)))  # 4 at once, then 1 each 0.25 s
        return time.monotonic() - start

    assert 0.45 < asyncio.run(run()) < 1.5


def test_the_first_limits_stay_and_a_different_later_one_is_warned_about(char_tokenizer, caplog):
    RateLimitedRewardManager(tokenizer=char_tokenizer, compute_score=exact, num_examine=0, reward_fn_key="data_source")
    assert RateLimitedRewardManager._rpm_limiter is None and RateLimitedRewardManager._semaphore._value == 1
    with caplog.at_level(logging.WARNING):
        RateLimitedRewardManager(_config(), char_tokenizer, exact)  # same limits: silent
        assert caplog.records == []
        RateLimitedRewardManager(_config(max_rpm=60), char_tokenizer, exact)
    assert "already been initialized" in caplog.text and "max_rpm=60" in caplog.text and "ignored" in caplog.text
    assert RateLimitedRewardManager._rpm_limiter is None


def test_limits_are_checked_like_the_driver_managers(char_tokenizer):
    with pytest.raises(ValueError, match="max_concurrent"):
        RateLimitedRewardManager(_config(max_concurrent=0), char_tokenizer, exact)


def test_it_runs_as_the_drivers_custom_reward_loop(char_tokenizer, make_batch):
    config = OmegaConf.create(
        {
            "data": {"reward_fn_key": "data_source"},
            "reward_model": {
                "reward_loop_source": "importlib",
                "reward_loop_module_path": limited_module.__file__,
                "reward_loop_class_name": "RateLimitedRewardManager",
                "max_concurrent": 2,
            },
            "custom_reward_function": {"path": None, "on_error": "raise"},
        }
    )
    manager = load_reward_manager(config, char_tokenizer, 0, compute_score=exact)
    result = manager(make_batch(["12<eos>", "7", "123"], ["12", "8", "123"]), return_dict=True)
    expected = torch.zeros(3, 8)
    expected[0, 2], expected[2, 2] = 1.0, 1.0
    assert torch.equal(result["reward_tensor"], expected)
    assert list(result["reward_extra_info"]["acc"]) == [1.0, 0.0, 1.0]
