"""Preprocess the Search-R1 training data (NQ + HotpotQA) for multi-turn rollouts with the ``search`` tool.

    python examples/data_preprocess/preprocess_search_r1_dataset.py --local_dir ~/data/searchR1_processed_direct
    python examples/data_preprocess/preprocess_search_r1_dataset.py --local_dataset_path /path/to/nq_hotpotqa_train

The raw data is the hub dataset ``--hf_repo_id`` (default PeterJinGo/nq_hotpotqa_train): ``train.parquet``
and ``test.parquet`` with columns question, golden_answers, data_source ("nq", "hotpotqa", ...), ability,
reward_model ({style, ground_truth: {target: [answers]}}) and metadata. ``--local_dataset_path`` is a folder
with those files (a hub snapshot); without it ``datasets.load_dataset(--hf_repo_id)`` downloads them.

Writes ``train.parquet``/``test.parquet`` with upstream's rows: data_source "searchR1_<source>" (scored by
``verl.utils.reward_score.search_r1_like_qa_em``), prompt [system: a helpful assistant; user: the
instructions (reason in <think></think>, search with <tool_call> query </tool_call>, results come back in
<tool_response></tool_response>, answer in <answer></answer>) followed by the question], ability,
reward_model and metadata unchanged, extra_info {index, need_tools_kwargs: True, question, split,
tools_kwargs {search: {create_kwargs: {ground_truth, question, data_source}}}}. The tool's ground truth is
reward_model.ground_truth, or golden_answers where the row has no reward_model.
"""

from __future__ import annotations

import argparse

from verl.utils.dataset import preprocess
from verl.utils.dataset.preprocess import require_columns

DEFAULT_REPO_ID = "PeterJinGo/nq_hotpotqa_train"
SPLITS = ("train", "test")
TOOL_NAME = "search"  # the tool's name in tool_config/search_tool_config.yaml
DATA_SOURCE_PREFIX = "searchR1_"  # routes the rows to the Search-R1 exact-match scorer
SYSTEM_CONTENT = "You are a helpful and harmless assistant."
# The tags are what the tool parser and the scorer read; the rest is prose of our own.
USER_CONTENT_PREFIX = (
    "Answer the given question. Every time you get new information, first reason about it inside <think> "
    "and </think>. If, after reasoning, you find that you lack some knowledge, you can call a search engine "
    "with <tool_call> query </tool_call>, and the top search results will be returned between <tool_response> "
    "and </tool_response>. You may search as many times as you want. When no further external knowledge is "
    "needed, give the answer directly inside <answer> and </answer>, without a detailed explanation, "
    "for example <answer> Beijing </answer>. Question: "
)


def make_row(example: dict, split: str, index: int) -> dict:
    require_columns(example, ("question", "data_source"), f"{split} example {index} of the Search-R1 data")
    question = example["question"]
    reward_model = example.get("reward_model")
    if isinstance(reward_model, dict) and "ground_truth" in reward_model:
        ground_truth = reward_model["ground_truth"]
    elif "golden_answers" in example:
        ground_truth = example["golden_answers"]
    else:
        raise KeyError(
            f"{split} example {index} of the Search-R1 data has neither reward_model.ground_truth nor "
            f"golden_answers (it has {sorted(example)}); the search tool needs the gold answers"
        )
    data_source = DATA_SOURCE_PREFIX + str(example["data_source"])
    return {
        "data_source": data_source,
        "prompt": [
            {"role": "system", "content": SYSTEM_CONTENT},
            {"role": "user", "content": USER_CONTENT_PREFIX + question},
        ],
        "ability": example.get("ability"),
        "reward_model": reward_model,
        "extra_info": {
            "index": index,
            "need_tools_kwargs": True,
            "question": question,
            "split": split,
            "tools_kwargs": {
                TOOL_NAME: {
                    "create_kwargs": {"ground_truth": ground_truth, "question": question, "data_source": data_source}
                }
            },
        },
        "metadata": example.get("metadata"),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf_repo_id", default=DEFAULT_REPO_ID, help="the raw dataset's Hugging Face repository")
    preprocess.add_io_args(parser, default_save_dir="~/data/searchR1_processed_direct", local_dir_deprecated=False)
    args = parser.parse_args(argv)
    rows = {
        split: [
            make_row(ex, split, i)
            for i, ex in enumerate(preprocess.load_split(split, args.local_dataset_path, args.hf_repo_id))
        ]
        for split in SPLITS
    }
    preprocess.write_splits(rows, preprocess.save_dir(args), args.hdfs_dir)


if __name__ == "__main__":
    main()
