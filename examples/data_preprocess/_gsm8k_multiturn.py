"""Shared body of the GSM8K multi-turn preprocessing scripts (tool, interaction, tool agent loop).

The three scripts differ only in the system prompt and in the keys of ``extra_info`` that the rollout
reads: ``tools_kwargs`` (the ``calc_gsm8k_reward`` tool's ``create_kwargs``), ``interaction_kwargs``
(the ``gsm8k`` interaction's query and ground truth) and the row's ``agent_name``. Raw rows are parsed by
``gsm8k.py`` (the same splits, columns and "#### <number>" ground truth).
"""

from __future__ import annotations

from gsm8k import DATA_SOURCE, SPLITS, load_split, read_example

from verl.utils.dataset import preprocess

# Multi-turn GSM8K quotes the marker with backticks (the single-turn script uses double quotes), as upstream.
INSTRUCTION = "Let's think step by step and output the final answer after `####`."
TOOL_NAME = "calc_gsm8k_reward"  # the tool's name in tool_config/gsm8k_tool_config.yaml


def base_row(example: dict, split: str, index: int, system_prompt: str) -> tuple[dict, str, str]:
    """The row common to all variants, with the user's query and the ground truth for the variant's extras."""
    question, answer, ground_truth = read_example(example, split, index)
    query = f"{question} {INSTRUCTION}"
    row = {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "system", "content": system_prompt}, {"role": "user", "content": query}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }
    return row, query, ground_truth


def tool_extra_info(query: str, ground_truth: str) -> dict:
    """extra_info of the tool variants: the tool is created with the ground truth of its row."""
    return {
        "need_tools_kwargs": True,
        "tools_kwargs": {TOOL_NAME: {"create_kwargs": {"ground_truth": ground_truth}}},
        "interaction_kwargs": {"query": query, "ground_truth": ground_truth},
    }


def run(make_row, description: str, argv=None) -> None:
    """Parse upstream's flags, convert both splits with ``make_row(example, split, index)`` and write them."""
    preprocess.convert_splits(description, "~/data/gsm8k", make_row, load_split, SPLITS, argv)
