"""The FSDP workers called directly without Ray: `actor_rollout_ref.nccl_timeout` is the deadline
of the group the worker forms (and of the megatron groups carved from it)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from verl.models import bundled_model_path
from verl.trainer.config import load_ppo_config


def _timeout_s(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


@pytest.fixture
def one_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VERL_DEVICE", "cpu")
    monkeypatch.setenv("VERL_DIST_TIMEOUT_S", "45")  # the config's value must win over it
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_actor_worker_group_uses_nccl_timeout(one_process):
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    cfg = load_ppo_config(
        [
            f"actor_rollout_ref.model.path={bundled_model_path()}",
            "actor_rollout_ref.nccl_timeout=77",
            "trainer.n_gpus_per_node=1",
        ]
    )
    ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor")
    assert dist.get_backend() == "gloo"
    assert _timeout_s(dist.distributed_c10d._get_default_group()) == 77


def test_megatron_groups_get_the_workers_timeout(one_process):
    pytest.importorskip("megatron.core", reason="needs megatron-core")
    from megatron.core import parallel_state as mpu

    from verl.single_controller.base.worker import init_process_group
    from verl.workers.megatron_workers import _setup_parallel

    init_process_group(timeout_s=88)
    try:
        _setup_parallel({"tensor_model_parallel_size": 1})
        for group in (mpu.get_data_parallel_group(), mpu.get_tensor_model_parallel_group()):
            assert _timeout_s(group) == 88  # megatron's own default is 30 minutes
    finally:
        mpu.destroy_model_parallel()

