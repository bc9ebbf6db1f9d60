"""Upstream's import path for `RolloutSkip`, which recipes' own drivers construct when
`rollout.skip_rollout` is set.

`main_ppo`'s trainer implements `rollout.skip_rollout` itself (verl/trainer/ppo/rollout_skip.py): it
replays whole sample rows, each scored against its own prompt. Upstream's `RolloutSkip` patches the
worker group's `generate_sequences` to return the first rollout's raw output at every later step,
where a recipe's loop then joins it to that step's prompts and scores step 1's responses against
step k's answers. That is refused here, with the way to get the replay that works.
"""

from __future__ import annotations


class RolloutSkip:
    """`RolloutSkip(config, rollout_wg)`; `wrap_generate_sequences()` refuses (see the module docstring)."""

    def __init__(self, config, rollout_wg):
        self.config = config
        self.rollout_wg = rollout_wg

    def wrap_generate_sequences(self) -> None:
        raise NotImplementedError(
            "actor_rollout_ref.rollout.skip_rollout=true in a recipe's own training loop: replaying the raw first "
            "rollout would score its responses against later steps' prompts. Run the same config through "
            "python -m verl.trainer.main_ppo, whose trainer replays whole rows (docs/upstream.md), or set "
            "actor_rollout_ref.rollout.skip_rollout=false"
        )
