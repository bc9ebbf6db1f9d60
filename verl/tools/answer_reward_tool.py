"""`AnswerRewardTool`: the model submits an answer, the tool scores it against the sample's ground truth.

The shared machinery of upstream verl's demo reward tools, `Gsm8kTool` (`verl.tools.gsm8k_tool`) and
`Geo3kTool` (`verl.tools.geo3k_tool`); a subclass supplies only its default schema, how the submitted
answer is turned into the text the scorer reads, and the scorer. Upstream's behaviour:

- `create(instance_id=None, ground_truth=None, create_kwargs={...})`: the ground truth is the
  `ground_truth` argument, else `create_kwargs["ground_truth"]` (what the agent loop passes: the
  sample's `extra_info.tools_kwargs.<tool name>.create_kwargs`).
- `execute(instance_id, {"answer": ...})`: scores the answer and answers the model with
  `Current parsed answer='<answer>' reward=<score>`; the step reward is 0.0 when the score improved
  on the instance's best so far and `NON_IMPROVING_PENALTY` (-0.05) otherwise (a repeated or worse
  submission; also a first submission scoring 0).
- `calc_reward(instance_id)`: the score of the last submission; `release` forgets the instance.

One deliberate difference: a missing ground truth is an error at `create` naming the data field to
fill, where upstream scores every answer 0 (its `Geo3kTool` also ignores `create_kwargs`, so under the
agent loop it can never give a reward).
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.rollout_trace import rollout_trace_op

NON_IMPROVING_PENALTY = -0.05
"""The step reward of a submission that does not beat the instance's best score so far (upstream's)."""


class AnswerRewardTool(BaseTool):
    """Scores submitted answers against a per-instance ground truth (module docstring)."""

    default_tool_schema: dict[str, Any]
    """The schema used when the tool config gives no `tool_schema` (upstream's docstring schema)."""

    def __init__(self, config: dict | None, tool_schema: OpenAIFunctionToolSchema | dict | None):
        super().__init__(config, tool_schema)
        self._instance_dict: dict[str, dict[str, Any]] = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return getattr(self, "tool_schema", None) or OpenAIFunctionToolSchema.model_validate(self.default_tool_schema)

    def format_answer(self, answer: str) -> str:
        """The response text the scorer reads for a submitted answer."""
        return answer

    def score(self, response: str, ground_truth: Any) -> float:
        raise NotImplementedError(f"{type(self).__name__}.score")

    async def create(
        self, instance_id: str | None = None, ground_truth: Any = None, **kwargs
    ) -> tuple[str, ToolResponse]:
        if instance_id is None:
            instance_id = str(uuid4())
        if ground_truth is None:
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        if ground_truth is None:
            raise ValueError(
                f"tool {self.name!r} ({type(self).__name__}) needs the sample's ground truth to score answers: "
                f"set extra_info.tools_kwargs.{self.name}.create_kwargs.ground_truth in the dataset "
                "(upstream's multi-turn preprocessing scripts write it there)"
            )
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        answer = parameters.get("answer", "")
        if not isinstance(answer, str):
            answer = str(answer)
        state = self._instance_dict[instance_id]
        state["response"] = self.format_answer(answer)
        reward = await self.calc_reward(instance_id)
        step_reward = 0.0 if reward > state["reward"] else NON_IMPROVING_PENALTY
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), step_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instance_dict[instance_id]
        return self.score(state["response"], state["ground_truth"])

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instance_dict.pop(instance_id, None)
