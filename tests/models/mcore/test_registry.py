"""Upstream's `get_mcore_forward_fn` on our GPTModel: logits of a left/right-padded batch equal the HF
model's at every real token (zeros at padding), a logits processor receives its per-token arguments
at the same tokens and its outputs come back in the padded layout; `get_mcore_weight_converter`
names parts as HF does and refuses a fused tensor given whole."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_helpers import run_distributed
from tests.megatron_helpers import build_loaded_chunks, tiny_hf_model


def _batch():
    input_ids = torch.randint(3, 200, (2, 7), generator=torch.Generator().manual_seed(2))
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


def _check_forward(rank, world_size):
    from verl.models.mcore import get_mcore_forward_fn
    from verl.utils.megatron.parallel_state import initialize_model_parallel

    initialize_model_parallel()
    hf = tiny_hf_model("qwen2").double()
    chunks = build_loaded_chunks(hf, dtype=torch.float64)
    input_ids, attention_mask, position_ids = _batch()
    with torch.no_grad():
        want = hf(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        forward = get_mcore_forward_fn(hf.config)
        got = forward(chunks[0], input_ids, attention_mask, position_ids, {})[..., : hf.config.vocab_size]
    real = attention_mask.bool()
    assert got.shape == (2, 7, hf.config.vocab_size)
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=0)  # megatron rotary runs in fp32
    assert got[~real].abs().max() == 0

    seen = {}

    def processor(logits, token_mask, marker):
        seen["mask"], seen["marker"] = token_mask, marker
        return {"top": logits.argmax(-1), "marker": marker * 2}

    marker = torch.arange(14, dtype=torch.float64).view(2, 7)
    with torch.no_grad():
        out = forward(
            chunks[0], input_ids, attention_mask, position_ids, {}, processor, {"token_mask": real, "marker": marker}
        )
    # row 0 is shifted left by its 2 pad columns; aligned padding gets False / 0
    assert seen["mask"].tolist()[0][:4] == [True] * 4 and not seen["mask"][0, 4:].any()
    assert seen["marker"][0, :4].tolist() == [2.0, 3.0, 4.0, 5.0]
    torch.testing.assert_close(out["marker"], torch.where(real, marker * 2, 0.0))
    assert torch.equal(out["top"][real], want[..., : hf.config.vocab_size].argmax(-1)[real])


def test_forward_fn_matches_hf_logits_at_real_tokens_and_maps_processor_outputs_back():
    pytest.importorskip("megatron.core")
    run_distributed(_check_forward, 1)


def test_weight_converter_names_parts_and_refuses_fused_tensors():
    pytest.importorskip("megatron.core")
    from verl.models.mcore.registry import McoreToHFWeightConverter, get_mcore_weight_converter

    converter = McoreToHFWeightConverter(None, None)
    q, k, v = torch.zeros(4), torch.ones(2), torch.full((2,), 2.0)
    names, params = converter.convert_param("decoder.layers.7.self_attention.linear_qkv.bias", [q, k, v])
    assert names == [f"model.layers.7.self_attn.{p}_proj.bias" for p in "qkv"] and params[1] is k
    names, _ = converter.convert_param("decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight", [q, k])
    assert names == ["model.layers.3.mlp.experts.5.gate_proj.weight", "model.layers.3.mlp.experts.5.up_proj.weight"]
    names, _ = converter.convert_param("decoder.layers.3.mlp.experts.linear_fc2.weight12", [q])
    assert names == ["model.layers.3.mlp.experts.12.down_proj.weight"]
    with pytest.raises(ValueError, match="3 HF tensors .* but 1 parts"):
        converter.convert_param("decoder.layers.0.self_attention.linear_qkv.weight", [q])
    with pytest.raises(NotImplementedError, match="Unsupported parameter name"):
        converter.convert_param("decoder.layers.0.self_attention.linear_kv_down_proj.weight", [q])
    deepseek = type("Config", (), {"model_type": "deepseek_v3"})()
    with pytest.raises(NotImplementedError, match="mcore_to_hf_named_tensors"):
        get_mcore_weight_converter(deepseek, torch.float32)
