"""The training-engine interface: the registry's table and errors, and the FSDP engine in one process
(a world of one, so a small model is held as a plain replica: no process group needed)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from verl.workers.engine import (
    BaseEngine,
    EngineRegistry,
    FSDPEngineWithLMHead,
    FSDPEngineWithValueHead,
    MegatronEngineWithLMHead,
    MegatronEngineWithValueHead,
)


def test_registry_maps_model_type_and_strategy_to_sibling_engines():
    assert EngineRegistry.get_engine_cls("language_model", "fsdp") is FSDPEngineWithLMHead
    assert EngineRegistry.get_engine_cls("language_model", "fsdp2") is FSDPEngineWithLMHead
    assert EngineRegistry.get_engine_cls("value_model", "fsdp") is FSDPEngineWithValueHead
    assert EngineRegistry.get_engine_cls("language_model", "megatron") is MegatronEngineWithLMHead
    assert EngineRegistry.get_engine_cls("value_model", "megatron") is MegatronEngineWithValueHead
    # siblings behind one interface: neither backend borrows from the other
    shared = set(FSDPEngineWithValueHead.__mro__) & set(MegatronEngineWithValueHead.__mro__)
    assert shared == set(BaseEngine.__mro__), shared


def test_registry_names_the_registered_pairs_for_an_unknown_strategy():
    with pytest.raises(ValueError, match=r"strategy\) 'deepspeed'.*language_model/fsdp.*value_model/megatron"):
        EngineRegistry.new("language_model", "deepspeed")


def test_registering_another_engine_under_a_taken_key_fails():
    with pytest.raises(ValueError, match="already registered"):

        @EngineRegistry.register(model_type="language_model", backend="fsdp")
        class _Other(FSDPEngineWithLMHead):
            pass

    assert EngineRegistry.get_engine_cls("language_model", "fsdp") is FSDPEngineWithLMHead


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from verl.models.factory import make_tiny

    return make_tiny("tiny", str(tmp_path_factory.mktemp("tiny") / "model"), seed=0, dtype="float32")


def _plain_replica_config() -> dict:
    return {"fsdp_size": -1, "dtype": "auto"}  # a small fp32 model: a plain replica, no FSDP wrap


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_fsdp_engine_exports_the_checkpoint_weights_and_steps_its_schedule(tiny_path):
    import os

    optim = {"lr": 1e-3, "lr_warmup_steps": 2, "total_training_steps": 4}
    engine = EngineRegistry.new(
        "language_model", "fsdp", OmegaConf.create({"path": tiny_path}), _plain_replica_config(), optim
    )
    stored = load_file(os.path.join(tiny_path, "model.safetensors"))
    exported = dict(engine.iter_hf_params())
    for name, tensor in stored.items():
        assert torch.equal(exported[name], tensor), name
    halves = dict(engine.iter_hf_params(torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in halves.values() if t.is_floating_point())
    # upstream's form: (generator, peft_config), the peft config None (no LoRA here; merged weights with it)
    per_tensor, peft_config = engine.get_per_tensor_param()
    assert peft_config is None
    assert [name for name, _ in per_tensor] == list(exported)
    per_tensor, _ = engine.get_per_tensor_param(layered_summon=True, base_sync_done=True, dtype=torch.bfloat16)
    assert all(torch.equal(t, halves[name]) for name, t in per_tensor)
    assert all(p.requires_grad for p in engine.module.parameters())
    # linear warmup over 2 steps: the lr each step used, then the step advances it
    assert [engine.lr_scheduler_step() for _ in range(3)] == pytest.approx([0.0, 5e-4, 1e-3])
    engine.eval_mode()
    assert not engine.module.training
    engine.train_mode()
    assert engine.module.training
    with engine.on_device(optimizer=True), engine.disable_adapter():  # no offload, no LoRA: no-ops
        pass


def test_a_frozen_engine_refuses_the_training_methods(tiny_path):
    engine = FSDPEngineWithLMHead(OmegaConf.create({"path": tiny_path}), _plain_replica_config())
    assert engine.optimizer is None and not any(p.requires_grad for p in engine.module.parameters())
    for call in (engine.lr_scheduler_step, lambda: engine.save_checkpoint("/nonexistent")):
        with pytest.raises(RuntimeError, match="built without an optimizer_config"):
            call()


@pytest.mark.parametrize("model_dtype", ["bf16", "fp32"])
def test_fsdp_config_model_dtype_is_the_dtype_the_weights_are_held_in(tiny_path, model_dtype):
    """The checkpoint is float32; model_dtype decides what the engine (and its optimizer) holds."""
    import os

    cfg = {**_plain_replica_config(), "model_dtype": model_dtype}
    engine = FSDPEngineWithLMHead(OmegaConf.create({"path": tiny_path}), cfg, {"lr": 1e-3})
    expected = {"bf16": torch.bfloat16, "fp32": torch.float32}[model_dtype]
    assert {p.dtype for p in engine.module.parameters()} == {expected}
    stored = load_file(os.path.join(tiny_path, "model.safetensors"))
    exported = dict(engine.iter_hf_params())
    for name, tensor in stored.items():  # the checkpoint's values, rounded to model_dtype
        assert torch.equal(exported[name], tensor.to(expected)), name


def test_the_value_engine_has_a_one_output_head(tiny_path):
    engine = FSDPEngineWithValueHead(OmegaConf.create({"path": tiny_path}), _plain_replica_config())
    params = dict(engine.iter_hf_params())
    assert params["score.weight"].shape == (1, engine.hf_config.hidden_size)
    assert not any(name.startswith("lm_head") for name in params)
