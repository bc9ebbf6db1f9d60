"""The calculator task: multi-step arithmetic that a tiny model solves only with a tool.

"What is 12+34*56?" -> the model calls the calculator, reads `1916` back and answers `1916`. Two-digit
operands and two operations (`+ - *`, usual precedence) put most answers beyond what a ~1M-parameter
model computes in its head, but well within what it can copy: the skill the task trains is tool
use — writing the call (a copy of the expression) and restating the tool's answer.

Rows follow upstream verl's RL schema with `data_source="arith_tool"` (scored on the final answer
only, `verl.utils.reward_score.arith.compute_score_after_tools`) and `agent_name="tool_agent"`; they
carry no `extra_info.tools_kwargs` because the calculator keeps no per-conversation state. `transcript(problem)` is the
conversation a perfect tool user has; the SFT warm-start (`verl.models.build_bundled_tool`) trains
on those, in the multi-turn SFT format (`messages`), and measures the model with the real agent
loop (`evaluate_tool_use`, kept there: it drives workers and the agent loop, which a dataset
module below them must not import).
"""

from __future__ import annotations

import json
import os

from verl.utils.dataset import arith
from verl.utils.dataset.arith import ArithTask, Problem, _write_parquet_atomic, make_splits

DATA_SOURCE = "arith_tool"
TASK = ArithTask(digits=2, ops=("+", "-", "*"), steps=2)
DEFAULT_NUM_TRAIN = 5000
DEFAULT_NUM_TEST = 500


def tool_call_text(expression: str) -> str:
    """A hermes-format call of the built-in calculator."""
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "</tool_call>"


def transcript(problem: Problem) -> list[dict]:
    """The conversation of a model that uses the calculator perfectly."""
    answer = str(problem.answer)
    return [
        {"role": "user", "content": problem.question},
        {"role": "assistant", "content": tool_call_text(problem.expression)},
        {"role": "tool", "content": answer},
        {"role": "assistant", "content": answer},
    ]


def problem_to_row(problem: Problem, split: str, index: int) -> dict:
    row = arith.problem_to_row(problem, split, index)  # the single-turn schema, then the tool task's parts
    row.update(data_source=DATA_SOURCE, agent_name="tool_agent", messages=transcript(problem))
    return row


def write_arith_tool_parquet(
    out_dir: str, num_train: int = DEFAULT_NUM_TRAIN, num_test: int = DEFAULT_NUM_TEST, seed: int = 0
) -> tuple[str, str]:
    """`train.parquet` and `test.parquet` under `out_dir`; each row has both the RL columns and the
    SFT `messages` column, so one file serves the warm-start and the RL run."""
    train, test = make_splits(TASK, num_train, num_test, seed)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, problems in (("train", train), ("test", test)):
        path = os.path.join(out_dir, f"{name}.parquet")
        _write_parquet_atomic([problem_to_row(p, name, i) for i, p in enumerate(problems)], path)
        paths.append(path)
    return paths[0], paths[1]
