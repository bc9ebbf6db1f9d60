"""The calculator task: rows, reference transcripts, and SFT data that matches the RL rollout token
for token (the warm-start teaches exactly the sequences the agent loop produces and trains on)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.config_helpers import rollout_config
from verl.utils.dataset.arith import load_rows
from verl.utils.dataset.arith_tool import TASK, tool_call_text, write_arith_tool_parquet
from verl.utils.reward_score import default_compute_score


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("arith_tool")
    train, test = write_arith_tool_parquet(str(out), num_train=40, num_test=10, seed=3)
    return load_rows(train), load_rows(test)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from verl.models import bundled_model_path

    return AutoTokenizer.from_pretrained(bundled_model_path())


def test_rows_have_the_rl_schema_and_a_transcript_with_the_true_answer(rows):
    train, test = rows
    assert len(train) == 40 and len(test) == 10
    assert not {r["extra_info"]["expression"] for r in train} & {r["extra_info"]["expression"] for r in test}
    assert TASK.steps == 2 and TASK.digits == 2
    for row in train + test:
        expression = row["extra_info"]["expression"]
        truth = row["reward_model"]["ground_truth"]
        assert str(eval(expression)) == truth  # Python's own precedence as the independent reference
        assert row["data_source"] == "arith_tool" and row["agent_name"] == "tool_agent"
        assert row["prompt"] == [{"role": "user", "content": f"What is {expression}?"}]
        assert [m["role"] for m in row["messages"]] == ["user", "assistant", "tool", "assistant"]
        assert row["messages"][1]["content"] == tool_call_text(expression)
        assert row["messages"][2]["content"] == row["messages"][3]["content"] == truth


def test_the_reference_conversation_scores_one_and_a_copied_wrong_answer_zero(rows):
    row = rows[0][0]
    truth, expression = row["reward_model"]["ground_truth"], row["extra_info"]["expression"]
    decoded = f"{tool_call_text(expression)}<tool_response>{truth}</tool_response>{truth}"  # special tokens skipped
    assert default_compute_score("arith_tool", decoded, truth) == 1.0
    wrong = f"{tool_call_text(expression)}<tool_response>{truth}</tool_response>{int(truth) + 1}"
    assert default_compute_score("arith_tool", wrong, truth) == 0.0
    assert default_compute_score("arith_tool", tool_call_text(truth), truth) == 0.0  # a call is not an answer


def test_sft_transcripts_are_the_tokens_and_masks_of_a_perfect_rollout(rows, tokenizer, tmp_path):
    from tests.experimental.agent_loop.conftest import ForcedRollout
    from tests.experimental.agent_loop.test_tool_agent_loop import assistant_turns
    from verl.experimental.agent_loop import AgentLoopRollout
    from verl.protocol import DataProto
    from verl.tools.calculator_tool import CalculatorTool
    from verl.utils.dataset.arith import _write_parquet_atomic
    from verl.utils.dataset.sft_dataset import SFTDataset

    row = rows[0][0]
    path = str(tmp_path / "one.parquet")
    _write_parquet_atomic([row], path)
    sft = SFTDataset(path, tokenizer, {"multiturn": {"enable": True}, "max_length": 192})[0]
    n = int(sft["attention_mask"].sum())
    sft_ids, sft_mask = sft["input_ids"][:n].tolist(), sft["loss_mask"][:n].tolist()

    eos = tokenizer.eos_token_id
    turns = [m["content"] for m in row["messages"] if m["role"] == "assistant"]

    def perfect(context):
        return tokenizer(turns[assistant_turns(tokenizer, context) - 1], add_special_tokens=False)["input_ids"] + [eos]

    prompt = tokenizer(
        tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )["input_ids"]
    raw = np.empty(1, dtype=object)
    raw[0] = row["prompt"]
    batch = DataProto.from_dict(
        tensors={
            "input_ids": torch.tensor([prompt]),
            "attention_mask": torch.ones(1, len(prompt), dtype=torch.long),
            "position_ids": torch.arange(len(prompt))[None],
        },
        non_tensors={"raw_prompt": raw},
        meta_info={"eos_token_id": eos, "pad_token_id": tokenizer.pad_token_id, "do_sample": False},
    )
    rollout = AgentLoopRollout(
        ForcedRollout(None, perfect, compute_logprobs=False),
        # rows without an agent_name run the default loop: here the tool-calling one
        rollout_config(response_length=160, agent={"default_agent_loop": "tool_agent"}),
        tokenizer,
        tools=[CalculatorTool()],
    )
    out = rollout.generate_sequences(batch)
    attended = out.batch["attention_mask"][0].bool()
    assert out.batch["input_ids"][0][attended].tolist() == sft_ids
    assert out.batch["response_mask"][0][attended[len(prompt) :]].tolist() == sft_mask[len(prompt) :]
    assert sft_mask[: len(prompt)] == [0] * len(prompt)
