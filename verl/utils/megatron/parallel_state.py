"""Set up megatron-core's model-parallel groups on an already initialised torch.distributed world.

The worker (Ray or torchrun) owns `torch.distributed.init_process_group` (gloo on CPU, NCCL on
GPU); this module only carves that world into megatron's tensor / pipeline / context / data
parallel groups, in megatron's default order (tp fastest, then cp, dp, pp), seeds the
model-parallel RNG and, on CPU, switches on `verl.utils.megatron.cpu_compat`. Mixture-of-experts
models also get megatron's expert groups (expert-tensor x expert-parallel x expert-data x pipeline,
a second carving of the same world: the expert-parallel ranks come out of the data x context ranks).

Sizes are validated here with errors that name the config keys
(`actor_rollout_ref.actor.megatron.*`), since this is the first place that knows the world size.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = [
    "initialize_model_parallel",
    "destroy_model_parallel",
    "MegatronParallelSizes",
    "parameter_replica_group",
    "writes_optimizer_state",
]


class MegatronParallelSizes:
    """The parallel layout of one megatron model: tp, pp, vpp (None = no interleaving), cp, dp, and the
    expert layout ep (expert-parallel ranks) and etp (expert-tensor ranks; tp unless set)."""

    def __init__(self, tp: int, pp: int, vpp: int | None, cp: int, dp: int):
        self.tp, self.pp, self.vpp, self.cp, self.dp = tp, pp, vpp, cp, dp
        self.ep, self.etp = 1, tp

    def __repr__(self):
        return (
            f"MegatronParallelSizes(tp={self.tp}, pp={self.pp}, vpp={self.vpp}, cp={self.cp}, dp={self.dp}, "
            f"ep={self.ep}, etp={self.etp})"
        )


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    context_parallel_size: int = 1,
    seed: int = 0,
    timeout_s: float | None = None,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
) -> MegatronParallelSizes:
    """Create megatron's parallel groups over the current torch.distributed world and seed its RNG.

    `timeout_s` is the groups' collective deadline (the worker passes its process group's, so
    `actor_rollout_ref.nccl_timeout` holds here too; None: megatron's 30 minutes). Idempotent for the same sizes (a worker holding actor and reference shares one layout);
    different sizes in the same process are an error, since megatron's groups are process-global.
    """
    from megatron.core import parallel_state as mpu

    from verl.utils.megatron.cpu_compat import (
        enable_cpu_compat,
        enable_moe_compat,
        seed_model_parallel_rng,
    )
    from verl.utils.megatron.gloo_collectives import install_gloo_uneven_all_gather

    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: the worker must call init_process_group before setting up "
            "megatron's model-parallel groups"
        )
    tp, pp, cp = int(tensor_model_parallel_size), int(pipeline_model_parallel_size), int(context_parallel_size)
    vpp = None if virtual_pipeline_model_parallel_size in (None, 0, 1) else int(virtual_pipeline_model_parallel_size)
    world = dist.get_world_size()
    for key, value in (
        ("tensor_model_parallel_size", tp),
        ("pipeline_model_parallel_size", pp),
        ("context_parallel_size", cp),
    ):
        if value < 1:
            raise ValueError(f"actor.megatron.{key}={value} must be >= 1")
    if world % (tp * pp * cp):
        raise ValueError(
            f"{world} ranks cannot be split into tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp} "
            f"x context_parallel_size={cp}: the product must divide the world size; change actor.megatron.* or "
            "trainer.n_gpus_per_node * trainer.nnodes"
        )
    if vpp is not None and pp < 2:
        raise ValueError(
            f"actor.megatron.virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size >= 2 "
            f"(got {pp}); set it to null or raise the pipeline size"
        )
    ep = int(expert_model_parallel_size or 1)
    etp = tp if expert_tensor_parallel_size is None else int(expert_tensor_parallel_size)
    # megatron carves the expert groups out of the same world: etp x ep x expert-dp x pp
    if ep < 1 or etp < 1 or world % (etp * ep * pp):
        raise ValueError(
            f"{world} ranks cannot be split into expert_tensor_parallel_size={etp} x expert_model_parallel_size={ep} "
            f"x pipeline_model_parallel_size={pp}: the product must divide the world size; change "
            "actor.megatron.expert_* or trainer.n_gpus_per_node * trainer.nnodes"
        )
    sizes = MegatronParallelSizes(tp, pp, vpp, cp, world // (tp * pp * cp))
    sizes.ep, sizes.etp = ep, etp
    enable_cpu_compat()
    enable_moe_compat()
    if dist.get_backend() == "gloo":
        install_gloo_uneven_all_gather()
    if mpu.model_parallel_is_initialized():
        current = (
            mpu.get_tensor_model_parallel_world_size(),
            mpu.get_pipeline_model_parallel_world_size(),
            mpu.get_virtual_pipeline_model_parallel_world_size(),
            mpu.get_context_parallel_world_size(),
            mpu.get_expert_model_parallel_world_size(),
            mpu.get_expert_tensor_parallel_world_size(),
        )
        if current != (tp, pp, vpp, cp, ep, etp):
            raise RuntimeError(
                f"megatron's parallel groups already exist with (tp, pp, vpp, cp, ep, etp)={current}, not "
                f"{(tp, pp, vpp, cp, ep, etp)}; "
                "all megatron models in one process must share one layout"
            )
        return sizes
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        create_gloo_process_groups=False,
        **({} if timeout_s is None else {"distributed_timeout_minutes": float(timeout_s) / 60.0}),
    )
    seed_model_parallel_rng(seed)
    return sizes


def destroy_model_parallel() -> None:
    """Tear down megatron's groups (tests, or a worker that re-initialises with another layout)."""
    from megatron.core import parallel_state as mpu

    _REPLICAS.clear()
    mpu.destroy_model_parallel()


# the replica groups of the current layout (see `_replicas`), built once per layout
_REPLICAS: dict = {}


def _replicas() -> dict:
    """Under expert parallelism, the ranks holding exactly this rank's parameters: the same tensor,
    pipeline, expert-parallel and expert-tensor ranks (data-parallel ranks hold different experts,
    expert-data-parallel ranks different dense shards when etp != tp). A collective the first time
    (every rank builds every group, in the same order); then cached until `destroy_model_parallel`.

    Returns {"group": this rank's replica group, "dense_writer": whether its group is the one that
    writes the dense weights' optimizer state (the smallest (ep, etp) rank among the groups holding
    this rank's dense shards), "expert_writer": likewise for its experts (the smallest tp rank)}."""
    from megatron.core import parallel_state as mpu

    if not _REPLICAS:
        mine = (
            mpu.get_tensor_model_parallel_rank(),
            mpu.get_pipeline_model_parallel_rank(),
            mpu.get_expert_model_parallel_rank(),
            mpu.get_expert_tensor_parallel_rank(),
        )
        keys = [None] * dist.get_world_size()
        dist.all_gather_object(keys, mine)
        members: dict[tuple, list[int]] = {}
        for rank, key in enumerate(keys):
            members.setdefault(tuple(key), []).append(rank)
        for key in sorted(members):
            group = dist.new_group(members[key])
            if key == mine:
                _REPLICAS["group"] = group
        tp, pp, ep, etp = mine
        _REPLICAS["dense_writer"] = min(k[2:] for k in members if k[:2] == (tp, pp)) == (ep, etp)
        _REPLICAS["expert_writer"] = min(k[0] for k in members if k[1:] == (pp, ep, etp)) == tp
    return _REPLICAS


def parameter_replica_group():
    """The group of ranks that hold the same parameters as this one, over which the distributed
    optimizer splits the Adam state: the data-parallel group when every data-parallel rank holds
    the same experts too (ep=1 and etp <= tp), else the ranks with this rank's tensor, pipeline,
    expert and expert-tensor ranks (`_replicas`). At ep=1 with etp > tp megatron's expert-tensor
    ranks run across data-parallel ranks, which then hold different shards of each expert: split
    over them, each expert moment would be stepped by one rank for a shard it does not hold, and
    the other shards' moments would be written by nobody (megatron refused such a checkpoint with
    "Invalid access pattern")."""
    from megatron.core import parallel_state as mpu

    ep, etp = mpu.get_expert_model_parallel_world_size(), mpu.get_expert_tensor_parallel_world_size()
    if ep == 1 and etp <= mpu.get_tensor_model_parallel_world_size():
        return mpu.get_data_parallel_group()
    return _replicas()["group"]


def writes_optimizer_state(owned: bool, expert: bool) -> bool:
    """With the Adam state split over `parameter_replica_group`: whether this rank writes a
    parameter's moments to a checkpoint (it owns them, in the one replica group chosen to write
    that parameter). Used under expert parallelism, and without it when the experts are split over
    fewer tensor ranks than the dense layers. A collective the first time on every rank, owner or
    not (so the groups are built in step everywhere)."""
    writers = _replicas()
    return owned and writers["expert_writer" if expert else "dense_writer"]
