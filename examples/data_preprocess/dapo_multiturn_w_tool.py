"""Preprocess DAPO-Math-17k for ReTool-style multi-turn rollouts with the ``code_interpreter`` tool.

    python examples/data_preprocess/dapo_multiturn_w_tool.py --local_save_dir ~/data/retool_dapo
    python examples/data_preprocess/dapo_multiturn_w_tool.py --local_dataset_path /path/to/DAPO-Math-17k

The raw rows (BytedTsinghua-SIA/DAPO-Math-17k, config "default": one "train" split, a hub snapshot holds
``data/dapo-math-17k.parquet``) are already in verl's RL schema (data_source, prompt, ability,
reward_model {ground_truth, style}, extra_info). Each is kept as it is, with two keys added to
extra_info: need_tools_kwargs True and tools_kwargs {code_interpreter: {create_kwargs: {ground_truth}}}.
Writes ``train.parquet`` only, as upstream. ``aime2024_multiturn_w_tool.py`` does the same for AIME 2024.
"""

from __future__ import annotations

import argparse

from verl.utils.dataset import preprocess
from verl.utils.dataset.preprocess import require_columns

TOOL_NAME = "code_interpreter"  # the tool's name in tool_config/sandbox_fusion_tool_config.yaml


def make_row(example: dict, split: str, index: int, source: str) -> dict:
    where = f"{split} example {index} of {source}"
    require_columns(example, ("reward_model", "extra_info"), where)
    reward_model = example["reward_model"]
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise KeyError(f"{where}: reward_model {reward_model!r} has no ground_truth; the code tool is created with it")
    extra_info = dict(example["extra_info"] or {})
    extra_info["need_tools_kwargs"] = True
    extra_info["tools_kwargs"] = {TOOL_NAME: {"create_kwargs": {"ground_truth": reward_model["ground_truth"]}}}
    return {**example, "extra_info": extra_info}


def run(source: str, default_save_dir: str, description: str, argv=None) -> None:
    """The whole script for one of the ReTool datasets (the "train" split of the hub dataset ``source``)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    preprocess.add_io_args(parser, default_save_dir=default_save_dir)
    args = parser.parse_args(argv)
    raw = preprocess.load_split("train", args.local_dataset_path, source, "default")
    rows = {"train": [make_row(ex, "train", i, source) for i, ex in enumerate(raw)]}
    preprocess.write_splits(rows, preprocess.save_dir(args), args.hdfs_dir)


if __name__ == "__main__":
    run("BytedTsinghua-SIA/DAPO-Math-17k", "~/data/retool_dapo", __doc__)
