"""Failures that only a running trainer meets: a reward function that raises or returns NaN, losses
that turn NaN, a prompt too long for `data.truncation=error`, and a tokenizer without a pad token.

One real trainer (Ray, 2 FSDP worker processes, the built-in engine, the bundled tiny model) is
built once for the module and driven step by step; each test swaps in the reward function it
needs. The model is a copy of the bundled one whose tokenizer has no pad token, so every test
also shows that such a tokenizer is handled rather than an error.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from reliability_helpers import arith_rows, copy_model_without_pad_token, small_run, tracker_step, write_rows

REWARDS = """
_calls = [0]


def _correct(solution_str, ground_truth):
    return 1.0 if solution_str.strip() == str(ground_truth) else 0.0


def raise_on_second(data_source, solution_str, ground_truth, extra_info=None):
    _calls[0] += 1
    if _calls[0] == 2:
        raise ZeroDivisionError("division by zero in my parser")
    return _correct(solution_str, ground_truth)


def nan_on_second(data_source, solution_str, ground_truth, extra_info=None):
    _calls[0] += 1
    return float("nan") if _calls[0] == 2 else _correct(solution_str, ground_truth)


def extreme(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
    # +scale, -scale, +scale, ...: the two samples of each prompt get opposite scores
    _calls[0] += 1
    return scale if _calls[0] % 2 else -scale
"""


@pytest.fixture(scope="module")
def setup(ray_session, tmp_path_factory):
    from verl.single_controller.ray import ResourcePoolManager
    from verl.trainer.config import load_ppo_config
    from verl.trainer.main_ppo import build_datasets, build_role_worker_mapping
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils.tokenizer import hf_tokenizer

    tmp = tmp_path_factory.mktemp("trainer")
    model = copy_model_without_pad_token(tmp / "model")
    data = write_rows(tmp / "train.parquet", arith_rows(64))
    (tmp / "rewards.py").write_text(REWARDS)
    config = load_ppo_config(
        [
            *small_run(tmp),
            f"actor_rollout_ref.model.path={model}",
            f"data.train_files={data}",
            f"data.val_files={data}",
            "trainer.progress_bar=false",
            "trainer.max_consecutive_nonfinite_steps=2",
        ],
        config_name="arith_demo",
    )
    tokenizer = hf_tokenizer(str(model))
    train, _ = build_datasets(config, tokenizer)
    mapping = build_role_worker_mapping(config)
    pools = ResourcePoolManager(resource_pool_spec={"global_pool": [2]}, mapping=dict.fromkeys(mapping, "global_pool"))
    trainer = RayPPOTrainer(
        config=config,
        tokenizer=tokenizer,
        role_worker_mapping=mapping,
        resource_pool_manager=pools,
        train_dataset=train,
    )
    trainer.init_workers()
    yield trainer, tmp
    for pool in pools.resource_pool_dict.values():
        pool.remove_placement_groups()


def _reward_fn(trainer, tmp: Path, name: str, on_error: str = "raise", **reward_kwargs):
    """The reward manager main_ppo would build for custom_reward_function.{path,name,on_error,reward_kwargs}."""
    from verl.trainer.ppo.reward import load_reward_manager

    config = copy.deepcopy(trainer.config)
    OmegaConf.update(config, "custom_reward_function.path", str(tmp / "rewards.py"))
    OmegaConf.update(config, "custom_reward_function.name", name)
    OmegaConf.update(config, "custom_reward_function.on_error", on_error)
    OmegaConf.update(config, "custom_reward_function.reward_kwargs", reward_kwargs, merge=False)
    return load_reward_manager(config, trainer.tokenizer, num_examine=0)


def test_a_tokenizer_without_pad_token_pads_with_eos_and_trains(setup, tmp_path):
    trainer, tmp = setup
    assert trainer.tokenizer.pad_token_id == trainer.tokenizer.eos_token_id
    trainer.reward_fn = _reward_fn(trainer, tmp, "raise_on_second", on_error="zero")
    metrics = trainer.step()
    assert metrics["response_length/mean"] > 0 and metrics.get("actor/skipped_nonfinite_grad", 0.0) == 0


def _exit_report(error: BaseException, capture) -> tuple[int, str]:
    """What `python -m verl.trainer.main_ppo` prints and returns for this failure (capture: capsys/capfd)."""
    from verl.trainer.main_ppo import _report_failure

    capture.readouterr()
    status = _report_failure(error)
    return status, capture.readouterr().err


def test_reward_function_that_raises_stops_the_step_showing_the_sample(setup, capsys):
    from verl.workers.reward_manager.abstract import RewardFunctionError

    trainer, tmp = setup
    trainer.reward_fn = _reward_fn(trainer, tmp, "raise_on_second")
    with pytest.raises(RewardFunctionError) as info:
        trainer.step()
    status, err = _exit_report(info.value, capsys)
    assert status == 1 and err.startswith("verl: training failed: RewardFunctionError: reward function")
    assert "Traceback" not in err  # the message says it all
    message = str(info.value)
    for part in (
        "reward function raise_on_second failed on sample 1 of 8: ZeroDivisionError: division by zero in my parser",
        "data_source: 'arith'",
        "ground_truth: '",
        "response: '",
        "custom_reward_function.on_error=zero",
    ):
        assert part in message, message


def test_reward_function_that_raises_scores_zero_and_is_counted_with_on_error_zero(setup):
    trainer, tmp = setup
    trainer.reward_fn = _reward_fn(trainer, tmp, "raise_on_second", on_error="zero")
    metrics = trainer.step()
    assert metrics["reward/num_errors"] == 1.0


def test_reward_that_returns_nan_is_an_error_or_a_counted_zero(setup):
    from verl.workers.reward_manager.abstract import RewardFunctionError

    trainer, tmp = setup
    trainer.reward_fn = _reward_fn(trainer, tmp, "nan_on_second")
    with pytest.raises(RewardFunctionError, match="returned a non-finite score nan"):
        trainer.step()
    trainer.reward_fn = _reward_fn(trainer, tmp, "nan_on_second", on_error="zero")
    metrics = trainer.step()
    assert metrics["reward/num_errors"] == 1.0
    assert metrics["critic/score/max"] <= 1.0  # the NaN never reached the scores


def test_nan_losses_skip_their_updates_and_stop_the_run_after_k_in_a_row(setup, tmp_path, capfd):
    """Rewards of +-1e30 (unnormalised GRPO) overflow the gradient: each step's update is skipped
    and counted; the 2nd in a row (max_consecutive_nonfinite_steps=2) stops the run before its
    checkpoint, so the one saved after step 1 stays the latest."""
    from verl.trainer.ppo.ray_trainer import NonFiniteLossError

    trainer, tmp = setup
    trainer.reward_fn = _reward_fn(trainer, tmp, "extreme", scale=1e30)  # custom_reward_function.reward_kwargs
    config = trainer.config
    OmegaConf.update(config, "algorithm.norm_adv_by_std_in_grpo", False)
    OmegaConf.update(config, "trainer.save_freq", 1)
    OmegaConf.update(config, "trainer.default_local_dir", str(tmp_path / "ckpt"))
    OmegaConf.update(config, "trainer.run_dir", str(tmp_path / "run"))
    trainer.global_steps, trainer.total_training_steps = 0, 5
    try:
        with pytest.raises(NonFiniteLossError) as info:
            trainer.fit()
    finally:
        OmegaConf.update(config, "algorithm.norm_adv_by_std_in_grpo", True)
        OmegaConf.update(config, "trainer.save_freq", -1)
    assert "Training Progress" not in capfd.readouterr().err  # trainer.progress_bar=false
    status, err = _exit_report(info.value, capfd)
    assert status == 1 and err.startswith("verl: training failed: NonFiniteLossError: stopping: the loss")
    assert "NaN or infinite in 2 steps in a row (steps 1-2" in str(info.value)
    assert "checkpoints in trainer.default_local_dir are untouched" in str(info.value)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for i, record in enumerate(records, start=1):
        assert record["data"]["actor/skipped_nonfinite_grad"] == 1.0
        assert record["data"]["training/nonfinite_steps_in_a_row"] == i
    assert tracker_step(tmp_path / "ckpt") == 1 and not (tmp_path / "ckpt" / "global_step_2").exists()


def test_prompt_longer_than_max_prompt_length_with_truncation_error_fails_at_start(setup, tmp_path):
    """Caught when the TaskRunner builds the dataset (it needs the tokenizer), before any worker starts."""
    from verl.trainer.config import load_ppo_config
    from verl.trainer.main_ppo import _report_failure, run_ppo

    rows = arith_rows(8)
    rows[5]["prompt"] = [{"role": "user", "content": "What is " + "1+" * 30 + "1?"}]
    data = write_rows(tmp_path / "long.parquet", rows)
    config = load_ppo_config(
        [*small_run(tmp_path), f"data.train_files={data}", f"data.val_files={data}"], config_name="arith_demo"
    )
    with pytest.raises(Exception) as info:
        run_ppo(config)
    assert _report_failure(info.value) == 2
    message = str(getattr(info.value, "cause", info.value))
    assert "1 prompts are longer than data.max_prompt_length=32 tokens" in message
    assert "long.parquet, row 5 with" in message and "data.truncation" in message
