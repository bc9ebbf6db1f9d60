"""Which bundles a `ResourcePoolManager` asks Ray for: they follow `trainer.device` (VERL_DEVICE)."""

from __future__ import annotations

import pytest

from verl.single_controller.base.errors import ResourceUnavailableError
from verl.single_controller.ray import ResourcePoolManager
from verl.single_controller.ray.resource_pool_manager import bundles_hold_gpus


@pytest.mark.parametrize(
    ("device", "cluster_gpus", "gpu_bundles"),
    [
        ("cpu", 8, False),  # CPU training on a GPU cluster holds no GPU (nor fails on a 1-GPU machine)
        ("cpu", 0, False),
        ("cuda", 8, True),
        ("cuda", 0, True),  # fails the resource check, which says no GPU is visible
        ("auto", 8, True),
        ("auto", 0, False),
    ],
)
def test_gpu_bundles_follow_the_requested_device(device, cluster_gpus, gpu_bundles):
    assert bundles_hold_gpus(device, cluster_gpus) is gpu_bundles


def test_manager_without_use_gpu_reads_verl_device(ray_session, monkeypatch):
    monkeypatch.setenv("VERL_DEVICE", "cuda")  # the test cluster has no GPU
    with pytest.raises(ResourceUnavailableError, match="cannot place 1 GPU on one node.*no GPU is visible to Ray"):
        ResourcePoolManager({"global_pool": [1]}, {"actor": "global_pool"}).create_resource_pool()
    monkeypatch.setenv("VERL_DEVICE", "cpu")
    manager = ResourcePoolManager({"global_pool": [1]}, {"actor": "global_pool"})
    manager.create_resource_pool()
    try:
        assert not manager.get_resource_pool("actor").use_gpu
    finally:
        manager.get_resource_pool("actor").remove_placement_groups()
