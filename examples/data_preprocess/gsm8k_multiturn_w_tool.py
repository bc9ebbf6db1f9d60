"""Preprocess GSM8K for multi-turn rollouts with the ``calc_gsm8k_reward`` tool.

    python examples/data_preprocess/gsm8k_multiturn_w_tool.py --local_save_dir ~/data/gsm8k
    python examples/data_preprocess/gsm8k_multiturn_w_tool.py --local_dataset_path /path/to/gsm8k --local_save_dir ~/data/gsm8k

Reads GSM8K as ``gsm8k.py`` does (``--local_dataset_path``: a hub snapshot with ``main/train-*``,
``main/test-*``). Writes ``train.parquet``/``test.parquet`` with upstream's rows: data_source
"openai/gsm8k", prompt [system: solve step by step, call ``calc_gsm8k_reward`` before answering, answer
as "#### <answer>"; user: the question and "...after `####`."], ability "math", reward_model {style
"rule", ground_truth}, extra_info {split, index, answer, question, need_tools_kwargs: True,
tools_kwargs {calc_gsm8k_reward: {create_kwargs: {ground_truth}}}, interaction_kwargs {query,
ground_truth}}. Used with ``examples/sglang_multiturn/config/gsm8k_multiturn_grpo.yaml``.
"""

from __future__ import annotations

from _gsm8k_multiturn import base_row, run, tool_extra_info

# Own wording of upstream's prompt; the tool name and the "#### <answer>" format are what the code reads.
SYSTEM_PROMPT = (
    "You are a math expert. Solve the given question step by step, reasoning before any tool call. "
    "Once you have a solution, call the `calc_gsm8k_reward` tool at least once before giving the final answer, "
    "and refine the answer if necessary. "
    "Put your final answer in the format of `#### <answer>`."
)


def make_row(example: dict, split: str, index: int) -> dict:
    row, query, ground_truth = base_row(example, split, index, SYSTEM_PROMPT)
    row["extra_info"].update(tool_extra_info(query, ground_truth))
    return row


if __name__ == "__main__":
    run(make_row, __doc__)
