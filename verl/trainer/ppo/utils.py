"""Upstream's `verl.trainer.ppo.utils`: the worker roles and what a config needs, for drivers that
build their own role mapping (recipes' `TaskRunner`s and trainers import them from here).

`Role` is the trainer's own (`verl.trainer.ppo.worker_groups.Role`, also importable from
`verl.trainer.ppo.ray_trainer`), so a mapping built with either works. `need_critic` and
`need_reference_policy` read the config as the trainer and its config check do
(`verl.trainer.config.validate_batches`); `need_reference_policy` also takes a role mapping, upstream's
earlier signature (`Role.RefPolicy in role_worker_mapping`), which verl-recipe's SPPO, SPIN, PRIME, GVPO and
SPO drivers still pass.
"""

from __future__ import annotations

from verl.single_controller.base import Worker
from verl.trainer.config.validate_batches import need_critic as need_critic
from verl.trainer.config.validate_batches import need_reference_policy as _need_reference_policy
from verl.trainer.ppo.worker_groups import Role as Role

WorkerType = type[Worker]


def need_reward_model(role_worker_mapping: dict) -> bool:
    """Whether the mapping has a reward-model worker (`Role.RewardModel`)."""
    return Role.RewardModel in role_worker_mapping


def need_reference_policy(config_or_role_worker_mapping) -> bool:
    """Whether the run needs the frozen reference policy: from the config (any KL term), or from a role mapping
    (upstream's earlier signature: a `Role.RefPolicy` worker, or the actor-with-reference role, is mapped)."""
    mapping = config_or_role_worker_mapping
    if isinstance(mapping, dict) and mapping and all(isinstance(role, Role) for role in mapping):
        return Role.RefPolicy in mapping or Role.ActorRolloutRef in mapping
    return _need_reference_policy(mapping)
