"""Upstream's checkpoint-engine API (verl.checkpoint_engine) driven as upstream's own test drives it: a
trainer worker group (a `TrainingWorker` subclass holding an engine) and rollout workers
(`CheckpointEngineWorker`) on a real local Ray cluster, `CheckpointEngineManager` between them, and
the `nccl` backend's bucketed broadcasts (gloo on this CPU machine). The references: the trainer's own
exported weights in the wire dtype, and, for the built-in engine as the receiver, the same engine
loaded in this process with those weights."""

from __future__ import annotations

import asyncio
import sys

import pytest
import ray
import torch
from ray import cloudpickle

from verl.checkpoint_engine import (
    CheckpointEngine,
    CheckpointEngineManager,
    CheckpointEngineRegistry,
    CheckpointEngineWorker,
    ColocatedCheckpointEngine,
    HCCLCheckpointEngine,
    NCCLCheckpointEngine,
    NIXLCheckpointEngine,
)
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.workers.config import CheckpointEngineConfig, FSDPEngineConfig, HFModelConfig, RolloutConfig
from verl.workers.engine_workers import TrainingWorker, TrainingWorkerConfig
from verl.workers.rollout import BaseRollout, RolloutReplica

cloudpickle.register_pickle_by_value(sys.modules[__name__])

WIRE = torch.bfloat16


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from verl.models.factory import make_tiny

    return make_tiny("tiny", str(tmp_path_factory.mktemp("tiny") / "model"), seed=0, dtype="float32")


def _prompts():
    from verl.protocol import DataProto

    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(4, 200, (3, 5), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :2] = 0  # left padding
    input_ids[1, :2] = 0
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(
        tensors={"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
        meta_info={"eos_token_id": 3, "pad_token_id": 0, "do_sample": False},
    )


# ---------------------------------------------------------------- the workers, as upstream's test writes them
class Trainer(TrainingWorker):
    def __init__(self, config, checkpoint_engine_config) -> None:
        super().__init__(config)
        backend = checkpoint_engine_config.backend
        options = checkpoint_engine_config.engine_kwargs.get(backend, {})
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            backend,
            is_master=torch.distributed.get_rank() == 0,
            bucket_size=checkpoint_engine_config.update_weights_bucket_megabytes << 20,
            **options,
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self):
        per_tensor_param, _ = self.engine.get_per_tensor_param()
        await self.checkpoint_engine.send_weights(per_tensor_param)

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def perturb(self, step: float):
        """Change the weights as a training step would (every rank alike, as after an all-reduce)."""
        with torch.no_grad():
            for i, p in enumerate(self.engine.module.parameters()):
                p.add_(step * (i + 1))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def exported(self):
        return {name: t.clone() for name, t in self.engine.iter_hf_params(WIRE)}


class RecordingAdapter(BaseRollout):
    """An upstream-style server adapter: async update_weights over the received stream."""

    def __init__(self, config, model_config):
        super().__init__(config, model_config, device_mesh=None)
        self.received = {}
        self.released = False

    async def resume(self, tags):
        self.released = False

    async def release(self):
        self.released = True

    async def update_weights(self, weights, **kwargs):
        async for name, tensor in weights:
            self.received[name] = tensor.clone()


class Rollout(CheckpointEngineWorker):
    def __init__(self, rollout_config, model_config, record: bool = True):
        adapter = RecordingAdapter(rollout_config, model_config) if record else None
        super().__init__(rollout_config, model_config, adapter)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def received(self):
        return self.server_adapter.received

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def generate(self, prompts):
        return self.server_adapter.generate_sequences(prompts)


class Replica(RolloutReplica):
    async def launch_servers(self):
        pass  # the rollout workers are the servers

    def get_ray_class_with_init_args(self):
        raise NotImplementedError


@pytest.fixture
def started(ray_session):
    """Worker groups a test starts, killed (and their pools freed) when it ends."""
    groups = []
    yield groups
    for wg, pool in groups:
        wg.shutdown()
        pool.remove_placement_groups()


def _trainer(tiny_path, ce_config, pool):
    config = TrainingWorkerConfig(
        model_type="language_model",
        model_config=HFModelConfig(path=tiny_path),
        engine_config=FSDPEngineConfig(forward_only=True, fsdp_size=-1, dtype="auto"),
    )
    wg = RayWorkerGroup(
        resource_pool=pool,
        ray_cls_with_init=RayClassWithInitArgs(
            cls=ray.remote(Trainer), config=config, checkpoint_engine_config=ce_config
        ),
    )
    wg.reset()
    return wg


def _rollout(tiny_path, rollout_config, pool, record=True):
    wg = RayWorkerGroup(
        resource_pool=pool,
        ray_cls_with_init=RayClassWithInitArgs(
            cls=ray.remote(Rollout),
            rollout_config=rollout_config,
            model_config=HFModelConfig(path=tiny_path),
            record=record,
        ),
    )
    width = Replica(replica_rank=0, config=rollout_config, model_config=None).world_size
    replicas = [
        Replica(replica_rank=r, config=rollout_config, model_config=None) for r in range(wg.world_size // width)
    ]

    async def place():
        await asyncio.gather(*[replica.init_hybrid(wg) for replica in replicas])

    asyncio.run(place())
    return wg, replicas


def _assert_same(received: dict, expected: dict):
    assert list(received) == list(expected)
    for name, tensor in expected.items():
        assert received[name].dtype == WIRE, name
        assert torch.equal(received[name], tensor), name


@pytest.mark.parametrize("rebuild_group", [False, True])
def test_nccl_backend_syncs_a_two_rank_trainer_into_two_rollout_replicas(started, tiny_path, rebuild_group):
    ce_config = CheckpointEngineConfig(
        backend="nccl", update_weights_bucket_megabytes=1, engine_kwargs={"nccl": {"rebuild_group": rebuild_group}}
    )
    rollout_config = RolloutConfig(name="hf", checkpoint_engine=ce_config, tensor_model_parallel_size=1)
    pools = [RayResourcePool(process_on_nodes=[2], use_gpu=False) for _ in range(2)]
    trainer = _trainer(tiny_path, ce_config, pools[0])
    started.append((trainer, pools[0]))
    rollout, replicas = _rollout(tiny_path, rollout_config, pools[1])
    started.append((rollout, pools[1]))
    manager = CheckpointEngineManager(backend="nccl", trainer=trainer, replicas=replicas)
    for step in range(3):  # each sync carries what the trainer holds then
        trainer.perturb(1e-3 * step)
        manager.update_weights()
        expected = trainer.exported()[0]
        for received in rollout.received():
            _assert_same(received, expected)
    # the tiny model (2.07 MB in bfloat16) takes 3 buckets of 1 MB: both buffers of each side were used
    assert sum(t.numel() * t.element_size() for t in expected.values()) > 2 << 20


def test_the_built_in_engine_receives_and_generates_with_the_trainers_weights(started, tiny_path):
    from verl.workers.rollout.hf_rollout import HFRollout

    ce_config = CheckpointEngineConfig(backend="nccl", update_weights_bucket_megabytes=1)
    rollout_config = RolloutConfig(
        name="hf",
        checkpoint_engine=ce_config,
        tensor_model_parallel_size=1,
        response_length=4,
        dtype="bfloat16",
        calculate_log_probs=True,
    )
    pools = [RayResourcePool(process_on_nodes=[1], use_gpu=False) for _ in range(2)]
    trainer = _trainer(tiny_path, ce_config, pools[0])
    started.append((trainer, pools[0]))
    rollout, replicas = _rollout(tiny_path, rollout_config, pools[1], False)
    started.append((rollout, pools[1]))
    trainer.perturb(2e-3)
    CheckpointEngineManager(backend="nccl", trainer=trainer, replicas=replicas).update_weights()
    prompts = _prompts()
    got = rollout.generate(prompts)[0]

    from verl.utils.tokenizer import hf_tokenizer

    reference = HFRollout(tiny_path, config=rollout_config, tokenizer=hf_tokenizer(tiny_path))
    stale = reference.generate_sequences(prompts)
    reference.update_weights(trainer.exported()[0].items())
    want = reference.generate_sequences(prompts)
    assert torch.equal(got.batch["responses"], want.batch["responses"])
    assert torch.equal(got.batch["rollout_log_probs"], want.batch["rollout_log_probs"])
    # the perturbation shows in the log-probs, so the check above could fail
    assert not torch.equal(stale.batch["rollout_log_probs"], want.batch["rollout_log_probs"])


# ---------------------------------------------------------------- in-process pieces
def test_registry_holds_the_built_in_backends_and_a_users_own():
    assert CheckpointEngineRegistry.get("naive") is ColocatedCheckpointEngine
    assert CheckpointEngineRegistry.get("nccl") is NCCLCheckpointEngine
    assert HCCLCheckpointEngine is None and NIXLCheckpointEngine is None  # not in this build, as upstream without them

    @CheckpointEngineRegistry.register("test-mine")
    class Mine(ColocatedCheckpointEngine):
        pass

    try:
        engine = CheckpointEngineRegistry.new("test-mine", bucket_size=8)
        assert isinstance(engine, Mine) and isinstance(engine, CheckpointEngine) and engine.bucket_size == 8
    finally:
        CheckpointEngineRegistry._registry.pop("test-mine")
    with pytest.raises(ValueError, match="not registered.*naive"):
        CheckpointEngineRegistry.new("nope")


def test_naive_backend_hands_the_generator_over_in_process():
    engine = CheckpointEngineRegistry.new("naive", bucket_size=1 << 20)
    tensors = [("a", torch.ones(2)), ("b", torch.zeros(3))]
    engine.send_weights(iter(tensors))
    assert list(engine.receive_weights()) == tensors
    with pytest.raises(RuntimeError, match="nothing was sent"):
        list(engine.receive_weights())


def test_topology_puts_trainer_rank_zero_first_and_the_rollout_after_it():
    master = {"host": "h", "port": 1}
    trainer, rollout = NCCLCheckpointEngine.build_topology(3, 2, [master, None, None, None, None])
    assert trainer == {"rank": [0, -1, -1], "world_size": [3, 3, 3], "master_metadata": [master] * 3}
    assert rollout == {"rank": [1, 2], "world_size": [3, 3], "master_metadata": [master] * 2}
    with pytest.raises(ValueError, match="is_master=True"):
        NCCLCheckpointEngine.build_topology(1, 1, [None, None])


def test_a_group_of_one_sends_in_buckets_and_refuses_a_tensor_larger_than_a_bucket():
    engine = NCCLCheckpointEngine(bucket_size=64, is_master=True, rollout_dtype="float32", timeout_s=30)
    metadata = engine.prepare()
    engine.init_process_group(rank=0, world_size=1, master_metadata=metadata)
    weights = [(f"w{i}", torch.full((6,), float(i))) for i in range(5)]  # 24 bytes each: 2 per bucket
    asyncio.run(engine.send_weights(iter(weights)))
    assert engine._sent_buckets == 3
    with pytest.raises(ValueError, match="update_weights_bucket_megabytes"):
        asyncio.run(engine.send_weights(iter([("big", torch.zeros(17))])))
    with pytest.raises(RuntimeError, match="rank 0 sends"):
        asyncio.run(anext(engine.receive_weights()))
    with pytest.raises(ValueError, match="floating-point"):
        NCCLCheckpointEngine(bucket_size=8, rollout_dtype="int8")


@pytest.mark.gpu
def test_on_a_gpu_the_buckets_live_on_the_device_and_an_nccl_group_of_one_sends():
    from verl.utils import device as dev

    engine = NCCLCheckpointEngine(bucket_size=1 << 16, is_master=True, timeout_s=60)
    metadata = engine.prepare()
    assert all(buffer.device.type == dev.get_device().type for buffer in engine._buffers)
    engine.init_process_group(rank=0, world_size=1, master_metadata=metadata)
    weights = [(f"w{i}", torch.randn(4096, device=dev.get_device())) for i in range(6)]  # 8 KiB each in bf16
    asyncio.run(engine.send_weights(iter(weights)))
    assert engine._sent_buckets == 1
    assert torch.equal(engine._buffers[0][:8192].view(torch.bfloat16), weights[0][1].to(torch.bfloat16))
    engine.finalize()
