"""Colocated roles, several resource pools, detached groups and dead workers, on a real Ray cluster."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch
from ray import cloudpickle

from verl.protocol import DataProto
from verl.single_controller.base import ResourceUnavailableError, Worker, WorkerDiedError, WorkerMethodError
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    ResourcePoolManager,
    create_colocated_worker_cls,
)
from verl.single_controller.ray.base import sort_placement_groups_by_node

cloudpickle.register_pickle_by_value(sys.modules[__name__])

# The workers below build their replies with `type(data)`, the DataProto they were sent, not with this
# module's `DataProto`: a class shipped by value takes the globals its methods name along, and
# unpickling `verl.protocol` makes every fresh worker import torch and tensordict (seconds each on 2
# cores). So only the workers that receive a batch import them; the groups whose ranks die or fail
# to start never do.


class Actor(Worker):
    def __init__(self, lr: float):
        super().__init__()
        self.lr = lr

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_actor(self, data):
        return type(data).from_dict(tensors={"new": data.batch["x"] - self.lr})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self):
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def boom(self):
        raise RuntimeError("actor update diverged")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def peer_dies(self, first: str = "error"):
        """Rank 1 dies and rank 0 fails as a collective with a dead peer would: rank 0's error reaches
        the driver first (`first="error"`) or after the death is known (`first="death"`)."""
        if self.rank == 0:
            time.sleep(0.0 if first == "error" else 2.0)
            raise RuntimeError("Connection closed by peer")
        time.sleep(0.5 if first == "error" else 0.0)
        os._exit(1)


class BrokenInit(Worker):
    def __init__(self):
        super().__init__()
        raise FileNotFoundError("no checkpoint at /nonexistent/ckpt")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ping(self):
        return "pong"


class Critic(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data):
        return type(data).from_dict(tensors={"values": data.batch["x"] * 10 + self.rank})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self):
        return os.getpid()


def _data(n):
    return DataProto.from_dict(tensors={"x": torch.arange(n, dtype=torch.float32)})


@pytest.fixture
def cpu_pool(ray_session):
    pools = []

    def make(process_on_nodes, **kwargs):
        pool = RayResourcePool(process_on_nodes=process_on_nodes, use_gpu=False, max_colocate_count=1, **kwargs)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.remove_placement_groups()


def test_colocated_roles_share_a_process_and_expose_prefixed_methods(cpu_pool):
    cls = create_colocated_worker_cls({"actor": RayClassWithInitArgs(Actor, lr=0.5), "critic": Critic})
    wg = RayWorkerGroup(cpu_pool([2]), cls)
    try:
        assert wg.actor_pid() == wg.critic_pid()
        torch.testing.assert_close(wg.actor_update_actor(_data(3)).batch["new"], torch.arange(3.0) - 0.5)
        views = wg.spawn(prefix_set={"actor", "critic"})
        assert set(views) == {"actor", "critic"}
        values = views["critic"].compute_values(_data(4)).batch["values"]
        torch.testing.assert_close(values, torch.tensor([0.0, 10.0, 21.0, 31.0]))  # + rank of the chunk owner
        assert not hasattr(views["critic"], "update_actor")
        # Every rank raises; whichever failure Ray reports first is named.
        with pytest.raises(WorkerMethodError, match=r"actor rank [01]: boom\(\) raised RuntimeError") as info:
            views["actor"].boom()
        assert info.value.role == "actor" and info.value.rank in (0, 1)
        with pytest.raises(WorkerMethodError) as info:
            wg.actor_boom()
        assert (info.value.role, info.value.method) == ("actor", "actor_boom")
    finally:
        wg.shutdown()


def test_killed_worker_fails_the_next_call_within_seconds(cpu_pool):
    wg = RayWorkerGroup(cpu_pool([2]), RayClassWithInitArgs(Actor, lr=0.0), role="actor_rollout")
    pids = wg.pid()
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError) as info:
        wg.update_actor(_data(4))
    # unnoticed, the death would surface only at the call deadline (VERL_RPC_TIMEOUT_S, 3600 s);
    # 60 s is far from that and leaves Ray's death notice room on a loaded machine
    assert time.monotonic() - start < 60
    err = info.value
    assert (err.role, err.rank, err.method) == ("actor_rollout", 1, "update_actor")
    assert "actor_rollout rank 1 died during update_actor()" in str(err)
    wg.shutdown()


@pytest.mark.parametrize("first", ["error", "death"])
def test_a_dead_rank_is_named_as_the_cause_of_its_peers_errors_whichever_arrives_first(cpu_pool, first):
    wg = RayWorkerGroup(cpu_pool([2]), RayClassWithInitArgs(Actor, lr=0.0), role="actor_rollout")
    with pytest.raises(WorkerDiedError) as info:
        wg.peer_dies(first=first)
    err = info.value
    assert (err.role, err.rank, err.method) == ("actor_rollout", 1, "peer_dies")
    assert "actor_rollout rank 1 died during peer_dies()" in str(err)
    assert "Then actor_rollout rank 0: peer_dies() raised RuntimeError: Connection closed by peer." in str(err)
    wg.shutdown()


def test_worker_whose_init_raises_is_reported_with_the_init_error(cpu_pool):
    wg = RayWorkerGroup(cpu_pool([1]), RayClassWithInitArgs(BrokenInit), role="ref")
    with pytest.raises(WorkerDiedError, match=r"ref rank 0 is dead: its __init__ raised") as info:
        wg.ping()
    assert "no checkpoint at /nonexistent/ckpt" in str(info.value)
    wg.shutdown()


def test_two_pools_run_separate_groups_and_a_detached_one_can_be_reattached(ray_session):
    manager = ResourcePoolManager(
        resource_pool_spec={"train": [1], "reward": [1]},
        mapping={"actor": "train", "critic": "reward"},
        use_gpu=False,
    )
    manager.create_resource_pool()
    try:
        actor = RayWorkerGroup(manager.get_resource_pool("actor"), RayClassWithInitArgs(Actor, lr=1.0))
        critic_cls = RayClassWithInitArgs(Critic)
        critic = RayWorkerGroup(
            manager.get_resource_pool("critic"), critic_cls, name_prefix="test_detached_critic", detached=True
        )
        assert actor.world_size == critic.world_size == 1
        assert actor.pid() != critic.pid()
        torch.testing.assert_close(critic.compute_values(_data(2)).batch["values"], torch.tensor([0.0, 10.0]))
        torch.testing.assert_close(actor.update_actor(_data(2)).batch["new"], torch.tensor([-1.0, 0.0]))

        again = RayWorkerGroup.from_detached(name_prefix="test_detached_critic", ray_cls_with_init=critic_cls)
        assert again.worker_names == ["test_detached_critic:0"]
        assert again.pid() == critic.pid()
        actor.shutdown()
        critic.shutdown()
    finally:
        for pool in manager.resource_pool_dict.values():
            pool.remove_placement_groups()


def test_resource_check_says_what_is_missing(ray_session):
    gpus = ResourcePoolManager({"global_pool": [8]}, {"actor": "global_pool"}, use_gpu=True)
    with pytest.raises(ResourceUnavailableError, match=r"cannot place 8 GPUs on one node.*no GPU is visible to Ray"):
        gpus.create_resource_pool()
    cpus = ResourcePoolManager({"a": [2], "b": [64]}, {"actor": "a"}, use_gpu=False)
    with pytest.raises(ResourceUnavailableError, match=r"cannot place 64 CPUs on one node for pool 'b'"):
        cpus.create_resource_pool()
    with pytest.raises(ValueError, match="undefined resource pools"):
        ResourcePoolManager({"a": [1]}, {"actor": "missing"})


def test_resource_pool_without_gpus_in_the_cluster_fails_at_once(ray_session):
    with pytest.raises(ResourceUnavailableError, match="needs 2 GPU .* has 0 GPU in total; no GPU is visible"):
        RayResourcePool(process_on_nodes=[2], use_gpu=True).get_placement_groups()


def test_placement_groups_are_ordered_by_node_address():
    nodes = [("10.0.0.12", "b"), ("10.0.0.9", "a"), ("fd00::1", "e"), ("10.0.0.12", "b"), ("10.0.0.10", "c")]
    # numeric IPv4 order (9 < 10 < 12), creation order kept on the same node, IPv6 after IPv4
    assert sort_placement_groups_by_node(nodes) == [1, 4, 0, 3, 2]


def test_a_group_that_finds_no_room_on_its_pool_fails_naming_the_colocation_limit(cpu_pool, monkeypatch):
    # max_colocate_count=1: the first group takes each bundle's whole CPU, so a second group on the
    # same pool can never be scheduled. It must fail within the placement deadline, not hang.
    pool = cpu_pool([1])
    first = RayWorkerGroup(pool, RayClassWithInitArgs(Actor, lr=0.0), role="actor")
    monkeypatch.setenv("VERL_PLACEMENT_TIMEOUT_S", "5")  # after the first group: starting it may take longer
    try:
        start = time.monotonic()
        with pytest.raises(
            ResourceUnavailableError, match=r"worker group 'critic'.*ranks \[0\] of 1 did not start"
        ) as info:
            RayWorkerGroup(pool, RayClassWithInitArgs(Critic), role="critic")
        # 5 s placement deadline vs the 300 s default (or a hang): 60 s tells them apart on any load
        assert time.monotonic() - start < 60
        assert "max_colocate_count=1" in str(info.value) and "VERL_PLACEMENT_TIMEOUT_S" in str(info.value)
        assert first.pid()  # the group already placed is untouched
    finally:
        first.shutdown()


def test_ray_wait_register_center_timeout_is_the_deadline_for_the_workers_to_start(cpu_pool):
    pool = cpu_pool([1])
    first = RayWorkerGroup(pool, RayClassWithInitArgs(Actor, lr=0.0), role="actor")
    try:
        start = time.monotonic()
        with pytest.raises(ResourceUnavailableError, match=r"did not start within 1 s") as info:
            RayWorkerGroup(pool, RayClassWithInitArgs(Critic), role="critic", ray_wait_register_center_timeout=1)
        assert time.monotonic() - start < 60  # not the 300 s default
        assert "raise trainer.ray_wait_register_center_timeout" in str(info.value)
    finally:
        first.shutdown()
