"""RLHFDataset's upstream subclass hooks: `_read_files_and_tokenize` setting `self.dataframe` (a
`datasets.Dataset` built the way verl-recipe's ReTool builds one, or a list of rows), and
`maybe_filter_out_long_prompts`. The expected items are written out from the rows by hand."""

from __future__ import annotations

import datasets  # a test dependency (setup.py's `test` extra), as recipes that build HF datasets need it
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl.utils.dataset.rl_dataset import RLHFDataset, create_rl_dataset

SUFFIX = "\nBox the answer."

# ReTool's dataset class, in the recipe's own style: HF datasets read from parquet directories, AIME rows
# mapped to the verl schema with their columns removed, the training rows edited in place, concatenated.
RETOOL_STYLE = """
import datasets
from verl.utils.dataset import RLHFDataset

SUFFIX = "\\nBox the answer."


class AimeDataset(RLHFDataset):
    def _read_files_and_tokenize(self):
        frames = []
        for parquet_dir in self.data_files:
            cache_dir = parquet_dir.rsplit("/", 2)[0] + "/.hf_cache"  # beside the data, not in it
            frame = datasets.load_dataset(parquet_dir, cache_dir=cache_dir)["train"]
            source = "/".join(parquet_dir.split("/")[-2:])
            if source == "Maxwell-Jia/AIME_2024":
                frame = frame.map(self.map_aime, remove_columns=frame.column_names)
            else:
                frame = frame.map(self.map_train)
            frames.append(frame)
        self.dataframe = datasets.concatenate_datasets(frames)

    def map_aime(self, row):
        return {
            "data_source": "aime_2024",
            "prompt": [{"role": "user", "content": row["Problem"] + SUFFIX}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(row["Answer"])},
            "agent_name": "tool_agent",
        }

    def map_train(self, row):
        row["prompt"][0]["content"] = row["prompt"][0]["content"] + SUFFIX
        row["agent_name"] = "tool_agent"
        return row
"""


@pytest.fixture
def retool_layout(tmp_path):
    """A DAPO-Math-17k-like training directory and a Maxwell-Jia/AIME_2024-like one, and the class module."""
    train_dir = tmp_path / "BytedTsinghua-SIA" / "DAPO-Math-17k"
    aime_dir = tmp_path / "Maxwell-Jia" / "AIME_2024"
    train_dir.mkdir(parents=True)
    aime_dir.mkdir(parents=True)
    train_rows = [
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": f"What is {i}+{i}?"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(2 * i), "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": f"dapo-{i}"},
        }
        for i in range(3)
    ]
    pq.write_table(pa.Table.from_pylist(train_rows), train_dir / "train.parquet")
    aime_rows = [
        {"ID": "2024-I-1", "Problem": "Find 2+3.", "Answer": 5},
        {"ID": "2024-I-2", "Problem": "x" * 80, "Answer": 7},  # longer than max_prompt_length
        {"ID": "2024-I-3", "Problem": "Find 4*4.", "Answer": 16},
    ]
    pq.write_table(pa.Table.from_pylist(aime_rows), aime_dir / "aime_2024_problems.parquet")
    module = tmp_path / "retool_style.py"
    module.write_text(RETOOL_STYLE)
    return str(train_dir), str(aime_dir), str(module)


def config(**overrides):
    return {"max_prompt_length": 48, "filter_overlong_prompts": True, "truncation": "error", **overrides}


def test_a_subclass_building_a_hf_dataset_serves_its_rows_filtered(retool_layout, char_tokenizer):
    train_dir, aime_dir, module = retool_layout
    data_config = config(custom_cls={"path": module, "name": "AimeDataset"}, return_raw_chat=True)
    dataset = create_rl_dataset([train_dir, aime_dir], data_config, char_tokenizer, is_train=False)
    assert type(dataset).__name__ == "AimeDataset" and dataset.data_files == [train_dir, aime_dir]
    items = [dataset[i] for i in range(len(dataset))]
    # the 80-character AIME problem (93 tokens with the template) is dropped: filter_overlong_prompts
    assert [item["raw_prompt"][0]["content"] for item in items] == [
        "What is 0+0?" + SUFFIX,
        "What is 1+1?" + SUFFIX,
        "What is 2+2?" + SUFFIX,
        "Find 2+3." + SUFFIX,
        "Find 4*4." + SUFFIX,
    ]
    assert [item["reward_model"]["ground_truth"] for item in items] == ["0", "2", "4", "5", "16"]
    assert [item["data_source"] for item in items] == ["math_dapo"] * 3 + ["aime_2024"] * 2
    assert {item["agent_name"] for item in items} == {"tool_agent"}
    # index: extra_info.index where the row has one, else the item's position (the AIME rows have none)
    assert [item["index"] for item in items] == ["dapo-0", "dapo-1", "dapo-2", 3, 4]
    expected = char_tokenizer(f"<bos><|user|>Find 2+3.{SUFFIX}<|assistant|>", add_special_tokens=False)["input_ids"]
    assert items[3]["raw_prompt_ids"] == expected
    # afterwards self.dataframe is the Dataset of the rows kept, row i being item i's (upstream's __getitem__)
    assert isinstance(dataset.dataframe, datasets.Dataset) and len(dataset.dataframe) == 5
    assert dataset.dataframe[3]["prompt"][0]["content"] == "Find 2+3." + SUFFIX


def test_max_samples_and_the_overlong_check_apply_to_a_subclass_rows(retool_layout, char_tokenizer):
    train_dir, aime_dir, module = retool_layout
    data_config = config(custom_cls={"path": module, "name": "AimeDataset"}, val_max_samples=4)
    dataset = create_rl_dataset([train_dir, aime_dir], data_config, char_tokenizer, is_train=False)
    assert [dataset[i]["reward_model"]["ground_truth"] for i in range(len(dataset))] == ["0", "2", "4", "5"]
    strict = config(custom_cls={"path": module, "name": "AimeDataset"}, filter_overlong_prompts=False)
    with pytest.raises(ValueError, match=r"AimeDataset.dataframe \(set by _read_files_and_tokenize\), row 4"):
        create_rl_dataset([train_dir, aime_dir], strict, char_tokenizer)


class ListRows(RLHFDataset):
    """Reads nothing: its rows are a list of dicts."""

    def _read_files_and_tokenize(self):
        self.dataframe = [
            {"prompt": [{"role": "user", "content": "short"}], "reward_model": {"ground_truth": "1"}},
            {"prompt": [{"role": "user", "content": "y" * 60}], "reward_model": {"ground_truth": "2"}},
            {"prompt": [{"role": "user", "content": "also short"}], "reward_model": {"ground_truth": "3"}, "tag": "x"},
        ]
        self.dataframe = self.maybe_filter_out_long_prompts(self.dataframe)


def test_a_subclass_may_set_a_list_and_call_the_filter_hook_itself(char_tokenizer):
    dataset = ListRows(["unused.parquet"], char_tokenizer, config())
    assert [dataset[i]["reward_model"]["ground_truth"] for i in range(len(dataset))] == ["1", "3"]
    assert [dataset[i]["tag"] for i in range(len(dataset))] == [None, "x"]  # columns aligned across rows
    assert dataset.dataframe is dataset.rows
    off = ListRows(["unused.parquet"], char_tokenizer, config(filter_overlong_prompts=False, truncation="left"))
    assert len(off) == 3  # the hook returns the rows unchanged when filtering is off


def test_maybe_filter_out_long_prompts_on_a_hf_dataset(char_tokenizer):
    dataset = ListRows(["unused.parquet"], char_tokenizer, config())
    frame = datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": text}]} for text in ("a", "z" * 60, "b")]
    )
    kept = dataset.maybe_filter_out_long_prompts(frame)
    assert isinstance(kept, datasets.Dataset) and [r["prompt"][0]["content"] for r in kept] == ["a", "b"]


class Unset(RLHFDataset):
    def _read_files_and_tokenize(self):
        pass


class WrongType(RLHFDataset):
    def _read_files_and_tokenize(self):
        self.dataframe = "rows.parquet"


def test_a_hook_that_sets_no_rows_or_the_wrong_type_is_a_clear_error(char_tokenizer):
    with pytest.raises(ValueError, match=r"Unset._read_files_and_tokenize\(\) left self.dataframe unset"):
        Unset(["unused.parquet"], char_tokenizer, config())
    with pytest.raises(TypeError, match="is a str; it must be a datasets.Dataset or a list of row dicts"):
        WrongType(["unused.parquet"], char_tokenizer, config())
