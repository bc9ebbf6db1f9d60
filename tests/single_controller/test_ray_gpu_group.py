"""GPU bundles and NCCL (skipped without a CUDA device)."""

from __future__ import annotations

import sys

import pytest
import torch
from ray import cloudpickle

from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class NcclWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_on_device(self):
        import torch.distributed as dist

        from verl.utils.device import get_device

        self.init_process_group(timeout_s=120)
        value = torch.tensor([float(self.rank + 1)], device=get_device())
        dist.all_reduce(value)
        return str(dist.get_backend()), value.device.type, value.item()


@pytest.mark.gpu
def test_gpu_bundles_form_an_nccl_group(ray_session):
    world_size = min(torch.cuda.device_count(), 2)
    pool = RayResourcePool(process_on_nodes=[world_size], use_gpu=True, max_colocate_count=1)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(NcclWorker))
    try:
        expected = float(sum(range(1, world_size + 1)))
        results = wg.all_reduce_on_device()
        # the workers' group: NCCL for device tensors, gloo for the host-side collectives
        assert [(backend, value) for backend, _, value in results] == [("cpu:gloo,cuda:nccl", expected)] * world_size
        assert all(device != "cpu" for _, device, _ in results)
    finally:
        wg.shutdown()
        pool.remove_placement_groups()
