"""The accelerator decode path: CUDA-graph replay per (batch bucket, KV-length bucket).

The CPU tests check the properties the graphs rely on (attending over a longer, masked KV window
and computing padding rows changes nothing for the real rows; the grouped-matmul attention used on
GPUs equals SDPA and transformers); the `gpu` tests run the captured graphs themselves.
"""

from __future__ import annotations

import pytest
import torch

from tests.config_helpers import engine_config
from tests.workers.rollout.rollout_helpers import build_model, hf_greedy_loop, left_padded_prompts
from verl.workers.rollout.native.cuda_graph import batch_bucket
from verl.workers.rollout.native.engine import GenerationEngine
from verl.workers.rollout.sampling import SamplingParams

GREEDY = SamplingParams(do_sample=False)
LENGTHS = [7, 3, 5]


def test_batch_buckets_are_the_next_power_of_two():
    assert [batch_bucket(b) for b in (1, 2, 3, 5, 64, 65, 256)] == [1, 2, 4, 8, 64, 128, 256]
    with pytest.raises(ValueError, match="max_num_seqs"):
        batch_bucket(10**6)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_grouped_matmul_attention_matches_sdpa_and_transformers(arch, request):
    model = request.getfixturevalue(f"{arch}_model")
    engine = GenerationEngine.from_model(model, device="cpu")
    engine.decoder.fused_attention = False
    input_ids, attention_mask = left_padded_prompts(LENGTHS)
    out = engine.generate(input_ids, attention_mask, 10, GREEDY)
    torch.testing.assert_close(out.responses, hf_greedy_loop(model, input_ids, attention_mask, 10), rtol=0, atol=0)


@pytest.mark.parametrize("fused_attention", [True, False])
def test_eager_decoding_never_reads_a_cache_slot_it_did_not_write(qwen2_model, fused_attention):
    """Without graphs the cache is left uninitialised (no zeroing cost): generation must read only
    slots it wrote. Poisoned with NaN beforehand, the same cache still gives transformers' tokens."""
    engine = GenerationEngine.from_model(qwen2_model, device="cpu")
    decoder = engine.decoder
    decoder.fused_attention = fused_attention
    assert not decoder.cuda_graphs
    decoder.reserve(8, 64, 64)
    poisoned = decoder.k_cache.data_ptr()
    decoder.k_cache.fill_(float("nan"))
    decoder.v_cache.fill_(float("nan"))
    input_ids, attention_mask = left_padded_prompts(LENGTHS)
    out = engine.generate(input_ids, attention_mask, 10, GREEDY)
    assert decoder.k_cache is not None and decoder.k_cache.data_ptr() == poisoned  # the same buffers ran
    want = hf_greedy_loop(qwen2_model, input_ids, attention_mask, 10)
    torch.testing.assert_close(out.responses, want, rtol=0, atol=0)


@pytest.mark.parametrize("fused_attention", [True, False])
def test_masked_kv_window_and_padding_rows_leave_real_rows_unchanged(qwen2_model, fused_attention):
    """What a bucketed graph does: decode 4 rows padded to 8, attending over the whole cache."""
    engine = GenerationEngine.from_model(qwen2_model, device="cpu")
    decoder = engine.decoder
    decoder.fused_attention = fused_attention
    # the graph mode's cache (zeroed): its padding rows and window read slots no prefill wrote, which
    # the eager mode's uninitialised cache may hold NaN in (0 attention weight x NaN = NaN)
    decoder.cuda_graphs = True
    decoder.release_cache()
    input_ids, attention_mask = left_padded_prompts([6, 2, 4, 5])
    P, B = input_ids.shape[1], 4
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    decoder.reserve(8, 32, 64)
    logits = decoder.prefill(input_ids, attention_mask, positions)
    tokens = logits.argmax(-1)
    step = torch.tensor([P])
    exact = decoder.decode_step(tokens, positions[:, -1] + 1, step, P + 1)

    decoder.prefill(input_ids, attention_mask, positions)
    padded_tokens = torch.cat([tokens, torch.full((4,), 5)])
    padded_positions = torch.cat([positions[:, -1] + 1, torch.zeros(4, dtype=torch.long)])
    bucketed = decoder.decode_step(padded_tokens, padded_positions, step, 32)
    torch.testing.assert_close(bucketed[:B], exact, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(bucketed).all()


def _cuda_model(arch="qwen2", dtype=torch.float32):
    from verl.utils.device import get_device

    return build_model(arch).to(get_device(), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_cuda_graph_greedy_equals_eager_and_transformers(arch):
    model = _cuda_model(arch)
    device = next(model.parameters()).device
    graphed = GenerationEngine.from_model(model, device=device, dtype=torch.float32)
    eager = GenerationEngine.from_model(model, device=device, dtype=torch.float32, use_cuda_graph=False)
    assert graphed.graphs is not None and eager.graphs is None
    input_ids, attention_mask = (t.to(device) for t in left_padded_prompts(LENGTHS))
    a = graphed.generate(input_ids, attention_mask, 12, GREEDY).responses
    b = eager.generate(input_ids, attention_mask, 12, GREEDY).responses
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(a, hf_greedy_loop(model, input_ids, attention_mask, 12), rtol=0, atol=0)
    assert graphed.graphs.num_graphs() >= 1


@pytest.mark.gpu
def test_cuda_graphs_are_reused_per_bucket_and_survive_weight_sync():
    model = _cuda_model()
    device = next(model.parameters()).device
    engine = GenerationEngine.from_model(model, device=device, dtype=torch.float32)
    three = [t.to(device) for t in left_padded_prompts([4, 2, 3])]
    engine.generate(*three, 8, GREEDY)
    captured = engine.graphs.num_graphs()
    engine.generate(*three, 8, GREEDY)
    assert engine.graphs.num_graphs() == captured  # same bucket: replayed, not recaptured
    engine.update_weights(model.named_parameters())  # in place: the graphs stay valid
    assert engine.graphs.num_graphs() == captured
    five = [t.to(device) for t in left_padded_prompts([4, 2, 3, 1, 4], seed=3)]
    out = engine.generate(*five, 8, GREEDY)
    torch.testing.assert_close(out.responses, hf_greedy_loop(model, *five, 8), rtol=0, atol=0)


@pytest.mark.gpu
def test_bfloat16_sampling_runs_and_sleep_returns_device_memory():
    model = _cuda_model(dtype=torch.bfloat16)
    device = next(model.parameters()).device
    engine = GenerationEngine.from_model(model, device=device)
    assert engine.decoder.dtype == torch.bfloat16
    input_ids, attention_mask = (t.to(device) for t in left_padded_prompts([5] * 16))
    out = engine.generate(
        input_ids, attention_mask, 16, SamplingParams(temperature=1.0, top_p=0.9), return_logprobs=True
    )
    assert out.responses.max() < model.config.vocab_size and (out.logprobs <= 0).all()
    held = sum(engine.memory_bytes().values())
    before = torch.cuda.memory_allocated()
    engine.sleep()
    assert before - torch.cuda.memory_allocated() >= held


@pytest.mark.gpu
def test_cuda_graphs_speed_path_is_on_for_the_native_decoder_and_says_why_not_for_another():
    from verl.utils.device import get_device
    from verl.utils.speed_paths import SpeedPath
    from verl.workers.rollout.hf_rollout import HFRollout

    device = get_device()
    native = HFRollout(_cuda_model("qwen2"), engine_config(response_length=4), device=device)
    assert native.speed_paths() == [SpeedPath("cuda_graphs", True, True)], native.speed_paths()
    generic = HFRollout(_cuda_model("gpt2"), engine_config(response_length=4), device=device)
    [path] = generic.speed_paths()
    assert path.requested and not path.active and "native decoder" in path.reason, path
    eager = HFRollout(
        _cuda_model("qwen2"),
        engine_config(response_length=4, engine_kwargs={"hf": {"enforce_eager": True}}),
        device=device,
    )
    assert eager.speed_paths() == [SpeedPath("cuda_graphs", False, False)], eager.speed_paths()
