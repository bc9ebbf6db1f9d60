"""Preprocess GSM8K for multi-turn rollouts with the ``gsm8k`` interaction (a user who says when the
answer is wrong).

    python examples/data_preprocess/gsm8k_multiturn_w_interaction.py --local_save_dir ~/data/gsm8k
    python examples/data_preprocess/gsm8k_multiturn_w_interaction.py --local_dataset_path /path/to/gsm8k --local_save_dir ~/data/gsm8k

Writes upstream's rows: data_source "openai/gsm8k", prompt [system: solve step by step, reconsider when
told the answer is wrong, answer as "#### <answer>"; user: the question and "...after `####`."],
ability "math", reward_model {style "rule", ground_truth}, extra_info {split, index, answer, question,
interaction_kwargs {name: "gsm8k", query, ground_truth}}. ``name`` selects the interaction of
``examples/sglang_multiturn/config/interaction_config/gsm8k_interaction_config.yaml``.
"""

from __future__ import annotations

from _gsm8k_multiturn import base_row, run

INTERACTION_NAME = "gsm8k"
SYSTEM_PROMPT = (
    "You are a math expert. Solve the given question step by step. "
    "If the user points out that your answer is wrong, think it over carefully again. "
    "Put your final answer in the format of `#### <answer>`."
)


def make_row(example: dict, split: str, index: int) -> dict:
    row, query, ground_truth = base_row(example, split, index, SYSTEM_PROMPT)
    row["extra_info"]["interaction_kwargs"] = {"name": INTERACTION_NAME, "query": query, "ground_truth": ground_truth}
    return row


if __name__ == "__main__":
    run(make_row, __doc__)
