import math

import numpy as np
import pytest
import torch

from verl.protocol import DataProto
from verl.workers.reward_manager import NaiveRewardManager, RewardFunctionError


def test_score_sits_on_the_last_valid_response_token(char_tokenizer, make_batch):
    data = make_batch(["85<eos>", "84<eos>", "7", "-12<eos>"], ["85", "85", "7", "-12"], response_len=6)
    reward = NaiveRewardManager(char_tokenizer, num_examine=0)(data)
    expected = torch.zeros(4, 6)
    expected[0, 2] = 1.0  # "8", "5", "<eos>": 3 valid tokens
    expected[2, 0] = 1.0  # "7" without eos: 1 valid token
    expected[3, 3] = 1.0  # "-", "1", "2", "<eos>"
    assert torch.equal(reward, expected)
    assert reward.dtype == torch.float32


def test_decodes_valid_tokens_only_and_skips_special_tokens(char_tokenizer, make_batch):
    data = make_batch(["85<eos>"], ["85"], extra_infos=[{"index": 7}])
    data.batch["responses"][0, 3:] = char_tokenizer.convert_tokens_to_ids("9")  # masked-out garbage
    seen = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        seen.append((data_source, solution_str, ground_truth, extra_info))
        return 0.5

    reward = NaiveRewardManager(char_tokenizer, 0, compute_score=compute_score)(data)
    # upstream's naive manager adds the rollout's num_turns (None: not a multi-turn rollout) and reward scores
    assert seen == [("arith", "85", "85", {"index": 7, "num_turns": None, "rollout_reward_scores": {}})]
    assert reward[0, 2] == 0.5 and reward.sum() == 0.5


def test_multi_turn_num_turns_and_rollout_scores_reach_extra_info_per_manager(char_tokenizer, make_batch):
    """ReTool's compute_score reads extra_info["num_turns"], also for rows without an extra_info column
    (its AIME validation rows); upstream's rule: naive adds num_turns and rollout_reward_scores, batch and
    dapo only rollout_reward_scores, prime nothing. The batch's own extra_info dicts stay unchanged."""
    from verl.workers.reward_manager import BatchRewardManager, DAPORewardManager, PrimeRewardManager

    data = make_batch(["1<eos>", "2<eos>"], ["1", "2"], extra_infos=[{"index": 0}, {"index": 1}])
    data.non_tensor_batch["__num_turns__"] = np.array([2, 6], dtype=np.int64)
    data.non_tensor_batch["reward_scores"] = np.array([{"tool": 0.5}, {}], dtype=object)
    seen = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(extra_info)
        return float(extra_info.get("num_turns") or 0) if isinstance(extra_info, dict) else 0.0

    reward = NaiveRewardManager(char_tokenizer, 0, compute_score=compute_score)(data)
    assert seen == [
        {"index": 0, "num_turns": 2, "rollout_reward_scores": {"tool": 0.5}},
        {"index": 1, "num_turns": 6, "rollout_reward_scores": {}},
    ]
    assert type(seen[0]["num_turns"]) is int and reward.sum().item() == 8.0
    assert list(data.non_tensor_batch["extra_info"]) == [{"index": 0}, {"index": 1}]

    seen.clear()
    DAPORewardManager(char_tokenizer, 0, compute_score=compute_score)(data)
    assert seen == [{"index": 0, "rollout_reward_scores": {"tool": 0.5}}, {"index": 1, "rollout_reward_scores": {}}]

    def batch_score(data_sources, solution_strs, ground_truths, extra_infos):
        seen.extend(extra_infos)
        return [0.0] * len(extra_infos)

    seen.clear()
    BatchRewardManager(char_tokenizer, 0, compute_score=batch_score)(data)
    assert seen == [{"index": 0, "rollout_reward_scores": {"tool": 0.5}}, {"index": 1, "rollout_reward_scores": {}}]

    # rows without an extra_info column get a dict of the rollout's values (upstream's `.get("extra_info", {})`)
    del data.non_tensor_batch["extra_info"]
    seen.clear()
    NaiveRewardManager(char_tokenizer, 0, compute_score=compute_score)(data)
    assert seen == [
        {"num_turns": 2, "rollout_reward_scores": {"tool": 0.5}},
        {"num_turns": 6, "rollout_reward_scores": {}},
    ]
    assert PrimeRewardManager.ROLLOUT_EXTRA_INFO == ()


def test_dict_results_fill_reward_extra_info(char_tokenizer, make_batch):
    data = make_batch(["1<eos>", "2<eos>"], ["1", "1"])

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        out = {"score": float(solution_str == ground_truth), "pred": solution_str}
        if solution_str == "2":
            out["note"] = "wrong"
        return out

    result = NaiveRewardManager(char_tokenizer, 0, compute_score=compute_score)(data, return_dict=True)
    assert result["reward_tensor"][:, 1].tolist() == [1.0, 0.0]
    info = result["reward_extra_info"]
    assert info["score"] == [1.0, 0.0]
    assert info["pred"] == ["1", "2"]
    assert info["note"] == [None, "wrong"]
    assert info["reward_error"] == [0, 0]


def _raising(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "boom":
        raise ZeroDivisionError("division by zero")
    return 1.0


def test_a_raising_reward_function_fails_with_the_sample_details(char_tokenizer, make_batch):
    data = make_batch(["1<eos>", "boom<eos>"], ["1", "42"], data_sources=["arith", "my/source"])
    with pytest.raises(RewardFunctionError) as info:
        NaiveRewardManager(char_tokenizer, 0, compute_score=_raising)(data)
    message = str(info.value)
    for part in ("sample 1 of 2", "ZeroDivisionError", "'my/source'", "'42'", "'boom'", "on_error=zero"):
        assert part in message
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_on_error_zero_scores_failures_zero_and_counts_them(char_tokenizer, make_batch):
    data = make_batch(["1<eos>", "boom<eos>", "1<eos>"], ["1", "1", "1"])
    result = NaiveRewardManager(char_tokenizer, 0, compute_score=_raising, on_error="zero")(data, return_dict=True)
    assert result["reward_tensor"].sum(dim=1).tolist() == [1.0, 0.0, 1.0]
    assert result["reward_extra_info"]["reward_error"] == [0, 1, 0]


@pytest.mark.parametrize("bad", [math.nan, math.inf, None, "1.0", {"acc": 1.0}])
def test_non_finite_or_non_numeric_scores_are_errors(char_tokenizer, make_batch, bad):
    data = make_batch(["1<eos>"], ["1"])
    manager = NaiveRewardManager(char_tokenizer, 0, compute_score=lambda **kw: bad)
    with pytest.raises(RewardFunctionError, match="non-finite|not a number|without a 'score'"):
        manager(data)
    zero = NaiveRewardManager(char_tokenizer, 0, compute_score=lambda **kw: bad, on_error="zero")
    result = zero(data, return_dict=True)
    assert result["reward_tensor"].sum() == 0 and result["reward_extra_info"]["reward_error"] == [1]


def test_numpy_and_tensor_scalars_are_accepted(char_tokenizer, make_batch):
    data = make_batch(["1<eos>", "1<eos>"], ["1", "1"])
    values = iter([np.float32(0.25), torch.tensor(0.75)])
    reward = NaiveRewardManager(char_tokenizer, 0, compute_score=lambda **kw: next(values))(data)
    assert reward.sum(dim=1).tolist() == [0.25, 0.75]


def test_missing_columns_are_clear_errors(char_tokenizer, make_batch):
    data = make_batch(["1<eos>"], ["1"])
    data.non_tensor_batch.pop("data_source")
    with pytest.raises(KeyError, match="data_source.*data.reward_fn_key"):
        NaiveRewardManager(char_tokenizer, 0)(data)
    data = make_batch(["1<eos>"], ["1"])
    data.non_tensor_batch["reward_model"][0] = {"style": "rule"}
    with pytest.raises(ValueError, match="ground_truth"):
        NaiveRewardManager(char_tokenizer, 0)(data)


def test_reward_fn_key_selects_the_routing_column(char_tokenizer, make_batch):
    data = make_batch(["1<eos>"], ["1"], data_sources=["unknown"])
    data.non_tensor_batch["task"] = np.array(["arith"], dtype=object)
    assert NaiveRewardManager(char_tokenizer, 0, reward_fn_key="task")(data).sum() == 1.0


def test_empty_response_gets_no_reward(char_tokenizer, make_batch):
    data = make_batch(["", "1<eos>"], ["1", "1"])
    reward = NaiveRewardManager(char_tokenizer, 0, compute_score=lambda **kw: 1.0)(data)
    assert reward[0].abs().sum() == 0 and reward[1, 1] == 1.0


def test_existing_rm_scores_are_returned_unchanged(char_tokenizer, make_batch):
    data = make_batch(["1<eos>"], ["1"])
    data.batch["rm_scores"] = torch.full((1, 8), 0.3)
    out = NaiveRewardManager(char_tokenizer, 0)(data, return_dict=True)
    assert torch.equal(out["reward_tensor"], data.batch["rm_scores"])


def test_num_examine_prints_per_data_source(char_tokenizer, make_batch, capsys):
    data = make_batch(["1<eos>", "2<eos>", "3<eos>"], ["1", "2", "3"], data_sources=["arith", "arith", "other"])
    NaiveRewardManager(char_tokenizer, 1, compute_score=lambda **kw: 1.0)(data)
    out = capsys.readouterr().out
    assert out.count("[response]") == 2 and "[prompt] Q?" in out and "[ground_truth] 3" in out


def test_unknown_on_error_is_rejected(char_tokenizer):
    with pytest.raises(ValueError, match="on_error='ignore'"):
        NaiveRewardManager(char_tokenizer, 0, on_error="ignore")


def test_dataset_to_reward_end_to_end(tmp_path, char_tokenizer):
    """Parquet rows -> RLHFDataset -> collate_fn -> DataProto -> rollout-shaped batch -> naive rewards."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    rows = [
        {
            "data_source": src,
            "prompt": [{"role": "user", "content": q}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": gt},
            "extra_info": {"split": "train", "index": i},
        }
        for i, (src, q, gt) in enumerate(
            [("arith", "What is 37+48?", "85"), ("openai/gsm8k", "How many?", "72"), ("arith", "What is 1+2?", "3")]
        )
    ]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    dataset = RLHFDataset(str(path), char_tokenizer, {"max_prompt_length": 32})
    batch = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(3)]))

    responses = ["85<eos>", "so #### 72<eos>", "4<eos>"]
    response_ids = torch.full((3, 12), char_tokenizer.pad_token_id)
    response_mask = torch.zeros((3, 12), dtype=torch.long)
    for i, text in enumerate(responses):
        ids = char_tokenizer(text, add_special_tokens=False)["input_ids"]
        response_ids[i, : len(ids)] = torch.tensor(ids)
        response_mask[i, : len(ids)] = 1
    rollout = DataProto.from_dict(
        tensors={
            "prompts": batch.batch["input_ids"],
            "responses": response_ids,
            "attention_mask": torch.cat([batch.batch["attention_mask"], response_mask], dim=1),
        }
    )
    batch.pop(
        batch_keys=["input_ids", "attention_mask", "position_ids"]
    )  # the rollout's full-sequence tensors replace them
    full = batch.union(rollout)
    reward = NaiveRewardManager(char_tokenizer, 0)(full)
    assert reward.sum(dim=1).tolist() == [1.0, 1.0, 0.0]
    assert reward[1, len("so #### 72")] == 1.0  # the <eos> position


def test_async_reward_functions_are_awaited_together_and_their_errors_are_per_sample(char_tokenizer, make_batch):
    # verl-recipe FAPO's compute_score_baseline is `async def` and returns a dict; DAPO's manager runs it
    import asyncio

    from verl.workers.reward_manager import DAPORewardManager

    started = []

    async def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        started.append(solution_str)
        for _ in range(100):  # every sample starts before any finishes: the coroutines run concurrently
            if len(started) == 3:
                break
            await asyncio.sleep(0.001)
        if solution_str == "boom":
            raise ZeroDivisionError("division by zero")
        return {"score": 1.0 if solution_str == ground_truth else -1.0, "concurrent": len(started) == 3}

    data = make_batch(["1<eos>", "2<eos>", "boom<eos>"], ["1", "1", "1"])
    manager = DAPORewardManager(char_tokenizer, 0, compute_score=compute_score, on_error="zero")
    result = manager(data, return_dict=True)
    assert result["reward_tensor"].sum(dim=1).tolist() == [1.0, -1.0, 0.0]
    assert result["reward_extra_info"]["concurrent"] == [True, True, None]
    assert result["reward_extra_info"]["reward_error"] == [0, 0, 1]

    async def called_from_a_running_loop():
        started.clear()
        return manager(data, return_dict=True)

    assert asyncio.run(called_from_a_running_loop())["reward_tensor"].sum(dim=1).tolist() == [1.0, -1.0, 0.0]
    with pytest.raises(RewardFunctionError, match="ZeroDivisionError"):
        DAPORewardManager(char_tokenizer, 0, compute_score=compute_score)(data)
