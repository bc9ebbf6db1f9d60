"""Reward manager for batched reward functions: one call scores the whole batch.

``compute_score(data_sources, solution_strs, ground_truths, extra_infos, **reward_kwargs)`` receives
lists and returns one score (float or dict with ``"score"``) per sample, e.g. a function that sends the
batch to a judge service at once. If that call raises, no sample can be scored: ``on_error="raise"``
stops with the first sample's details, ``"zero"`` scores the whole batch 0 and flags every sample.
"""

from __future__ import annotations

from collections.abc import Callable

from verl.workers.reward_manager.abstract import AbstractRewardManager, Sample, ScoreOutcome
from verl.workers.reward_manager.registry import register


@register("batch")
class BatchRewardManager(AbstractRewardManager):
    """Scores the batch with one call of a batched ``compute_score``.

    Without ``compute_score``, ``default_compute_score`` is applied to each sample in turn.
    Extra keyword arguments are passed to ``compute_score`` on every call.
    """

    def __init__(
        self,
        tokenizer,
        num_examine: int,
        compute_score: Callable | None = None,
        reward_fn_key: str = "data_source",
        on_error: str = "raise",
        **reward_kwargs,
    ):
        super().__init__(tokenizer, num_examine, None, reward_fn_key, on_error)
        self.batch_compute_score = compute_score
        self.reward_kwargs = reward_kwargs

    def compute_scores(self, samples: list[Sample]) -> list[ScoreOutcome]:
        if self.batch_compute_score is None:
            return [self.call_one(sample) for sample in samples]
        try:
            results = self.batch_compute_score(
                data_sources=[s.data_source for s in samples],
                solution_strs=[s.solution_str for s in samples],
                ground_truths=[s.ground_truth for s in samples],
                extra_infos=[s.extra_info for s in samples],
                **self.reward_kwargs,
            )
        except Exception as e:
            return [ScoreOutcome(error=f"the batched call raised {type(e).__name__}: {e}", cause=e) for _ in samples]
        results = list(results)
        if len(results) != len(samples):
            raise ValueError(
                f"the batched reward function returned {len(results)} scores for {len(samples)} samples; "
                "it must return one score per sample, in order"
            )
        return [ScoreOutcome(result=result) for result in results]
