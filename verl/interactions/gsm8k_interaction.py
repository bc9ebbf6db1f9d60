"""`Gsm8kInteraction`: tells the model whether its last answer to a GSM8K problem is right.

A right answer (strict `#### <number>` format, `verl.utils.reward_score.gsm8k`) scores 1 and ends
the episode; a wrong one scores 0 and asks the model to try again. The sample's
`interaction_kwargs` carry `ground_truth`, as in upstream's gsm8k multi-turn data. Each episode's state
is in `self._instance_dict[instance_id]` (`response`, `ground_truth`, `reward`), upstream's field, which
subclasses read.
"""

from __future__ import annotations

from typing import Any

from verl.interactions.base import BaseInteraction
from verl.utils.reward_score import gsm8k

CORRECT = "Your response is correct!"
INCORRECT = "Your response is incorrect! You need to reflect on your answer and try again."


class Gsm8kInteraction(BaseInteraction):
    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        self._instance_dict: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs) -> str:
        instance_id = await super().start_interaction(instance_id)
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs
    ) -> tuple[bool, str, float, dict[str, Any]]:
        last = next((m.get("content") for m in reversed(messages) if m.get("role") == "assistant"), "")
        self._instance_dict[instance_id]["response"] = last
        score = await self.calculate_score(instance_id)
        return (True, CORRECT, score, {}) if score == 1.0 else (False, INCORRECT, score, {})

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        episode = self._instance_dict[instance_id]
        episode["reward"] = gsm8k.compute_score(
            episode["response"] or "", episode["ground_truth"], method="strict", format_score=0.0, score=1.0
        )
        return episode["reward"]

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        if instance_id not in self._instance_dict:
            raise KeyError(f"no gsm8k interaction {instance_id!r} to finalize: start_interaction was not called for it")
        del self._instance_dict[instance_id]
