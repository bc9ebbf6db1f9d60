"""A LoRA run's megatron checkpoint resumes exactly: saved after one update at tp=2, loaded into a
model whose fresh adapters differ (another seed), the next update is bit for bit the uninterrupted
run's at tp=2, and the same to float64 rounding at tp=1 x dp=2 with the Adam state split over the
ranks; without the saved Adam state it is not. The frozen base is the original model throughout,
the `hf_model` export and the model merger write the merged weights.
(Float64 for the reason given in test_megatron_checkpoint_manager.py.)"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed_helpers import run_distributed
from tests.megatron_helpers import build_loaded_chunks, hf_state_dict, tiny_hf_model
from tests.utils.checkpoint.test_megatron_checkpoint_manager import (
    CROSS_LAYOUT_ATOL,
    OPTIM,
    _actor_config,
    _data,
    _my_rows,
    _weights,
)
from verl.model_merger.__main__ import main as merger_main

LORA = {"rank": 4, "alpha": 8, "lora_A_init_method": "kaiming", "lora_B_init_method": "zero"}
CONTENTS = {
    "save_contents": ["model", "optimizer", "extra", "hf_model"],
    "load_contents": ["model", "optimizer", "extra"],
}


def _trainer(hf_model, tp: int, mini_batch: int, seed: int, zero: bool = False):
    from megatron.core import parallel_state as mpu

    from verl.models.mcore import mcore_to_hf_named_tensors
    from verl.models.mcore.lora import apply_lora
    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager
    from verl.utils.optim import build_lr_scheduler, build_optimizer
    from verl.workers.actor.megatron_actor import MegatronPPOActor

    chunks = build_loaded_chunks(hf_model, tp=tp, dtype=hf_model.dtype)
    trained = apply_lora(chunks, LORA, seed=seed)
    shard_over = mpu.get_data_parallel_group() if zero else None
    optimizer = build_optimizer(trained, OPTIM, shard_state_over=shard_over)
    scheduler = build_lr_scheduler(optimizer, OPTIM)
    actor = MegatronPPOActor(_actor_config(mini_batch), chunks, hf_model.config, optimizer)
    manager = MegatronCheckpointManager(
        chunks,
        optimizer,
        scheduler,
        checkpoint_config=CONTENTS,
        hf_config=hf_model.config,
        hf_weights=lambda: mcore_to_hf_named_tensors(chunks, hf_model.config),
        lora_config=LORA,
    )
    return chunks, actor, scheduler, manager


def _adapters(chunks) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in chunks[0].named_parameters() if ".adapter." in n}


def _resume(rank, world_size, ckpt_dir):
    from megatron.core import parallel_state as mpu

    from verl.utils.megatron.parallel_state import destroy_model_parallel

    hf_model = tiny_hf_model("qwen2", tie_word_embeddings=True, num_layers=2).double()
    first, second = _data(1, torch.float64), _data(2, torch.float64)
    saved = f"{ckpt_dir}/global_step_1/actor"

    def second_update(actor, dp):
        actor.update_policy(copy.deepcopy(_my_rows(second, mpu.get_data_parallel_rank(), dp)))

    chunks, actor, scheduler, manager = _trainer(copy.deepcopy(hf_model), tp=2, mini_batch=8, seed=1)
    actor.update_policy(copy.deepcopy(first))
    scheduler.step()
    manager.save_checkpoint(saved, global_step=1)
    exported_at_save = _weights(chunks, hf_model.config)
    second_update(actor, 1)
    uninterrupted, uninterrupted_adapters = _weights(chunks, hf_model.config), _adapters(chunks)
    destroy_model_parallel()

    chunks, actor, scheduler, manager = _trainer(copy.deepcopy(hf_model), tp=2, mini_batch=8, seed=2)
    fresh = _adapters(chunks)
    manager.load_checkpoint(saved)
    assert max(float((fresh[n] - p).abs().max()) for n, p in _adapters(chunks).items()) > 1e-2, "loaded adapters"
    second_update(actor, 1)
    resumed, resumed_adapters = _weights(chunks, hf_model.config), _adapters(chunks)
    base = {n: p for n, p in chunks[0].named_parameters() if ".adapter." not in n}
    destroy_model_parallel()

    chunks, actor, scheduler, manager = _trainer(copy.deepcopy(hf_model), tp=1, mini_batch=4, seed=3, zero=True)
    manager.load_checkpoint(saved)
    second_update(actor, 2)
    resumed_elsewhere = _weights(chunks, hf_model.config)
    destroy_model_parallel()

    chunks, actor, scheduler, manager = _trainer(copy.deepcopy(hf_model), tp=2, mini_batch=8, seed=2)
    manager.load_contents = ["model"]
    manager.load_checkpoint(saved)
    second_update(actor, 1)
    weights_only = _weights(chunks, hf_model.config)
    destroy_model_parallel()

    for name, want in uninterrupted_adapters.items():
        assert torch.equal(resumed_adapters[name], want), (name, float((resumed_adapters[name] - want).abs().max()))
    for name, want in uninterrupted.items():
        assert torch.equal(resumed[name], want), name
        torch.testing.assert_close(resumed_elsewhere[name], want, atol=CROSS_LAYOUT_ATOL, rtol=0, msg=name)
    gap = max(float((weights_only[n] - uninterrupted[n]).abs().max()) for n in uninterrupted)
    assert gap > 1e-4, f"the Adam state should change the resumed update (weights-only resume moved {gap:.2e})"

    # the frozen base, loaded from the checkpoint, is the original model (its tp=2 shards)
    original = build_loaded_chunks(hf_model, tp=2, dtype=hf_model.dtype)
    for name, param in original[0].named_parameters():
        assert torch.equal(base[name], param), name
    destroy_model_parallel()
    if rank == 0:
        torch.save(exported_at_save, f"{ckpt_dir}/exported.pt")


def test_lora_checkpoint_resumes_exactly_and_merges_into_the_merged_weights(tmp_path):
    run_distributed(_resume, 2, str(tmp_path))
    actor = tmp_path / "global_step_1" / "actor"
    assert json.loads((actor / "lora_config.json").read_text()) == LORA
    exported = torch.load(tmp_path / "exported.pt")
    base = hf_state_dict(tiny_hf_model("qwen2", tie_word_embeddings=True, num_layers=2).double())
    moved = max(float((exported[n] - base[n]).abs().max()) for n in base)
    assert moved > 1e-4, f"the merged weights should differ from the base ({moved:.2e})"
    saved_hf = load_file(actor / "huggingface" / "model.safetensors")
    assert sorted(saved_hf) == sorted(exported)
    for name, tensor in exported.items():
        assert torch.equal(saved_hf[name], tensor), name

    merger_main(["merge", "--backend", "megatron", "--local_dir", str(actor), "--target_dir", str(tmp_path / "hf")])
    merged = load_file(tmp_path / "hf" / "model.safetensors")
    for name, tensor in exported.items():
        assert torch.equal(merged[name], tensor), name


MOE_LORA = {"rank": 2, "alpha": 4, "lora_A_init_method": "xavier", "lora_B_init_method": "kaiming"}


def _moe_save_at_ep2_load_at_ep1(rank, world_size, ckpt_dir):
    """Expert adapters are sharded by global expert in dist_ckpt: saved at ep=2, loaded at ep=1 (fresh
    adapters of another seed before), they are the saved ones and export the same merged weights."""
    from tests.megatron_helpers import tiny_moe_hf_model
    from tests.models.mcore.test_mcore_lora_moe import whole_adapters
    from verl.models.mcore import mcore_to_hf_named_tensors
    from verl.models.mcore.lora import apply_lora
    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager
    from verl.utils.megatron.parallel_state import destroy_model_parallel

    hf_model = tiny_moe_hf_model(num_layers=2)
    contents = {"save_contents": ["model"], "load_contents": ["model"]}

    def build(ep, seed):
        chunks = build_loaded_chunks(hf_model, ep=ep)
        apply_lora(chunks, MOE_LORA, seed=seed)
        manager = MegatronCheckpointManager(
            chunks, checkpoint_config=contents, hf_config=hf_model.config, lora_config=MOE_LORA
        )
        return chunks, manager

    chunks, manager = build(ep=2, seed=1)
    saved_adapters = whole_adapters(chunks)
    saved_export = dict(mcore_to_hf_named_tensors(chunks, hf_model.config))
    manager.save_checkpoint(f"{ckpt_dir}/global_step_1/actor", global_step=1)
    destroy_model_parallel()

    chunks, manager = build(ep=1, seed=2)
    fresh = whole_adapters(chunks)
    manager.load_checkpoint(f"{ckpt_dir}/global_step_1/actor")
    loaded = whole_adapters(chunks)
    assert sorted(loaded) == sorted(saved_adapters) and sum(".experts." in k for k in loaded) == 2 * 2 * 4
    for key, (a, b) in saved_adapters.items():
        assert torch.equal(loaded[key][0], a) and torch.equal(loaded[key][1], b), key
        assert not torch.equal(fresh[key][0], a), f"{key}: the fresh adapters should differ before loading"
    for name, tensor in mcore_to_hf_named_tensors(chunks, hf_model.config):
        assert torch.equal(tensor, saved_export[name]), name
    destroy_model_parallel()
    if rank == 0:
        torch.save(saved_export, f"{ckpt_dir}/exported.pt")


@pytest.mark.slow
def test_moe_expert_adapters_saved_at_ep2_load_at_ep1_and_merge(tmp_path):
    run_distributed(_moe_save_at_ep2_load_at_ep1, 2, str(tmp_path))
    actor = tmp_path / "global_step_1" / "actor"
    exported = torch.load(tmp_path / "exported.pt")
    merger_main(["merge", "--backend", "megatron", "--local_dir", str(actor), "--target_dir", str(tmp_path / "hf")])
    merged = load_file(tmp_path / "hf" / "model.safetensors")
    # transformers writes the 3-D expert tensors in the checkpoint's per-expert layout
    for name in [n for n in exported if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        prefix, fused = name.rsplit(".", 1)
        for e, tensor in enumerate(exported.pop(name)):
            if fused == "down_proj":
                exported[f"{prefix}.{e}.down_proj.weight"] = tensor
            else:
                exported[f"{prefix}.{e}.gate_proj.weight"], exported[f"{prefix}.{e}.up_proj.weight"] = tensor.chunk(2)
    assert sorted(merged) == sorted(exported)
    for name, tensor in exported.items():
        assert torch.equal(merged[name], tensor), name
