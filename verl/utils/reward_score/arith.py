"""Scoring for the bundled arithmetic task ("What is 37+48?" -> "85").

Strict on purpose: the first integer of the response must equal the ground truth. A response that
states the answer late ("37+48 is 85") scores 0, which is what teaches the tiny model to answer first.
Leading whitespace is ignored, a leading minus belongs to the number ("-12"), and a response with no
integer (empty, or only text) scores 0.

`compute_score_after_tools` (data source `arith_tool`, the calculator task of docs/multi_turn.md)
applies the same rule to the text after the last tool answer, so the numbers a model copies into a
tool call or reads back from the tool never count as its answer.
"""

from __future__ import annotations

import re

_INTEGER_RE = re.compile(r"-?\d+")


def extract_answer(solution_str: str) -> int | None:
    """The first integer of the response, or None when it has none."""
    match = _INTEGER_RE.search(solution_str or "")
    return None if match is None else int(match.group())


def compute_score(solution_str: str, ground_truth) -> float:
    """1.0 when the first integer of ``solution_str`` equals ``ground_truth`` ("85" or 85), else 0.0."""
    try:
        expected = int(str(ground_truth).strip())
    except ValueError:
        raise ValueError(
            f"arith ground_truth must be an integer, got {ground_truth!r}; check reward_model.ground_truth "
            "in the dataset (examples/data_preprocess/arith.py writes it as a string such as '85')"
        ) from None
    return 1.0 if extract_answer(solution_str) == expected else 0.0


_TOOL_CALL_RE = re.compile(r"<tool_call>.*?(</tool_call>|$)", re.DOTALL)


def final_answer_text(solution_str: str) -> str:
    """The model's last words in a tool-using response: the text after the last tool answer, with
    any tool calls removed (a conversation that ends on a call has no answer)."""
    text = (solution_str or "").rsplit("</tool_response>", 1)[-1]
    return _TOOL_CALL_RE.sub("", text)


def compute_score_after_tools(solution_str: str, ground_truth) -> float:
    """`compute_score` applied to the final answer of a multi-turn response (data_source arith_tool):
    numbers in tool calls and tool answers never count, only what the model says after them."""
    return compute_score(final_answer_text(solution_str), ground_truth)
