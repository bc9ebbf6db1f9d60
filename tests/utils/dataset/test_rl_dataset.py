import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf

from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn, create_rl_dataset


def _row(question, answer, index, split="train", source="arith"):
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index},
    }


def _write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def arith_file(tmp_path):
    rows = [_row(f"What is {a}+{b}?", str(a + b), i) for i, (a, b) in enumerate([(37, 48), (10, 5), (99, 99), (1, 2)])]
    return _write_parquet(tmp_path / "train.parquet", rows)


def _config(**overrides):
    base = {"max_prompt_length": 24, "filter_overlong_prompts": False, "truncation": "error"}
    base.update(overrides)
    return base


def test_item_is_a_left_padded_chat_prompt(arith_file, char_tokenizer):
    item = RLHFDataset(arith_file, char_tokenizer, _config())[0]
    text = "<bos><|user|>What is 37+48?<|assistant|>"
    # bos, <|user|>, 14 characters, <|assistant|>: 17 tokens, 7 pads in front
    expected_ids = char_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(expected_ids) == 17
    pad = char_tokenizer.pad_token_id
    assert item["input_ids"].tolist() == [pad] * 7 + expected_ids
    assert item["attention_mask"].tolist() == [0] * 7 + [1] * 17
    assert item["position_ids"].tolist() == [0] * 7 + list(range(17))
    assert item["raw_prompt_ids"] == expected_ids
    assert char_tokenizer.decode(item["input_ids"][7:]) == text
    assert item["input_ids"].dtype == torch.long and item["input_ids"].shape == (24,)


def test_other_columns_pass_through_and_index_comes_from_extra_info(tmp_path, char_tokenizer):
    row = _row("What is 1+2?", "3", index=41)
    row["my_column"] = {"a": [1, 2]}
    item = RLHFDataset(_write_parquet(tmp_path / "d.parquet", [row]), char_tokenizer, _config())[0]
    assert item["data_source"] == "arith"
    assert item["ability"] == "math"
    assert item["reward_model"] == {"style": "rule", "ground_truth": "3"}
    assert item["extra_info"] == {"split": "train", "index": 41}
    assert item["my_column"] == {"a": [1, 2]}
    assert item["index"] == 41
    assert "prompt" not in item and "raw_prompt" not in item


def test_return_raw_chat_and_full_prompt(arith_file, char_tokenizer):
    item = RLHFDataset(arith_file, char_tokenizer, _config(return_raw_chat=True, return_full_prompt=True))[1]
    assert item["raw_prompt"] == [{"role": "user", "content": "What is 10+5?"}]
    assert item["full_prompts"] == "<bos><|user|>What is 10+5?<|assistant|>"


def test_items_do_not_share_state_with_the_dataset(arith_file, char_tokenizer):
    dataset = RLHFDataset(arith_file, char_tokenizer, _config(return_raw_chat=True))
    dataset[0]["reward_model"]["ground_truth"] = "tampered"
    dataset[0]["raw_prompt"].clear()
    assert dataset[0]["reward_model"]["ground_truth"] == "85"
    assert len(dataset[0]["raw_prompt"]) == 1


def test_many_files_of_mixed_formats_are_concatenated_in_order(tmp_path, char_tokenizer):
    a = _write_parquet(tmp_path / "a.parquet", [_row("What is 1+1?", "2", 0)])
    b = _write_jsonl(tmp_path / "b.jsonl", [_row("What is 2+2?", "4", 1), _row("What is 3+3?", "6", 2)])
    c = tmp_path / "c.json"
    c.write_text(json.dumps([_row("What is 4+4?", "8", 3)]))
    dataset = RLHFDataset([a, b, str(c)], char_tokenizer, _config(return_raw_chat=True))
    assert len(dataset) == 4
    truths = [dataset[i]["reward_model"]["ground_truth"] for i in range(4)]
    assert truths == ["2", "4", "6", "8"]


def test_omegaconf_config_and_list_config_files(arith_file, char_tokenizer):
    config = OmegaConf.create(_config(apply_chat_template_kwargs={}))
    files = OmegaConf.create([arith_file])
    assert len(RLHFDataset(files, char_tokenizer, config)) == 4


def test_filter_overlong_prompts_drops_only_long_rows(tmp_path, char_tokenizer):
    rows = [_row("What is 1+2?", "3", 0), _row("x" * 50, "0", 1), _row("What is 2+2?", "4", 2)]
    dataset = RLHFDataset(
        _write_parquet(tmp_path / "d.parquet", rows), char_tokenizer, _config(filter_overlong_prompts=True)
    )
    assert [dataset[i]["index"] for i in range(len(dataset))] == [0, 2]


def test_filtering_every_row_is_a_clear_error(tmp_path, char_tokenizer):
    path = _write_parquet(tmp_path / "d.parquet", [_row("x" * 50, "0", 0)])
    with pytest.raises(ValueError, match="all 1 prompts are longer than data.max_prompt_length=24"):
        RLHFDataset(path, char_tokenizer, _config(filter_overlong_prompts=True))


def test_truncation_error_fails_at_construction_naming_file_and_row(tmp_path, char_tokenizer):
    rows = [_row("What is 1+2?", "3", 0), _row("x" * 50, "0", 1)]
    path = _write_parquet(tmp_path / "d.parquet", rows)
    with pytest.raises(ValueError, match=r"d.parquet, row 1 with 53 tokens.*filter_overlong_prompts"):
        RLHFDataset(path, char_tokenizer, _config())


@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_truncation_modes_keep_the_expected_tokens(tmp_path, char_tokenizer, mode):
    content = "abcdefghijklmnopqrstuvwxyz0123456789"
    path = _write_parquet(tmp_path / "d.parquet", [_row(content, "0", 0)])
    full = char_tokenizer(f"<bos><|user|>{content}<|assistant|>", add_special_tokens=False)["input_ids"]
    limit = 11
    expected = {"left": full[-limit:], "right": full[:limit], "middle": full[:5] + full[-6:]}[mode]
    item = RLHFDataset(path, char_tokenizer, _config(max_prompt_length=limit, truncation=mode))[0]
    assert item["input_ids"].tolist() == expected
    assert item["raw_prompt_ids"] == expected
    assert item["attention_mask"].tolist() == [1] * limit


def test_max_samples_keeps_first_rows_or_a_seeded_subset(tmp_path, char_tokenizer):
    rows = [_row(f"What is {i}+1?", str(i + 1), i) for i in range(20)]
    path = _write_parquet(tmp_path / "d.parquet", rows)
    first = RLHFDataset(path, char_tokenizer, _config(), max_samples=5)
    assert [first[i]["index"] for i in range(5)] == [0, 1, 2, 3, 4]
    picked = [
        [d[i]["index"] for i in range(len(d))]
        for d in (RLHFDataset(path, char_tokenizer, _config(shuffle=True, seed=s), max_samples=5) for s in (3, 3, 4))
    ]
    assert picked[0] == picked[1] and len(set(picked[0])) == 5
    assert picked[0] != picked[2]
    assert len(RLHFDataset(path, char_tokenizer, _config(max_samples=7))) == 7  # config key as fallback
    assert len(RLHFDataset(path, char_tokenizer, _config(), max_samples=100)) == 20


def test_create_rl_dataset_reads_upstream_max_samples_keys(arith_file, char_tokenizer):
    config = _config(train_max_samples=3, val_max_samples=2)
    assert len(create_rl_dataset(arith_file, config, char_tokenizer, is_train=True)) == 3
    assert len(create_rl_dataset(arith_file, config, char_tokenizer, is_train=False)) == 2


def test_create_rl_dataset_loads_a_custom_class(tmp_path, arith_file, char_tokenizer):
    module = tmp_path / "my_dataset.py"
    module.write_text(
        "from verl.utils.dataset.rl_dataset import RLHFDataset\n"
        "class Doubled(RLHFDataset):\n"
        "    def __len__(self):\n"
        "        return 2 * super().__len__()\n"
        "    def __getitem__(self, i):\n"
        "        return super().__getitem__(i % super().__len__())\n"
    )
    config = _config(custom_cls={"path": str(module), "name": "Doubled"})
    assert len(create_rl_dataset(arith_file, config, char_tokenizer)) == 8
    config["custom_cls"]["name"] = "Missing"
    with pytest.raises(AttributeError, match="Doubled"):
        create_rl_dataset(arith_file, config, char_tokenizer)


def test_tokenizer_without_pad_token_pads_with_eos(arith_file, make_tokenizer):
    tokenizer = make_tokenizer(with_pad=False)
    assert tokenizer.pad_token_id is None
    item = RLHFDataset(arith_file, tokenizer, _config())[0]
    assert item["input_ids"][:7].tolist() == [tokenizer.eos_token_id] * 7
    assert tokenizer.pad_token_id is None  # the tokenizer is not modified


def test_tokenizer_without_chat_template(arith_file, make_tokenizer):
    tokenizer = make_tokenizer(with_chat_template=False)
    with pytest.raises(ValueError, match="use_chat_template=False"):
        RLHFDataset(arith_file, tokenizer, _config())
    item = RLHFDataset(arith_file, tokenizer, _config(use_chat_template=False))[0]
    assert tokenizer.decode(item["raw_prompt_ids"]) == "What is 37+48?"


def test_missing_prompt_column_lists_the_columns(tmp_path, char_tokenizer):
    path = _write_parquet(tmp_path / "d.parquet", [{"question": "q", "answer": "a"}])
    with pytest.raises(ValueError, match=r"no column 'prompt'.*\['answer', 'question'\].*data.prompt_key"):
        RLHFDataset(path, char_tokenizer, _config())


def test_prompt_key_selects_another_column(tmp_path, char_tokenizer):
    path = _write_parquet(tmp_path / "d.parquet", [{"messages": [{"role": "user", "content": "hi"}]}])
    item = RLHFDataset(path, char_tokenizer, _config(prompt_key="messages"))[0]
    assert char_tokenizer.decode(item["raw_prompt_ids"]) == "<bos><|user|>hi<|assistant|>"


def test_empty_and_missing_files_are_clear_errors(tmp_path, char_tokenizer):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty.jsonl' has no rows"):
        RLHFDataset(str(empty), char_tokenizer, _config())
    empty_parquet = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], type=pa.list_(pa.struct([("role", pa.string())])))}), empty_parquet)
    with pytest.raises(ValueError, match="has no rows"):
        RLHFDataset(str(empty_parquet), char_tokenizer, _config())
    with pytest.raises(FileNotFoundError, match="nope.parquet.*data.train_files"):
        RLHFDataset(str(tmp_path / "nope.parquet"), char_tokenizer, _config())
    with pytest.raises(ValueError, match="unsupported format"):
        RLHFDataset(__file__, char_tokenizer, _config())


@pytest.mark.parametrize(
    "prompt, match",
    [
        ("What is 1+2?", "must be a non-empty list of chat messages"),
        ([], "must be a non-empty list"),
        ([{"role": "user"}], "string 'role' and 'content'"),
        (["What is 1+2?"], "string 'role' and 'content'"),
    ],
)
def test_wrong_prompt_types_name_the_file_and_row(tmp_path, char_tokenizer, prompt, match):
    path = tmp_path / "d.jsonl"
    rows = [_row("ok", "1", 0), {**_row("x", "1", 1), "prompt": prompt}]
    _write_jsonl(path, rows)
    with pytest.raises(TypeError, match=rf"d.jsonl, row 1: .*{match}"):
        RLHFDataset(str(path), char_tokenizer, _config())


def test_invalid_options_are_rejected(arith_file, char_tokenizer):
    with pytest.raises(ValueError, match="data.truncation='cut'"):
        RLHFDataset(arith_file, char_tokenizer, _config(truncation="cut"))
    with pytest.raises(NotImplementedError, match="Qwen2-VL family processors .*object is not one"):
        RLHFDataset(arith_file, char_tokenizer, _config(), processor=object())


def test_collate_stacks_tensors_and_makes_object_arrays(arith_file, char_tokenizer):
    dataset = RLHFDataset(arith_file, char_tokenizer, _config(return_raw_chat=True))
    batch = collate_fn([dataset[i] for i in range(3)])
    assert batch["input_ids"].shape == (3, 24)
    assert torch.equal(batch["attention_mask"][1], dataset[1]["attention_mask"])
    for key in ("raw_prompt_ids", "raw_prompt", "reward_model", "extra_info", "data_source", "index"):
        assert isinstance(batch[key], np.ndarray) and batch[key].dtype == object and batch[key].shape == (3,), key
    assert batch["raw_prompt_ids"][0] == dataset[0]["raw_prompt_ids"]
    assert batch["reward_model"][2]["ground_truth"] == "198"


def test_collate_keeps_equal_length_lists_as_one_object_per_item(arith_file, char_tokenizer):
    dataset = RLHFDataset(arith_file, char_tokenizer, _config())
    items = [dataset[0], dataset[2]]  # both prompts have 17 tokens
    assert len(items[0]["raw_prompt_ids"]) == len(items[1]["raw_prompt_ids"])
    batch = collate_fn(items)
    assert batch["raw_prompt_ids"].shape == (2,)
    assert batch["raw_prompt_ids"][1] == items[1]["raw_prompt_ids"]


def test_columns_missing_from_some_files_are_none_so_batches_stay_aligned(tmp_path, char_tokenizer):
    a = _write_parquet(tmp_path / "a.parquet", [{**_row("What is 1+1?", "2", 0), "difficulty": 3}])
    b = _write_jsonl(tmp_path / "b.jsonl", [_row("What is 2+2?", "4", 1)])
    dataset = RLHFDataset([a, b], char_tokenizer, _config())
    batch = collate_fn([dataset[0], dataset[1]])
    assert batch["difficulty"].tolist() == [3, None]
    assert all(len(value) == 2 for value in batch.values())


def test_collated_batch_builds_a_dataproto(arith_file, char_tokenizer):
    from verl.protocol import DataProto

    dataset = RLHFDataset(arith_file, char_tokenizer, _config(return_raw_chat=True))
    proto = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(4)]))
    assert len(proto) == 4
    assert set(proto.batch.keys()) == {"input_ids", "attention_mask", "position_ids"}
    assert {"raw_prompt_ids", "raw_prompt", "data_source", "reward_model", "extra_info", "index", "ability"} <= set(
        proto.non_tensor_batch
    )
    assert proto[3].non_tensor_batch["reward_model"]["ground_truth"] == "3"
