"""`BaseRollout` takes both kinds of subclass: this build's engines (sync `sleep` / `wake_up`) and upstream's
server adapters (`(config, model_config, device_mesh)`, async `update_weights`, `resume(tags)`, `release()`),
whose `sleep` / `wake_up` then run `release` / `resume`; and upstream's rollout-replica lookups."""

from __future__ import annotations

import asyncio

import pytest

from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout import BaseRollout, RolloutReplica, get_rollout_class
from verl.workers.rollout.replica import RolloutReplicaRegistry, TokenOutput, get_rollout_replica_class


class UpstreamStyle(BaseRollout):
    def __init__(self, config, model_config):
        super().__init__(config, model_config, device_mesh=None)
        self.calls = []

    async def resume(self, tags):
        self.calls.append(("resume", tuple(tags)))

    async def release(self):
        self.calls.append(("release",))

    async def update_weights(self, weights, **kwargs):
        self.calls.append(("update", [name async for name, _ in weights]))


class EngineStyle(BaseRollout):
    def __init__(self):
        self.calls = []

    def update_weights(self, named_tensors, **kwargs):
        return {}

    def sleep(self):
        self.calls.append("sleep")

    def wake_up(self):
        self.calls.append("wake_up")


def test_an_upstream_style_adapter_sleeps_and_wakes_through_release_and_resume():
    adapter = UpstreamStyle({"name": "hf"}, HFModelConfig(path="/m"))
    assert isinstance(adapter.config, RolloutConfig) and adapter.config.name == "hf"
    assert adapter.model_config.path == "/m" and adapter.device_mesh is None
    adapter.sleep()
    adapter.wake_up()
    assert adapter.calls == [("release",), ("resume", ("weights", "kv_cache"))]
    with pytest.raises(NotImplementedError, match="generate_sequences"):
        adapter.generate_sequences(None)


def test_an_engine_style_rollout_gets_upstreams_names_for_its_own_calls():
    engine = EngineStyle()
    engine.resume(["weights"])
    engine.release()
    assert engine.calls == ["wake_up", "sleep"]


def test_a_rollout_with_neither_pair_says_what_to_implement():
    class Bare(BaseRollout):
        def update_weights(self, named_tensors, **kwargs):
            return {}

    with pytest.raises(NotImplementedError, match="neither sleep"):
        Bare().sleep()
    with pytest.raises(NotImplementedError, match="neither wake_up"):
        Bare().wake_up()


def test_replica_lookups_and_placement_slices():
    assert get_rollout_class("hf", "async") is get_rollout_class("hf")
    with pytest.raises(NotImplementedError, match="not part of this build"):
        get_rollout_replica_class("vllm")
    with pytest.raises(ValueError, match="Unknown rollout mode"):
        get_rollout_replica_class("nope")

    class Mine(RolloutReplica):
        async def launch_servers(self):
            self.servers = list(self.workers)

        def get_ray_class_with_init_args(self):
            raise NotImplementedError

    RolloutReplicaRegistry.register("test-mine", lambda: Mine)
    try:
        assert get_rollout_replica_class("test-mine") is Mine
    finally:
        RolloutReplicaRegistry._registry.pop("test-mine")

    class Group:  # what init_hybrid reads of a worker group
        workers = ["w0", "w1", "w2", "w3"]

    config = RolloutConfig(name="hf", tensor_model_parallel_size=2)
    replicas = [Mine(replica_rank=r, config=config, model_config=None) for r in range(2)]
    asyncio.run(replicas[1].init_hybrid(Group()))
    assert replicas[1].world_size == 2 and replicas[1].workers == ["w2", "w3"] and replicas[1].servers == ["w2", "w3"]
    with pytest.raises(ValueError, match="needs workers 4..5"):
        asyncio.run(Mine(replica_rank=2, config=config, model_config=None).init_hybrid(Group()))
    assert TokenOutput(token_ids=[1, 2]).log_probs is None
