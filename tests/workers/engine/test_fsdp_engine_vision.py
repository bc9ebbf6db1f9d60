"""The FSDP engine with a vision-language model (the tiny-vl and tiny-qwen3-vl presets): loading, freeze_vision_tower, checkpoints.

One process (a small fp32 model is a plain replica, as in test_training_engines), plus one 2-rank
gloo run that shards the vision blocks and decoder layers with FSDP2.
"""

from __future__ import annotations

import os

import pytest
import torch
from omegaconf import OmegaConf

from tests.distributed_helpers import one_thread, run_distributed
from tests.workers.actor.test_dp_actor_vision import actor_config, make_vl_batch
from verl.workers.actor import DataParallelPPOActor
from verl.workers.engine import FSDPEngineWithLMHead, FSDPEngineWithValueHead

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

OPTIM = {"lr": 1e-2, "weight_decay": 0.0}


@pytest.fixture(scope="module", params=["tiny-vl", "tiny-qwen3-vl", "tiny-qwen3-vl-moe"])
def vl_path(request, tmp_path_factory):
    from verl.models.factory import make_tiny

    return make_tiny(request.param, str(tmp_path_factory.mktemp(request.param)))


def _engine(path, freeze_vision_tower=False, checkpoint=None, fsdp_size=-1):
    return FSDPEngineWithLMHead(
        OmegaConf.create({"path": path}),
        {"fsdp_size": fsdp_size, "dtype": "auto"},
        OPTIM,
        checkpoint,
        freeze_vision_tower=freeze_vision_tower,
    )


def _update_once(engine, seed=0):
    from verl.utils.tokenizer import hf_processor

    processor = hf_processor(engine.hf_config._name_or_path)
    data, _ = make_vl_batch(processor, engine.hf_config, seed=seed)
    data.batch["advantages"] = data.batch["advantages"].float()
    data.batch["response_mask"] = data.batch["response_mask"].float()
    actor = DataParallelPPOActor(actor_config(use_remove_padding=True), engine.module, engine.optimizer)
    metrics = actor.update_policy(data)
    assert metrics["actor/skipped_nonfinite_grad"] == [0.0]


def _snapshot(module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def test_vl_model_loads_as_image_text_to_text_with_the_hf_state_dict_names(vl_path):
    from transformers import AutoModelForImageTextToText

    engine = _engine(vl_path)
    family = {"qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL", "qwen3_vl_moe": "Qwen3VLMoe"}[
        engine.module.config.model_type
    ]
    assert type(engine.module).__name__ == f"{family}ForConditionalGeneration"
    # transformers 5 converts the on-disk names (`visual.*`, `model.layers.*`) to its own at load time: the
    # rollout receives the loaded model's state-dict names (`model.visual.*`, `model.language_model.*`)
    expected = AutoModelForImageTextToText.from_pretrained(vl_path).state_dict()
    exported = dict(engine.iter_hf_params())
    assert exported.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name
    assert "lm_head.weight" in exported
    assert any(n.startswith("model.visual.blocks.") for n in exported)
    assert any(n.startswith("model.language_model.layers.") for n in exported)


@pytest.mark.parametrize("freeze", [True, False])
def test_freeze_vision_tower_keeps_the_tower_bit_equal_while_the_decoder_moves(vl_path, freeze):
    engine = _engine(vl_path, freeze_vision_tower=freeze)
    visual = {id(p) for p in engine.module.model.visual.parameters()}
    in_optimizer = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    assert (visual & in_optimizer == set()) == freeze  # frozen: no optimizer state for the tower
    before = _snapshot(engine.module)
    _update_once(engine)
    after = _snapshot(engine.module)
    tower = [n for n in before if n.startswith("model.visual.")]
    decoder = [n for n in before if n.startswith("model.language_model.layers.")]
    assert all(not torch.equal(before[n], after[n]) for n in decoder)
    moved = [n for n in tower if not torch.equal(before[n], after[n])]
    if freeze:
        assert moved == []
        assert not any(engine.optimizer.state.get(p) for p in engine.module.model.visual.parameters())
    else:
        assert moved, "the vision tower should train when not frozen"


def test_freeze_vision_tower_on_a_text_model_says_what_to_change(tmp_path):
    from verl.models.factory import make_tiny

    path = make_tiny("tiny", str(tmp_path / "tiny"))
    with pytest.raises(ValueError, match="no vision tower.*freeze_vision_tower=false"):
        _engine(path, freeze_vision_tower=True)


def test_the_value_engine_puts_a_one_output_head_over_the_image_text_backbone(vl_path):
    engine = FSDPEngineWithValueHead(OmegaConf.create({"path": vl_path}), {"fsdp_size": -1, "dtype": "auto"}, OPTIM)
    params = dict(engine.iter_hf_params())
    assert params["score.weight"].shape == (1, engine.hf_config.text_config.hidden_size)
    assert any(n.startswith("model.visual.blocks.") for n in params) and "lm_head.weight" not in params


def test_a_vision_language_critic_checkpoint_merges_to_a_loadable_value_model(vl_path, tmp_path):
    from verl.model_merger.__main__ import main as merger_main
    from verl.utils.model import load_valuehead_model

    checkpoint = {"save_contents": ["model", "optimizer", "extra", "hf_model"]}
    engine = FSDPEngineWithValueHead(
        OmegaConf.create({"path": vl_path}), {"fsdp_size": -1, "dtype": "auto"}, OPTIM, checkpoint
    )
    ckpt = str(tmp_path / "global_step_1" / "critic")
    engine.save_checkpoint(ckpt, global_step=1)
    assert engine.finish_checkpoint()
    merged_dir = str(tmp_path / "merged")
    merger_main(["merge", "--backend", "fsdp", "--local_dir", ckpt, "--target_dir", merged_dir])
    merged = load_valuehead_model(merged_dir)
    saved = engine.module.state_dict()
    assert merged.state_dict().keys() == saved.keys()
    for name, tensor in merged.state_dict().items():
        assert torch.equal(tensor, saved[name]), name


def test_checkpoint_resumes_bit_exact_and_exports_a_loadable_vl_directory(vl_path, tmp_path):
    from transformers import AutoModelForImageTextToText

    from verl.model_merger.__main__ import main as merger_main
    from verl.utils.tokenizer import hf_processor

    checkpoint = {"save_contents": ["model", "optimizer", "extra", "hf_model"]}
    engine = _engine(vl_path, checkpoint=checkpoint)
    _update_once(engine)
    saved = _snapshot(engine.module)
    ckpt = str(tmp_path / "global_step_1" / "actor")
    engine.save_checkpoint(ckpt, global_step=1)
    assert engine.finish_checkpoint()
    _update_once(engine, seed=1)  # moves the weights and Adam state away from the checkpoint
    resumed = _engine(vl_path, checkpoint=checkpoint)
    resumed.load_checkpoint(ckpt)
    for name, tensor in _snapshot(resumed.module).items():
        assert torch.equal(tensor, saved[name]), name
    # the same next update from the restored Adam state as from the saved run's
    engine.load_checkpoint(ckpt)
    _update_once(engine, seed=1)
    _update_once(resumed, seed=1)
    for name, tensor in _snapshot(resumed.module).items():
        assert torch.equal(tensor, engine.module.state_dict()[name]), name

    hf_dir = os.path.join(ckpt, "huggingface")
    merged_dir = str(tmp_path / "merged")
    merger_main(["merge", "--backend", "fsdp", "--local_dir", ckpt, "--target_dir", merged_dir])
    for directory in (hf_dir, merged_dir):
        processor = hf_processor(directory)
        assert processor is not None and processor.image_token == "<|image_pad|>", directory
        model = AutoModelForImageTextToText.from_pretrained(directory)
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, saved[name]), (directory, name)


def _two_rank_frozen_update(rank, world_size, path):
    """FSDP2 over 2 ranks: vision blocks and decoder layers are units of their own; the frozen tower
    has no optimizer state and stays bit-equal through an update while the decoder moves."""
    from torch.distributed.fsdp import FSDPModule

    engine = _engine(path, freeze_vision_tower=True, fsdp_size=2)
    assert isinstance(engine.module, FSDPModule)
    assert isinstance(engine.module.model.visual.blocks[0], FSDPModule)
    assert isinstance(engine.module.model.language_model.layers[0], FSDPModule)
    before = dict(engine.iter_hf_params())
    _update_once(engine)
    after = dict(engine.iter_hf_params())
    assert not any(engine.optimizer.state.get(p) for p in engine.module.model.visual.parameters())
    for name, tensor in after.items():
        assert torch.equal(tensor, before[name]) == name.startswith("model.visual."), name


@pytest.mark.slow
def test_fsdp2_shards_the_vision_blocks_and_freezes_the_tower_on_two_ranks(vl_path):
    run_distributed(_two_rank_frozen_update, 2, vl_path)


def test_the_fsdp_worker_hands_freeze_vision_tower_to_the_actor_engine_only():
    from types import SimpleNamespace

    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    worker = SimpleNamespace(actor_config=OmegaConf.create({"freeze_vision_tower": True}))
    assert ActorRolloutRefWorker._engine_options(worker, "actor") == {"freeze_vision_tower": True}
    assert ActorRolloutRefWorker._engine_options(worker, "ref") == {}
    worker.actor_config.freeze_vision_tower = False
    assert ActorRolloutRefWorker._engine_options(worker, "actor") == {"freeze_vision_tower": False}
