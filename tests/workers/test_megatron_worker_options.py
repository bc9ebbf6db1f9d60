"""The megatron workers hand each role's `load_weight` to its engine: the actor's, the reference's
(the actor's when upstream's reference section leaves it out), the critic's and the reward model's."""

from __future__ import annotations

from types import SimpleNamespace

from omegaconf import OmegaConf

from verl.workers import megatron_workers
from verl.workers.config import McoreActorConfig, McoreCriticConfig, RefConfig


def _actor_worker(actor_loads: bool, ref_section: dict):
    return SimpleNamespace(
        actor_config=McoreActorConfig(load_weight=actor_loads, ppo_micro_batch_size_per_gpu=1),
        ref_config=RefConfig(**ref_section),
        config=OmegaConf.create({"ref": ref_section}),
    )


def test_each_role_gives_its_engine_its_own_load_weight():
    options = megatron_workers.ActorRolloutRefWorker._engine_options
    assert options(_actor_worker(False, {"load_weight": False}), "actor") == {"load_weight": False}
    assert options(_actor_worker(True, {"load_weight": False}), "ref") == {"load_weight": False}
    assert options(_actor_worker(False, {}), "ref") == {"load_weight": False}  # the actor's
    critic = SimpleNamespace(critic_config=McoreCriticConfig(load_weight=False))
    assert megatron_workers.CriticWorker._engine_options(critic) == {"load_weight": False}
