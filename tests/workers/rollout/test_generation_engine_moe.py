"""The built-in engine generates with a mixture-of-experts model (tiny-moe, transformers'
Qwen3MoeForCausalLM) through its generic HF decoder: greedy tokens equal a plain forward/argmax
loop, before and after a weight sync in the trainer's HF names (3-D expert tensors included)."""

from __future__ import annotations

import torch

from tests.workers.rollout.rollout_helpers import hf_greedy_loop, left_padded_prompts
from verl.workers.rollout.native.engine import GenerationEngine
from verl.workers.rollout.native.llama_decoder import unsupported_reason
from verl.workers.rollout.sampling import SamplingParams

GREEDY = SamplingParams(do_sample=False)


def moe_model(seed: int):
    from transformers import AutoModelForCausalLM

    from verl.models.factory import build_config

    config = build_config("tiny-moe")
    # a wide initialisation, so greedy decoding wanders over the vocabulary instead of repeating one token
    config.initializer_range = 0.3
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def test_engine_generates_with_a_moe_model_as_transformers_does_and_after_a_weight_sync():
    model = moe_model(seed=0)
    assert "qwen3_moe" in unsupported_reason(model.config)  # the generic path, named in the log
    engine = GenerationEngine.from_model(model, device="cpu")
    assert not engine.is_native
    input_ids, attention_mask = left_padded_prompts([7, 3, 5, 1])

    out = engine.generate(input_ids, attention_mask, 10, GREEDY, pad_token_id=0)
    expected = hf_greedy_loop(model, input_ids, attention_mask, 10)
    torch.testing.assert_close(out.responses, expected, rtol=0, atol=0)
    assert len(set(expected[0].tolist())) > 3, "a repetitive reference would prove little"

    trained = moe_model(seed=1)
    names = dict(trained.named_parameters())
    assert names["model.layers.0.mlp.experts.gate_up_proj"].dim() == 3
    engine.update_weights(trained.state_dict().items())
    out = engine.generate(input_ids, attention_mask, 10, GREEDY, pad_token_id=0)
    torch.testing.assert_close(out.responses, hf_greedy_loop(trained, input_ids, attention_mask, 10), rtol=0, atol=0)
    assert not torch.equal(out.responses, expected)


def test_engine_generates_with_gpt_oss_sinks_and_a_sliding_window_as_transformers_does():
    """tiny-gptoss (attention sinks, a 4-token sliding window, YaRN, biased experts): 10 greedy tokens
    after prompts of up to 7, so the cached decode runs well past the window, equal the plain
    forward/argmax loop's."""
    from transformers import AutoModelForCausalLM

    from verl.models.factory import build_config

    config = build_config("tiny-gptoss")
    config.initializer_range = 0.3
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    engine = GenerationEngine.from_model(model, device="cpu")
    input_ids, attention_mask = left_padded_prompts([7, 3, 5, 1])
    out = engine.generate(input_ids, attention_mask, 10, GREEDY, pad_token_id=0)
    expected = hf_greedy_loop(model, input_ids, attention_mask, 10)
    torch.testing.assert_close(out.responses, expected, rtol=0, atol=0)
    assert len(set(expected[0].tolist())) > 3, "a repetitive reference would prove little"
