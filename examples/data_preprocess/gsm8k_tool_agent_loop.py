"""Preprocess GSM8K for the tool agent loop (``agent_name: tool_agent``) with the ``calc_gsm8k_reward`` tool.

    python examples/data_preprocess/gsm8k_tool_agent_loop.py --local_save_dir ~/data/gsm8k
    python examples/data_preprocess/gsm8k_tool_agent_loop.py --local_dataset_path /path/to/gsm8k --local_save_dir ~/data/gsm8k

The rows of ``gsm8k_multiturn_w_tool.py`` plus the column ``agent_name`` = "tool_agent", which routes
each prompt to the tool-calling agent loop (``actor_rollout_ref.rollout.multi_turn`` with
``rollout.agent``).
"""

from __future__ import annotations

from _gsm8k_multiturn import run
from gsm8k_multiturn_w_tool import make_row as tool_row

AGENT_NAME = "tool_agent"


def make_row(example: dict, split: str, index: int) -> dict:
    return {"agent_name": AGENT_NAME, **tool_row(example, split, index)}


if __name__ == "__main__":
    run(make_row, __doc__)
