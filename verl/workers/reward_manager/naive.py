"""The default reward manager: call ``compute_score`` once per sample, in this process."""

from __future__ import annotations

from verl.workers.reward_manager.abstract import AbstractRewardManager, Sample, ScoreOutcome
from verl.workers.reward_manager.registry import register


@register("naive")
class NaiveRewardManager(AbstractRewardManager):
    """Scores samples one by one with ``compute_score(data_source, solution_str, ground_truth, extra_info)``."""

    ROLLOUT_EXTRA_INFO = ("tool_extra_fields", "num_turns", "rollout_reward_scores")

    def compute_scores(self, samples: list[Sample]) -> list[ScoreOutcome]:
        return [self.call_one(sample) for sample in samples]
