"""`Gsm8kTool`: upstream verl's GSM8K answer-checking tool (`calc_gsm8k_reward`).

The model calls it with `{"answer": "72"}`; the answer is scored as the response `#### 72` by
`verl.utils.reward_score.gsm8k` (flexible extraction: the last number; 1.0 right, 0.0 otherwise).
Create/execute/reward/penalty behaviour: `verl.tools.answer_reward_tool`. Tool config, as upstream's
`gsm8k_tool_config.yaml`:

    tools:
      - class_name: verl.tools.gsm8k_tool.Gsm8kTool
        config: {type: native}
        tool_schema: {type: function, function: {name: calc_gsm8k_reward, parameters: {... answer ...}}}
"""

from __future__ import annotations

from typing import Any

from verl.tools.answer_reward_tool import AnswerRewardTool
from verl.utils.reward_score import gsm8k


class Gsm8kTool(AnswerRewardTool):
    default_tool_schema = {
        "type": "function",
        "function": {
            "name": "calc_gsm8k_reward",
            "description": "A tool for calculating the reward of gsm8k",
            "parameters": {
                "type": "object",
                "properties": {"answer": {"type": "string", "description": "The answer to the question"}},
                "required": ["answer"],
            },
        },
    }

    def format_answer(self, answer: str) -> str:
        return answer if answer.startswith("#### ") else "#### " + answer

    def score(self, response: str, ground_truth: Any) -> float:
        return gsm8k.compute_score(response, ground_truth, method="flexible", format_score=0.0, score=1.0)
