"""`Geo3kTool`: upstream verl's Geometry3K answer-checking tool (`calc_geo3k_reward`).

The model calls it with `{"answer": "2\\sqrt{3}"}`; the whole answer (no `\\boxed{}` needed) is
compared with the ground truth by `verl.utils.reward_score.geo3k` with `use_boxed=False` and no
format reward: 1.0 when equal, else 0.0. Create/execute/reward/penalty behaviour:
`verl.tools.answer_reward_tool`; unlike upstream's, the ground truth is also read from
`create_kwargs`, where upstream's preprocessing and the agent loop put it. Tool config, as upstream's
`geo3k_tool_config.yaml`:

    tools:
      - class_name: verl.tools.geo3k_tool.Geo3kTool
        config: {type: native}
        tool_schema: {type: function, function: {name: calc_geo3k_reward, parameters: {... answer ...}}}
"""

from __future__ import annotations

from typing import Any

from verl.tools.answer_reward_tool import AnswerRewardTool
from verl.utils.reward_score import geo3k


class Geo3kTool(AnswerRewardTool):
    default_tool_schema = {
        "type": "function",
        "function": {
            "name": "calc_geo3k_reward",
            "description": "A tool for calculating the reward of geo3k",
            "parameters": {
                "type": "object",
                "properties": {
                    "answer": {
                        "type": "string",
                        "description": "The answer to the question, enclosed in \\boxed{}",
                    }
                },
                "required": ["answer"],
            },
        },
    }

    def score(self, response: str, ground_truth: Any) -> float:
        return geo3k.compute_score(response, str(ground_truth), use_boxed=False, format_score=0.0)
