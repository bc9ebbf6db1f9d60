"""Upstream's megatron model helpers (`verl.utils.megatron_utils`) on 2 gloo ranks at tp=2: `get_model`
wraps our GPTModel in megatron's DDP (unwrap_model / get_model_config see through it), and
`default_tp_concat_fn` rebuilds each full weight from the two shards so that the per-tensor
converter's HF tensors equal the HF model's state dict bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_helpers import run_distributed
from tests.megatron_helpers import tiny_hf_model

LAYER_NAMES = {"qkv_layer_name": "self_attention.linear_qkv.", "gate_proj_layer_name": "linear_fc1."}


def _check_get_model_and_concat(rank, world_size):
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel

    from verl.models.mcore import build_gpt_model, get_mcore_weight_converter, hf_to_mcore_config, load_hf_state_dict
    from verl.utils.megatron.parallel_state import initialize_model_parallel
    from verl.utils.megatron.tensor_parallel import is_tensor_parallel_param
    from verl.utils.megatron_utils import default_tp_concat_fn, get_model, get_model_config, unwrap_model

    initialize_model_parallel(tensor_model_parallel_size=world_size)
    hf = tiny_hf_model("qwen2", tie_word_embeddings=False)
    tf_config = hf_to_mcore_config(hf.config, {"tensor_model_parallel_size": world_size}, torch.float32)

    def provider(pre_process, post_process, vp_stage=None):
        return build_gpt_model(hf.config, tf_config, pre_process, post_process, vp_stage)

    chunks = get_model(provider, use_distributed_optimizer=False)
    assert len(chunks) == 1 and isinstance(chunks[0], DistributedDataParallel)
    inner = unwrap_model(chunks[0])
    assert type(inner).__name__ == "GPTModel" and unwrap_model(chunks)[0] is inner
    assert get_model_config(chunks[0]) is inner.config
    load_hf_state_dict([inner], dict(hf.state_dict()), hf.config)

    converter = get_mcore_weight_converter(hf.config, torch.float32)
    want = hf.state_dict()
    seen = set()
    group = mpu.get_tensor_model_parallel_group()
    for name, param in inner.named_parameters():
        if is_tensor_parallel_param(param):
            shards = [torch.empty_like(param) for _ in range(world_size)]
            dist.all_gather(shards, param.detach().contiguous(), group=group)
            full = default_tp_concat_fn(
                LAYER_NAMES, name, param, shards, hf.config, hf.config, convert_qkv_gate_up_by_simple_split=True
            )
        else:
            full = param.detach()
        parts = full if isinstance(full, list) else [full]
        for hf_name, tensor in zip(*converter.convert_param(name, parts), strict=True):
            if hf_name == "lm_head.weight" or hf_name == "model.embed_tokens.weight":
                tensor = tensor[: hf.config.vocab_size]  # tp pads the vocabulary rows
            torch.testing.assert_close(tensor, want[hf_name], atol=0, rtol=0, msg=hf_name)
            seen.add(hf_name)
    assert seen == set(want)


def test_get_model_wraps_in_ddp_and_tp_concat_rebuilds_hf_weights_exactly():
    pytest.importorskip("megatron.core")
    run_distributed(_check_get_model_and_concat, 2)


def test_tp_concat_fn_regroups_qkv_and_gate_up_by_hand():
    """Two shards of a 4-head / 2-group fused qkv (head size 1): shard r holds group r's [q, q, k, v]
    rows; gate/up shards are [gate_r; up_r]."""
    pytest.importorskip("megatron.core")
    from types import SimpleNamespace

    from verl.utils.megatron_utils import default_tp_concat_fn

    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2)
    shards = [torch.tensor([[1.0], [2.0], [10.0], [20.0]]), torch.tensor([[3.0], [4.0], [30.0], [40.0]])]
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    fused = default_tp_concat_fn(LAYER_NAMES, name, None, shards, config)
    torch.testing.assert_close(fused[:, 0], torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0, 30.0, 20.0, 40.0]))
    q, k, v = default_tp_concat_fn(LAYER_NAMES, name, None, shards, config, convert_qkv_gate_up_by_simple_split=True)
    assert (
        q.flatten().tolist() == [1, 2, 3, 4] and k.flatten().tolist() == [10, 30] and v.flatten().tolist() == [20, 40]
    )
    gate_up = [torch.tensor([[1.0], [5.0]]), torch.tensor([[2.0], [6.0]])]
    merged = default_tp_concat_fn(LAYER_NAMES, "decoder.layers.0.mlp.linear_fc1.weight", None, gate_up, config)
    assert merged.flatten().tolist() == [1, 2, 5, 6]
    with pytest.raises(ValueError, match="not divisible by 4"):
        default_tp_concat_fn(LAYER_NAMES, name, None, [torch.zeros(5, 1), torch.zeros(5, 1)], config)
