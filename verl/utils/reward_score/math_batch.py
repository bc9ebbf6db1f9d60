"""A batched reward function (`reward_model.reward_manager=batch`): one call scores a whole batch.

`compute_score_batched(data_sources, solution_strs, ground_truths, extra_infos)` returns one score per
response, each `math_reward.compute_score` (the last `\\boxed{}` against the reference). It is the shape a
batched scorer takes: point `custom_reward_function.path` at this module (or at your own function with the
same signature, e.g. one that sends the batch to a verifier service at once) and
`custom_reward_function.name=compute_score_batched`.
"""

from __future__ import annotations

from verl.utils.reward_score.math_reward import compute_score


def compute_score_batched(data_sources, solution_strs, ground_truths, extra_infos) -> list[float]:
    if len(solution_strs) != len(ground_truths):
        raise ValueError(
            f"compute_score_batched got {len(solution_strs)} responses but {len(ground_truths)} ground truths"
        )
    return [float(compute_score(s, g)) for s, g in zip(solution_strs, ground_truths)]
