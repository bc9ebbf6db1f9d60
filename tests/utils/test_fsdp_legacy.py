"""Upstream's legacy-worker FSDP helpers (`verl.utils.fsdp_legacy`, re-exported by `fsdp_utils`):
model-building contexts, FSDP1/FSDP2 loading and offload, LoRA collection for the rollout."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.utils.save_and_load import get_peft_model_state_dict

from tests.distributed_helpers import make_ppo_batch, make_tiny_causal_lm, one_thread, run_distributed
from verl.utils import fsdp_utils

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

LORA = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"], "init_lora_weights": False}


def tiny_peft_model(seed: int = 0):
    torch.manual_seed(seed + 7)  # init_lora_weights=False: random A and B, so adapters differ from zero
    return get_peft_model(make_tiny_causal_lm(seed), LoraConfig(task_type="CAUSAL_LM", **LORA))


def test_shard_placement_picks_the_first_dimension_the_group_size_divides():
    place = fsdp_utils.get_shard_placement_fn(fsdp_size=4)
    assert place(torch.empty(6, 8)).dim == 1
    assert place(torch.empty(8, 6)).dim == 0
    assert place(torch.empty(3, 5)).dim == 0  # none divides: dimension 0, padded


def test_a_plain_module_is_fsdp_version_zero():
    assert fsdp_utils.fsdp_version(torch.nn.Linear(2, 2)) == 0


def test_replace_lora_wrapper_names_base_weights_inside_lora_layers():
    config = LoraConfig(target_modules=["fc_in"], exclude_modules=["model.layers.1.self_attn.q_proj"])
    rename = fsdp_utils.replace_lora_wrapper
    assert (
        rename("model.layers.0.self_attn.q_proj.weight", config) == "model.layers.0.self_attn.q_proj.base_layer.weight"
    )
    assert rename("model.layers.0.mlp.fc_in.bias", config) == "model.layers.0.mlp.fc_in.base_layer.bias"
    assert rename("model.layers.1.self_attn.q_proj.weight", config) == "model.layers.1.self_attn.q_proj.weight"
    assert rename("model.norm.weight", config) == "model.norm.weight"
    assert rename("model.layers.0.self_attn.rotary.inv_freq", config) == "model.layers.0.self_attn.rotary.inv_freq"


def test_collect_lora_params_of_an_unsharded_model_gives_adapters_or_base_weights():
    base = make_tiny_causal_lm(0)
    model = tiny_peft_model(0)
    adapters = fsdp_utils.collect_lora_params(model, layered_summon=False, base_sync_done=True)
    expected = get_peft_model_state_dict(model)
    assert list(adapters) == list(expected) and len(adapters) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
    assert all(torch.equal(adapters[k], expected[k]) for k in expected)
    weights = fsdp_utils.collect_lora_params(model, layered_summon=False, base_sync_done=False)
    assert list(weights) == list(base.state_dict())  # HF names: no lora_ entries, `.base_layer` dropped
    assert all(torch.equal(weights[k], v) for k, v in base.state_dict().items())


def _two_rank_legacy_helpers(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from tests.distributed_helpers import tiny_qwen2_config

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))

    def build(seed):  # as a worker builds it: in the checkpoint's dtype (buffers keep theirs)
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(tiny_qwen2_config(), attn_implementation="sdpa", dtype=torch.float64)

    reference = build(3)

    # the checkpoint is read on rank 0 only: the others build on the meta device
    for with_mesh in (None, mesh):
        with fsdp_utils.get_init_weight_context_manager(use_meta_tensor=True, mesh=with_mesh)():
            built = torch.nn.Linear(2, 2)
        assert built.weight.device.type == ("cpu" if rank == 0 else "meta")
    with fsdp_utils.get_init_weight_context_manager(use_meta_tensor=False)():
        assert torch.nn.Linear(2, 2).weight.device.type == "cpu"

    # upstream's FSDP2 build: apply_fsdp2(model, fsdp_kwargs, config) then fsdp2_load_full_state_dict
    for offload in (None, fsdp_utils.CPUOffloadPolicy(pin_memory=False)):
        with fsdp_utils.get_init_weight_context_manager()():
            model = build(3 if rank == 0 else 4)  # rank 1's random init never shows: it is on the meta device
        full_state = model.state_dict()
        fsdp_kwargs = {
            "mesh": mesh,
            "mp_policy": fsdp_utils.MixedPrecisionPolicy(),
            "offload_policy": offload,
            "reshard_after_forward": True,
            "shard_placement_fn": fsdp_utils.get_shard_placement_fn(fsdp_size=world_size),
        }
        fsdp_utils.apply_fsdp2(model, fsdp_kwargs, {"wrap_policy": {"transformer_layer_cls_to_wrap": None}})
        fsdp_utils.fsdp2_load_full_state_dict(model, full_state, mesh, offload)
        assert fsdp_utils.fsdp_version(model) == 2 and fsdp_utils.fsdp_version(model.model.layers[0]) == 2
        # shard_placement_fn: the [64, 64] projections split on dim 0, the [40, 64] embedding too (2 | 40)
        assert model.model.layers[0].self_attn.q_proj.weight.to_local().shape == (32, 64)
        for name, tensor in fsdp_utils.iter_full_params(model):
            assert torch.equal(tensor, reference.state_dict()[name]), name
        for (name, buffer), expected in zip(model.named_buffers(), reference.buffers()):
            assert torch.equal(buffer, expected), name  # rotary inv_freq: in no state dict, broadcast
        batch = make_ppo_batch(batch_size=2, seed=rank)
        logits = model(input_ids=batch["input_ids"], use_cache=False).logits
        torch.testing.assert_close(logits, reference(input_ids=batch["input_ids"], use_cache=False).logits)

    # FSDP1 (torch's) on CPU; offload and load-back keep the flat shards and the outputs
    from verl.workers.fsdp_workers import get_sharding_strategy

    plain = make_tiny_causal_lm(seed=3)
    fsdp1 = FSDP(
        plain,
        auto_wrap_policy=fsdp_utils.get_fsdp_wrap_policy(plain),  # each decoder layer a unit of its own
        sharding_strategy=get_sharding_strategy(mesh),
        device_id=torch.device("cpu"),  # torch's FSDP1 looks for an accelerator unless told the CPU
        use_orig_params=False,
    )
    assert fsdp_utils.fsdp_version(fsdp1) == 1
    ids = make_ppo_batch(batch_size=2, seed=rank)["input_ids"]
    before = fsdp1(input_ids=ids, use_cache=False).logits.detach()
    fsdp_utils.offload_fsdp_model_to_cpu(fsdp1)
    fsdp_utils.load_fsdp_model_to_gpu(fsdp1)
    handle = fsdp1._all_handles[0]
    assert handle.flat_param._local_shard.data_ptr() == handle.flat_param.data.data_ptr()
    torch.testing.assert_close(fsdp1(input_ids=ids, use_cache=False).logits, before, atol=0, rtol=0)
    with pytest.raises(ValueError, match="root"):
        fsdp_utils.offload_fsdp_model_to_cpu(next(m for m in fsdp1.modules() if isinstance(m, FSDP) and m is not fsdp1))

    # init_fn: FSDP1's param_init_fn allocates a meta module's own tensors (not its children's) on ranks > 0
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(2, 2))
    fsdp_utils.init_fn(meta)
    assert meta[0].weight.device.type == "meta"  # a child: FSDP calls init_fn on it separately
    assert fsdp_utils.init_fn(meta[0]).weight.device.type == ("meta" if rank == 0 else "cpu")

    # LoRA adapters of an FSDP2-sharded PEFT model: whole, or gathered layer by layer
    peft_reference = tiny_peft_model(seed=5)
    expected = get_peft_model_state_dict(peft_reference)
    sharded = fsdp_utils.apply_fsdp2(tiny_peft_model(seed=5), device_mesh=mesh)
    whole = fsdp_utils.collect_lora_params(sharded, layered_summon=False, base_sync_done=True)
    layered = fsdp_utils.collect_lora_params(sharded, layered_summon=True, base_sync_done=True)
    for got in (whole, layered):
        assert sorted(got) == sorted(expected)
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    with pytest.raises(ValueError, match="preloaded"):  # layered summoning sends adapters only
        fsdp_utils.collect_lora_params(sharded, layered_summon=True, base_sync_done=False)
    base = fsdp_utils.collect_lora_params(sharded, layered_summon=False, base_sync_done=False)
    assert all(torch.equal(base[k], v) for k, v in make_tiny_causal_lm(seed=5).state_dict().items())
    dist.barrier()


def test_legacy_helpers_on_two_ranks():
    run_distributed(_two_rank_legacy_helpers, 2)
