"""SFTDataset: loss masks checked token by token by hand, layouts, truncation and data errors."""

from __future__ import annotations

import pandas as pd
import pytest

from verl.models.tokenizer import build_char_tokenizer
from verl.utils.dataset.sft_dataset import SFTDataset


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def _write(tmp_path, rows, name="data.parquet"):
    path = str(tmp_path / name)
    pd.DataFrame(rows).to_parquet(path)
    return path


def _tokens(tokenizer, item, mask_key):
    ids = item["input_ids"][item[mask_key].bool()].tolist()
    return tokenizer.convert_ids_to_tokens(ids)


def test_single_turn_loss_mask_covers_exactly_the_response_and_eos(tmp_path, tokenizer):
    path = _write(tmp_path, [{"question": "What is 37+48?", "answer": "85"}])
    item = SFTDataset(path, tokenizer, {"prompt_key": "question", "response_key": "answer", "max_length": 24})[0]
    # By hand: <bos> <|user|> + 14 characters + <|assistant|> = 17 prompt tokens, then 8 5 <eos>.
    expected_tokens = ["<bos>", "<|user|>", *"What is 37+48?", "<|assistant|>", "8", "5", "<eos>"]
    assert _tokens(tokenizer, item, "attention_mask") == [t.replace(" ", "Ġ") for t in expected_tokens]
    assert item["loss_mask"].tolist() == [0] * 17 + [1, 1, 1] + [0] * 4
    assert item["attention_mask"].tolist() == [1] * 20 + [0] * 4
    assert item["input_ids"][20:].tolist() == [tokenizer.pad_token_id] * 4
    assert item["position_ids"].tolist() == list(range(20)) + [19] * 4


def test_rl_parquet_prompt_messages_and_nested_response_key_work_unchanged(tmp_path, tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "What is 1+2?"}], "extra_info": {"answer": "3", "index": 0}}]
    item = SFTDataset(_write(tmp_path, rows), tokenizer, {"prompt_key": "prompt", "response_key": "extra_info.answer"})[
        0
    ]
    assert _tokens(tokenizer, item, "loss_mask") == ["3", "<eos>"]
    assert len(item["input_ids"]) == 1024  # default max_length


def test_upstream_dict_keys_descend_into_struct_columns(tmp_path, tokenizer):
    rows = [{"extra_info": {"question": "What is 1+2?", "answer": "3"}}]
    config = {
        "prompt_key": "extra_info",
        "prompt_dict_keys": ["question"],
        "response_key": "extra_info",
        "response_dict_keys": ["answer"],
        "max_length": 32,
    }
    item = SFTDataset(_write(tmp_path, rows), tokenizer, config)[0]
    assert _tokens(tokenizer, item, "loss_mask") == ["3", "<eos>"]


def test_multi_turn_loss_mask_covers_only_assistant_turns(tmp_path, tokenizer):
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "1+1"},
        {"role": "assistant", "content": "2"},
    ]
    path = _write(tmp_path, [{"messages": messages}])
    item = SFTDataset(path, tokenizer, {"multiturn": {"enable": True}, "max_length": 20})[0]
    expected = ["<bos>", "<|system|>", "S", "<|user|>", "h", "i", "<|assistant|>", "y", "o", "<eos>"]
    expected += ["<|user|>", "1", "+", "1", "<|assistant|>", "2", "<eos>"]
    assert _tokens(tokenizer, item, "attention_mask") == expected
    assert item["loss_mask"].tolist()[:17] == [0] * 7 + [1, 1, 1] + [0] * 5 + [1, 1]
    assert item["loss_mask"].tolist()[17:] == [0, 0, 0]


def test_missing_column_error_names_the_key_and_lists_the_columns(tmp_path, tokenizer):
    path = _write(tmp_path, [{"prompt": "a", "response": "b"}])
    with pytest.raises(ValueError, match=r"data.prompt_key='question'.*columns: \['prompt', 'response'\]"):
        SFTDataset(path, tokenizer, {"prompt_key": "question", "response_key": "response"})


def test_missing_nested_key_error_shows_the_keys_that_exist(tmp_path, tokenizer):
    path = _write(tmp_path, [{"prompt": "a", "extra_info": {"answer": "1"}}])
    with pytest.raises(ValueError, match=r"'extra_info' is a dict with keys \['answer'\], which has no 'solution'"):
        SFTDataset(path, tokenizer, {"prompt_key": "prompt", "response_key": "extra_info.solution"})


def test_empty_file_is_rejected_with_its_path(tmp_path, tokenizer):
    path = _write(tmp_path, {"prompt": pd.Series([], dtype=str), "response": pd.Series([], dtype=str)})
    with pytest.raises(ValueError, match=r"data.parquet has no rows"):
        SFTDataset(path, tokenizer, {})


def test_nonexistent_file_is_rejected(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SFTDataset(str(tmp_path / "nope.parquet"), tokenizer, {})


def test_non_text_response_is_a_type_error_with_the_row(tmp_path, tokenizer):
    path = _write(tmp_path, [{"prompt": "a", "response": "1"}, {"prompt": "b", "response": None}])
    with pytest.raises(TypeError, match=r"row 1 .*holds a value of type NoneType"):
        SFTDataset(path, tokenizer, {})
    path = _write(tmp_path, [{"prompt": "a", "answer": 85}], name="ints.parquet")
    with pytest.raises(TypeError, match=r"holds a value of type int \(85\).*convert that column to strings"):
        SFTDataset(path, tokenizer, {"response_key": "answer"})


def test_malformed_messages_are_type_errors(tmp_path, tokenizer):
    path = _write(tmp_path, [{"messages": [{"role": "robot", "content": "x"}]}])
    with pytest.raises(TypeError, match=r"message 0 .*'role' in \['system', 'user', 'assistant', 'tool'\]"):
        SFTDataset(path, tokenizer, {"multiturn": {"enable": True}})


def test_conversation_without_assistant_turn_is_rejected(tmp_path, tokenizer):
    path = _write(tmp_path, [{"messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(ValueError, match="no assistant message"):
        SFTDataset(path, tokenizer, {"multiturn": {"enable": True}})


def test_truncation_error_left_and_right(tmp_path, tokenizer):
    path = _write(tmp_path, [{"prompt": "What is 37+48?", "response": "85"}])  # 20 tokens
    with pytest.raises(ValueError, match="20 tokens, more than data.max_length=8"):
        SFTDataset(path, tokenizer, {"max_length": 8})[0]
    left = SFTDataset(path, tokenizer, {"max_length": 8, "truncation": "left"})[0]
    assert _tokens(tokenizer, left, "attention_mask") == ["+", "4", "8", "?", "<|assistant|>", "8", "5", "<eos>"]
    assert left["loss_mask"].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    right = SFTDataset(path, tokenizer, {"max_length": 8, "truncation": "right"})[0]
    assert _tokens(tokenizer, right, "attention_mask")[:3] == ["<bos>", "<|user|>", "W"]
    assert right["loss_mask"].sum() == 0


def test_unknown_truncation_mode_lists_the_valid_ones(tmp_path, tokenizer):
    path = _write(tmp_path, [{"prompt": "a", "response": "b"}])
    with pytest.raises(ValueError, match=r"\['error', 'left', 'right'\]"):
        SFTDataset(path, tokenizer, {"truncation": "middle"})


def test_several_files_are_concatenated(tmp_path, tokenizer):
    a = _write(tmp_path, [{"prompt": "a", "response": "1"}], name="a.parquet")
    b = _write(tmp_path, [{"prompt": "b", "response": "2"}, {"prompt": "c", "response": "3"}], name="b.parquet")
    dataset = SFTDataset([a, b], tokenizer, {"max_length": 16})
    assert len(dataset) == 3
    assert _tokens(tokenizer, dataset[2], "loss_mask") == ["3", "<eos>"]
