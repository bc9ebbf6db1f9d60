"""Upstream's Ray-side API on a real local cluster: async @register methods, RAY_LOCAL_WORLD_SIZE and
worker_env, split/merge of resource pools, the fused colocated class (raw class, _fuw_execute, fuse)."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
import torch
from ray import cloudpickle

from verl.protocol import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.single_controller.ray.base import (
    create_colocated_worker_cls_fused,
    create_colocated_worker_raw_cls,
    merge_resource_pool,
    split_resource_pool,
)

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class AsyncWorker(Worker):
    def __init__(self):
        super().__init__()
        self.inflight = 0
        self.peak = 0

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    async def double(self, data: DataProto) -> DataProto:
        await asyncio.sleep(0.01)
        return DataProto.from_dict(tensors={"y": data.batch["x"] * 2, "rank": torch.full((len(data),), self.rank)})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def overlapped(self, n: int) -> int:
        """n concurrent sleeps on the actor's event loop: they overlap, so the peak is n."""

        async def one():
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)
            await asyncio.sleep(0.05)
            self.inflight -= 1

        await asyncio.gather(*(one() for _ in range(n)))
        return self.peak

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def fails(self):
        raise ValueError(f"async failure on rank {self.rank}")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sync_env(self, names):
        return {name: os.environ.get(name) for name in names}


class EnvWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def env(self, names):
        return {name: os.environ.get(name) for name in names}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def placement_group_id(self):
        import ray

        return ray.get_runtime_context().get_placement_group_id()


class Actor(Worker):
    def __init__(self, tag: str = "actor"):
        super().__init__()
        self.tag = tag

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def whoami(self):
        return f"{self.tag}@{self.rank}"

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def peer_tag(self, role: str):
        await asyncio.sleep(0)
        return self.fused_worker_dict[role].tag


class Critic(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def whoami(self):
        return f"critic@{self.rank}"


ENV_NAMES = ["RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "RAY_LOCAL_WORLD_SIZE", "WG_BACKEND", "MY_SETTING"]


def test_async_registered_methods_run_on_the_workers_event_loop(ray_session):
    pool = RayResourcePool([2], use_gpu=False)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(AsyncWorker))
    try:
        data = DataProto.from_dict(tensors={"x": torch.arange(5.0)})
        out = wg.double(data)  # 5 rows over 2 ranks: padded, then the padding removed
        assert out.batch["y"].tolist() == [0.0, 2.0, 4.0, 6.0, 8.0] and out.batch["rank"].tolist() == [0, 0, 0, 1, 1]
        assert wg.overlapped(4) == [4, 4]
        assert wg.execute_all("overlapped", 2) == [4, 4]  # execute_all also takes the async entry point
        assert wg.sync_env(["RANK"]) == [{"RANK": "0"}, {"RANK": "1"}]  # sync methods still work
        from verl.single_controller.base import WorkerMethodError

        with pytest.raises(WorkerMethodError, match="raised ValueError: async failure on rank [01]"):
            wg.fails()
    finally:
        wg.shutdown()
        pool.remove_placement_groups()


def test_workers_get_ray_local_world_size_and_worker_env(ray_session):
    pool = RayResourcePool([2], use_gpu=False)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(EnvWorker), worker_env={"MY_SETTING": "on"})
    try:
        assert wg.env(ENV_NAMES) == [
            {
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "LOCAL_WORLD_SIZE": "2",
                "RAY_LOCAL_WORLD_SIZE": "2",
                "WG_BACKEND": "ray",
                "MY_SETTING": "on",
            }
            for r in range(2)
        ]
    finally:
        wg.shutdown()
    with pytest.raises(ValueError, match=r"worker_env sets \['RANK'\]"):
        RayWorkerGroup(pool, RayClassWithInitArgs(EnvWorker), worker_env={"RANK": "7"})
    pool.remove_placement_groups()


def test_split_resource_pool_gives_consecutive_bundles(ray_session):
    pool = RayResourcePool([4], use_gpu=False, max_colocate_count=1)
    first, second = split_resource_pool(pool, 2)
    uneven = split_resource_pool(pool, [1, 3])
    assert [p.world_size for p in (first, second)] == [2, 2] and [p.world_size for p in uneven] == [1, 3]
    assert [p.start_bundle_index for p in uneven] == [0, 1]
    wg1 = RayWorkerGroup(first, RayClassWithInitArgs(EnvWorker))
    wg2 = RayWorkerGroup(second, RayClassWithInitArgs(EnvWorker))
    try:
        env1, env2 = wg1.env(ENV_NAMES), wg2.env(ENV_NAMES)
        assert [(e["RANK"], e["LOCAL_RANK"]) for e in env1] == [("0", "0"), ("1", "1")]
        assert [(e["RANK"], e["LOCAL_RANK"]) for e in env2] == [("0", "2"), ("1", "3")]  # bundles 2 and 3
        assert set(wg1.placement_group_id() + wg2.placement_group_id()) == {pool.pgs[0].id.hex()}
    finally:
        wg1.shutdown()
        wg2.shutdown()
    nested = split_resource_pool(second, 1)
    assert [p.start_bundle_index for p in nested] == [2, 3]
    with pytest.raises(ValueError, match="does not divide"):
        split_resource_pool(pool, 3)
    with pytest.raises(RuntimeError, match="remove them there"):
        first.remove_placement_groups()
    pool.remove_placement_groups()


def test_merge_resource_pool_spans_both_pools(ray_session):
    a = RayResourcePool([1], use_gpu=False, name_prefix="a")
    b = RayResourcePool([2], use_gpu=False, name_prefix="b")
    merged = merge_resource_pool(a, b)
    assert merged.world_size == 3 and merged.store == [1, 2] and merged.pgs == a.pgs + b.pgs
    wg = RayWorkerGroup(merged, RayClassWithInitArgs(EnvWorker))
    try:
        env = wg.env(ENV_NAMES)
        assert [(e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in env] == [
            ("0", "0", "1"),
            ("1", "0", "2"),
            ("2", "1", "2"),
        ]
    finally:
        wg.shutdown()
    with pytest.raises(ValueError, match="different use_gpu"):
        merge_resource_pool(a, RayResourcePool([1], use_gpu=True))
    a.remove_placement_groups()
    b.remove_placement_groups()


def test_fused_colocated_class_spawn_fuse_and_fuw_execute(ray_session):
    raw = create_colocated_worker_raw_cls({"actor": RayClassWithInitArgs(Actor, tag="pi"), "critic": Critic})
    assert raw.raw_cls_dict == {"actor": Actor, "critic": Critic} and raw.is_fused_worker
    local = raw()  # in this process: the roles see each other
    assert local.actor.tag == "pi" and local.fused_worker_dict["critic"] is local.critic
    assert local._fuw_execute("critic_fwmn_whoami") == "critic@0"
    assert asyncio.run(local.actor_peer_tag("actor")) == "pi"
    with pytest.raises(ValueError, match="<role>_fwmn_<method>"):
        local._fuw_execute("whoami")

    fused = create_colocated_worker_cls_fused({"actor": RayClassWithInitArgs(Actor, tag="pi"), "critic": Critic})
    assert fused.fused_worker_used
    pool = RayResourcePool([2], use_gpu=False)
    wg = RayWorkerGroup(pool, fused)
    try:
        assert wg.actor_whoami() == ["pi@0", "pi@1"] and wg.critic_whoami() == ["critic@0", "critic@1"]
        wg.fuse(["actor", "critic"])
        assert wg.actor.whoami() == ["pi@0", "pi@1"] and wg.critic.whoami() == ["critic@0", "critic@1"]
        assert wg.actor.peer_tag("actor") == ["pi", "pi"]  # an async method of a role, through the fused actor
    finally:
        wg.shutdown()
        pool.remove_placement_groups()
    with pytest.raises(ValueError, match="taken by a Worker attribute"):
        create_colocated_worker_raw_cls({"rank": Critic})


class Server(Worker):
    @register(dispatch_mode=Dispatch.DIRECT_ROLLOUT_METHOD)
    async def wake_up(self):
        return f"awake@{self.rank}"


def test_direct_rollout_methods_are_called_on_the_handles_and_bound_unprefixed(ray_session):
    """Upstream's DIRECT_ROLLOUT_METHOD: a worker group refuses to dispatch it; a colocated class binds a
    rollout role's such method without the role prefix, for callers that hold the actor handles."""
    raw = create_colocated_worker_raw_cls({"actor": Actor, "rollout": Server})
    assert hasattr(raw, "wake_up") and hasattr(raw, "rollout_wake_up")
    local = raw()
    assert asyncio.run(local.wake_up()) == "awake@0"
    pool = RayResourcePool([1], use_gpu=False)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(Server))
    try:
        with pytest.raises(NotImplementedError, match="actor handle"):
            wg.wake_up()
        import ray

        assert ray.get(wg.workers[0].wake_up.remote()) == "awake@0"
    finally:
        wg.shutdown()
        pool.remove_placement_groups()
