"""CPU worker groups give each worker the node's usable cores divided among its workers as torch
threads (verl.utils.cpu_layout.cpu_worker_thread_env), and a user's OMP_NUM_THREADS is kept."""

from __future__ import annotations

import os
import sys

from ray import cloudpickle

from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.single_controller.ray.resource_pool_manager import ResourcePoolManager
from verl.utils.machine import usable_cores

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class ThreadsWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def threads(self) -> tuple[str | None, int]:
        import torch

        return os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()


def _threads(workers: int, worker_env=None) -> list[tuple[str | None, int]]:
    pool = RayResourcePool([workers], use_gpu=False)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(ThreadsWorker), worker_env=worker_env)
    try:
        return wg.threads()
    finally:
        wg.shutdown()
        pool.remove_placement_groups()


def test_cpu_workers_share_the_node_cores_and_a_user_setting_wins(ray_session, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = usable_cores()
    # Ray alone would start every actor of a fractional CPU bundle with one thread
    assert _threads(1) == [(str(cores), cores)]
    half = max(1, cores // 2)
    assert _threads(2) == [(str(half), half)] * 2
    # (torch caps its own count at the usable cores, so the user's value is read from the env)
    assert _threads(1, {"OMP_NUM_THREADS": "1"}) == [("1", 1)]
    assert _threads(1, {"OMP_NUM_THREADS": "3"})[0][0] == "3"


def test_pools_side_by_side_divide_the_node_between_them(ray_session, monkeypatch):
    # async training: a rollout pool runs beside the trainer pool on the same cores
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    manager = ResourcePoolManager(
        {"global_pool": [1], "rollout_pool": [1]}, {"actor": "global_pool", "rollout": "rollout_pool"}, use_gpu=False
    )
    manager.create_resource_pool()
    pool = manager.get_resource_pool("actor")
    assert pool.workers_sharing_node == 2
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(ThreadsWorker))
    try:
        share = max(1, usable_cores() // 2)
        assert wg.threads() == [(str(share), share)]
    finally:
        wg.shutdown()
        pool.remove_placement_groups()
