"""Upstream's `verl.trainer.ppo.utils`: the worker roles and what a config needs, for drivers that
build their own role mapping (recipes' `TaskRunner`s and trainers import them from here).

`Role` is the trainer's own (`verl.trainer.ppo.worker_groups.Role`, also importable from
`verl.trainer.ppo.ray_trainer`), so a mapping built with either works. `need_critic` and
`need_reference_policy` read the config as the trainer and its config check do
(`verl.trainer.config.validate_batches`).
"""

from __future__ import annotations

from verl.single_controller.base import Worker
from verl.trainer.config.validate_batches import need_critic as need_critic
from verl.trainer.config.validate_batches import need_reference_policy as need_reference_policy
from verl.trainer.ppo.worker_groups import Role as Role

WorkerType = type[Worker]


def need_reward_model(role_worker_mapping: dict) -> bool:
    """Whether the mapping has a reward-model worker (`Role.RewardModel`)."""
    return Role.RewardModel in role_worker_mapping
