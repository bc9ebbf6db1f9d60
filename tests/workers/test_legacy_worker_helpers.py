"""Upstream's legacy-worker helpers that verl-recipe's own FSDP workers import:
`fsdp_workers.{create_device_mesh, get_sharding_strategy, get_vl_model_vision_tower}` and the
FSDP + Ulysses sharding manager (sp-group switch, all-gather in, chunk out) on 2 gloo ranks."""

import types

import pytest
import torch
from torch.distributed.fsdp import ShardingStrategy

from tests.distributed_helpers import run_distributed
from verl.protocol import DataProto
from verl.workers.fsdp_workers import get_sharding_strategy, get_vl_model_vision_tower
from verl.workers.sharding_manager import BaseShardingManager, FSDPUlyssesShardingManager


def test_sharding_strategy_follows_the_mesh_dimensions():
    one, two, three = (types.SimpleNamespace(ndim=n) for n in (1, 2, 3))
    assert get_sharding_strategy(one) == ShardingStrategy.FULL_SHARD
    assert get_sharding_strategy(two) == ShardingStrategy.HYBRID_SHARD
    assert get_sharding_strategy(one, zero3_enable=False) == ShardingStrategy.SHARD_GRAD_OP
    assert get_sharding_strategy(two, zero3_enable=False) == ShardingStrategy._HYBRID_SHARD_ZERO2
    with pytest.raises(NotImplementedError, match="ndim=3"):
        get_sharding_strategy(three)


def test_vision_tower_is_found_in_either_transformers_layout():
    tower = torch.nn.Linear(1, 1)
    new = types.SimpleNamespace(model=types.SimpleNamespace(visual=tower))
    old = types.SimpleNamespace(model=types.SimpleNamespace(), visual=tower)
    assert get_vl_model_vision_tower(new) is tower and get_vl_model_vision_tower(old) is tower
    assert get_vl_model_vision_tower(torch.nn.Linear(1, 1)) is None


def test_managers_without_a_mesh_leave_data_and_groups_alone():
    data = DataProto.from_dict(tensors={"x": torch.arange(4)})
    for manager in (BaseShardingManager(), FSDPUlyssesShardingManager(None)):
        with manager:
            assert manager.preprocess_data(data) is data and manager.postprocess_data(data) is data
    assert BaseShardingManager().timing == {}


def _two_rank_ulysses_manager(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from verl.utils import ulysses
    from verl.workers.fsdp_workers import create_device_mesh

    assert create_device_mesh(world_size, -1).mesh_dim_names == ("fsdp",)
    assert create_device_mesh(world_size, 1).mesh_dim_names == ("ddp", "fsdp")

    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "sp"))
    before = object()  # whatever group was set before entering comes back on leaving
    ulysses.set_ulysses_sequence_parallel_group(before)
    manager = FSDPUlyssesShardingManager(mesh)
    mine = DataProto.from_dict(
        tensors={"x": torch.tensor([[10 * rank], [10 * rank + 1]])}, non_tensors={"tag": [f"r{rank}a", f"r{rank}b"]}
    )
    with manager:
        assert ulysses.get_ulysses_sequence_parallel_group() is mesh["sp"].get_group()
        assert ulysses.get_ulysses_sequence_parallel_world_size() == world_size
        gathered = manager.preprocess_data(mine)
        assert gathered is mine  # in place, as upstream's
        assert gathered.batch["x"].flatten().tolist() == [0, 1, 10, 11]
        assert list(gathered.non_tensor_batch["tag"]) == ["r0a", "r0b", "r1a", "r1b"]
        back = manager.postprocess_data(gathered)
        assert back.batch["x"].flatten().tolist() == [10 * rank, 10 * rank + 1]
    assert ulysses.get_ulysses_sequence_parallel_group() is before
    ulysses.set_ulysses_sequence_parallel_group(None)


def test_ulysses_manager_switches_the_sp_group_and_reshards_data_on_two_ranks():
    run_distributed(_two_rank_ulysses_manager, 2)
