"""The analytic FLOPs count against torch's own operator-level count of a real forward + backward."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from verl.utils.flops_counter import FlopsCounter, mfu


def _tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        attn_implementation="eager",  # attention as plain matmuls, which the operator count sees
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).float()


def test_training_flops_match_torch_operator_count():
    model = _tiny_qwen2()
    seqlens = [7, 19]
    with FlopCounterMode(display=False) as counter:
        for length in seqlens:  # one unpadded sequence at a time: no padding FLOPs in the reference
            ids = torch.randint(0, 300, (1, length))
            model(input_ids=ids).logits.float().sum().backward()
    measured = counter.get_total_flops()
    assert FlopsCounter(model.config).training_flops(seqlens) == pytest.approx(measured, rel=0.01)


def test_matmul_params_equal_the_models_projection_weights():
    model = _tiny_qwen2()
    projections = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n)
    assert FlopsCounter(model.config).matmul_params == projections


def test_mfu_needs_a_known_peak(monkeypatch):
    counter = FlopsCounter(_tiny_qwen2().config)
    monkeypatch.delenv("VERL_PEAK_FLOPS", raising=False)
    monkeypatch.setenv("VERL_DEVICE", "cpu")
    assert mfu(counter, [10, 10], seconds=1.0, n_devices=2) is None  # CPU: no published peak
    monkeypatch.setenv("VERL_PEAK_FLOPS", "1e9")
    flops = counter.training_flops([10, 10])
    assert mfu(counter, [10, 10], seconds=2.0, n_devices=2, passes=3) == pytest.approx(flops * 3 / 2.0 / 2e9)
    monkeypatch.setenv("VERL_PEAK_FLOPS", "fast")
    with pytest.raises(ValueError, match="VERL_PEAK_FLOPS"):
        mfu(counter, [10], seconds=1.0, n_devices=1)
