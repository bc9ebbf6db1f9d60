"""The driver's worker groups: which roles exist, and spawning them onto their resource pools.

`spawn_worker_groups` puts the roles that share a resource pool into one colocated worker class
(the hybrid engine: actor, rollout and reference in one process; a megatron critic or reward
model of another layout than the actor's gets processes of its own, process_sets.py), spawns the
groups and builds the models in an order that matters: helpers first, the actor last, since its
rollout engine sizes its memory after what the others took. The result names each group as the trainer
keeps it (`WORKER_GROUPS`). `Role` is importable from `verl.trainer.ppo.ray_trainer` too
(upstream's path, which scripts building their own role mapping use).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from verl.experimental.agent_loop import AgentLoopRollout
from verl.trainer.ppo.process_sets import megatron_process_sets
from verl.utils import speed_paths
from verl.utils.speed_paths import SpeedPath


class Role(Enum):
    """The roles a worker process can play; several may share one process (colocation).

    `str(role)` is its short name (`actor_rollout`, `ref`, `rm`, ...) and `Role.from_string` reads one
    back, as upstream's; `Env` is upstream's member for environment workers, which no trainer here spawns."""

    Actor = 0
    Rollout = 1
    ActorRollout = 2
    Critic = 3
    RefPolicy = 4
    RewardModel = 5
    ActorRolloutRef = 6
    Env = 7

    def __str__(self) -> str:
        return _ROLE_NAMES.get(self.name, self.name.lower())

    @classmethod
    def from_string(cls, name: str) -> Role:
        for role in cls:
            if str(role) == name.lower():
                return role
        raise ValueError(f"no Role is named {name!r}; the names are {[str(r) for r in cls]}")


_ROLE_NAMES = {
    "Actor": "actor",
    "Rollout": "rollout",
    "ActorRollout": "actor_rollout",
    "Critic": "critic",
    "RefPolicy": "ref",
    "RewardModel": "rm",
    "ActorRolloutRef": "actor_rollout_ref",
}


WORKER_GROUPS = ("actor_rollout_wg", "critic_wg", "ref_policy_wg", "rm_wg", "rollout_wg")
"""The names `spawn_worker_groups` returns groups under (the trainer's attributes)."""


def spawn_worker_groups(
    config, role_worker_mapping: dict[Role, Any], resource_pool_manager, worker_group_cls, runtime_env=None
) -> dict[str, Any]:
    """Spawn every role's worker group and build its model; returns {name in WORKER_GROUPS: group}
    for the roles `role_worker_mapping` has (`ref_policy_wg` is the actor's group when the
    reference lives in the actor's processes, `Role.ActorRolloutRef`).

    runtime_env: the Ray runtime env every worker starts with (the nsys profiler's), or None.
    """
    # imported here, not at the top: importing the trainer's modules must not import ray
    from verl.single_controller.ray import RayClassWithInitArgs, create_colocated_worker_cls

    resource_pool_manager.create_resource_pool()
    arc = config.actor_rollout_ref
    roles_in_pool: dict[Any, dict[str, Any]] = {}

    def add(worker_role: Role, name: str, **init_args) -> None:  # init_args may hold the worker's own `role`
        cls_with_args = RayClassWithInitArgs(role_worker_mapping[worker_role], **init_args)
        if runtime_env:
            cls_with_args.update_options({"runtime_env": runtime_env})
        roles_in_pool.setdefault(resource_pool_manager.get_resource_pool(worker_role), {})[name] = cls_with_args

    # the rollout's agent loops, when its config runs them (the workers do not import verl.experimental:
    # verl/workers/rollout/wrapper.py); they name their traces after the run (rollout.trace)
    names = {
        "project_name": config.trainer.project_name,
        "experiment_name": config.trainer.experiment_name,
        "rollout_wrapper": AgentLoopRollout,
    }
    with_ref = Role.ActorRolloutRef in role_worker_mapping
    actor_role = Role.ActorRolloutRef if with_ref else Role.ActorRollout
    add(actor_role, "actor_rollout", config=arc, role="actor_rollout_ref" if with_ref else "actor_rollout", **names)
    if Role.Critic in role_worker_mapping:
        add(Role.Critic, "critic", config=config.critic)
    if Role.RefPolicy in role_worker_mapping:
        add(Role.RefPolicy, "ref", config=arc, role="ref")
    if Role.Rollout in role_worker_mapping:  # generation in its own pool (async training)
        add(Role.Rollout, "rollout", config=arc, role="rollout", **names)
    if Role.RewardModel in role_worker_mapping:
        add(Role.RewardModel, "rm", config=config.reward_model)

    timeout = config.trainer.rpc_timeout_s
    spawned: dict[str, Any] = {}
    for pool, pool_roles in roles_in_pool.items():
        for class_dict in megatron_process_sets(config, pool_roles):
            colocated = create_colocated_worker_cls(class_dict)
            kwargs = {"resource_pool": pool, "ray_cls_with_init": colocated}
            if config.trainer.get("ray_wait_register_center_timeout") is not None:
                kwargs["ray_wait_register_center_timeout"] = config.trainer.ray_wait_register_center_timeout
            if timeout:
                kwargs["timeout_s"] = timeout
            wg = worker_group_cls(**kwargs)
            spawned.update(wg.spawn(prefix_set=class_dict.keys()))

    # Build order: helpers first, the actor last (its rollout engine sizes itself after them).
    groups = {}
    for name, key in (("critic_wg", "critic"), ("ref_policy_wg", "ref"), ("rm_wg", "rm")):
        if key in spawned:
            groups[name] = spawned[key]
            groups[name].init_model()
    groups["actor_rollout_wg"] = spawned["actor_rollout"]
    groups["actor_rollout_wg"].init_model()
    if with_ref:
        groups["ref_policy_wg"] = groups["actor_rollout_wg"]
    if "rollout" in spawned:
        groups["rollout_wg"] = spawned["rollout"]
        groups["rollout_wg"].init_model()
    return groups


def worker_speed_paths(groups: dict[str, Any]) -> list[SpeedPath]:
    """The speed paths the worker groups report, merged (a worker class without the `speed_paths`
    RPC, such as a user's own, reports none)."""
    paths = []
    for name in ("actor_rollout_wg", "critic_wg", "rm_wg", "rollout_wg"):
        group = groups.get(name)
        if group is not None and hasattr(group, "speed_paths"):
            paths += [SpeedPath.from_dict(d) for rank_paths in group.speed_paths() for d in rank_paths]
    return speed_paths.merge(paths)
