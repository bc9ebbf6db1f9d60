"""Preprocess Geometry3K for multi-turn rollouts with the ``calc_geo3k_reward`` tool.

    python examples/data_preprocess/geo3k_multiturn_w_tool.py --local_save_dir ~/data/geo3k_multiturn_w_tool
    python examples/data_preprocess/geo3k_multiturn_w_tool.py --local_dataset_path /path/to/geometry3k

Reads Geometry3K as ``geo3k.py`` does (hub snapshot ``data/train-*``, ``data/test-*``, or a save_to_disk
folder). Writes upstream's rows: the rows of ``geo3k.py`` (data_source "hiyouga/geometry3k", images,
ability "math", reward_model {style "rule", ground_truth: the answer}) with a system message (solve
step by step, call ``calc_geo3k_reward`` before the final answer) before the user message, and
extra_info {split, index, answer, question, need_tools_kwargs: True, tools_kwargs {calc_geo3k_reward:
{create_kwargs: {ground_truth}}}}. Used with ``examples/sglang_multiturn/config/geo3k_multiturn_grpo.yaml``.
"""

from __future__ import annotations

from geo3k import SPLITS, load_split
from geo3k import make_row as single_turn_row

from verl.utils.dataset import preprocess

TOOL_NAME = "calc_geo3k_reward"  # the tool's name in tool_config/geo3k_tool_config.yaml
SYSTEM_PROMPT = (
    "You are a math expert. Solve the given question step by step, reasoning before any tool call. "
    "Once you have a solution, call the `calc_geo3k_reward` tool at least once before giving the final answer, "
    "and refine the answer if necessary. "
)


def make_row(example: dict, split: str, index: int) -> dict:
    row = single_turn_row(example, split, index)
    row["prompt"] = [{"role": "system", "content": SYSTEM_PROMPT}, *row["prompt"]]
    ground_truth = row["reward_model"]["ground_truth"]
    row["extra_info"]["need_tools_kwargs"] = True
    row["extra_info"]["tools_kwargs"] = {TOOL_NAME: {"create_kwargs": {"ground_truth": ground_truth}}}
    return row


def main(argv=None) -> None:
    preprocess.convert_splits(__doc__, "~/data/geo3k_multiturn_w_tool", make_row, load_split, SPLITS, argv)


if __name__ == "__main__":
    main()
