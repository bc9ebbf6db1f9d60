"""The built-in engine's memory behaviour and the pieces of its GPU path that run on CPU: chunked
prefill, the KV-cache budget and the chunked generation it implies, a cache that only grows, fp32
decode scores, the graph runner's static output buffer, and the CUDA-graph default of `rollout.name=hf`."""

from __future__ import annotations

import pytest
import torch

from tests.config_helpers import engine_config
from tests.workers.rollout.rollout_helpers import build_model, hf_greedy_loop, left_padded_prompts
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import RolloutConfig
from verl.workers.rollout.hf_rollout import HFRollout, cuda_graphs_enabled
from verl.workers.rollout.native.engine import GenerationEngine, kv_cache_rows
from verl.workers.rollout.native.llama_decoder import LlamaDecoder
from verl.workers.rollout.sampling import SamplingParams

GREEDY = SamplingParams(do_sample=False)
GIB, MIB = 2**30, 2**20


# --------------------------------------------------------------------------------- KV budget
def test_kv_cache_rows_from_hand_worked_budgets():
    # 80 GiB device, 40 GiB free, util 0.5: the engine may use 40 GiB; 1 GiB weights, 1 GiB
    # prefill workspace -> 38 GiB for rows of 12 MiB = 38 * 1024 / 12 = 3242.67 -> 3242 rows
    assert kv_cache_rows(40 * GIB, 80 * GIB, 0.5, 1 * GIB, 1 * GIB, 12 * MIB) == 3242
    # only 10 GiB free (a trainer holds the rest): 10 - 1 = 9 GiB -> 768 rows of 12 MiB
    assert kv_cache_rows(10 * GIB, 80 * GIB, 0.5, 1 * GIB, 1 * GIB, 12 * MIB) == 768
    # utilisation binds: 0.1 * 80 = 8 GiB - 1 GiB weights - 1 GiB workspace = 6 GiB -> 512 rows
    assert kv_cache_rows(40 * GIB, 80 * GIB, 0.1, 1 * GIB, 1 * GIB, 12 * MIB) == 512
    # weights alone exceed the share: nothing fits (the engine then explains, see below)
    assert kv_cache_rows(40 * GIB, 80 * GIB, 0.01, 1 * GIB, 0, 12 * MIB) == 0


def test_cache_row_bytes_count_keys_values_and_key_bias(qwen2_model):
    decoder = GenerationEngine.from_model(qwen2_model, device="cpu").decoder
    # K and V, 2 layers, 2 kv heads of 64, float32; plus a float32 key bias per column
    assert decoder.cache_row_bytes(100) == 2 * 2 * 2 * 64 * 100 * 4 + 100 * 4
    decoder.reserve(3, 100, 100)
    allocated = (decoder.k_cache.numel() + decoder.v_cache.numel() + decoder.key_bias.numel()) * 4
    assert allocated == 3 * decoder.cache_row_bytes(100)


@pytest.mark.parametrize("return_logprobs", [False, True])
def test_rows_beyond_the_kv_budget_generate_in_chunks_with_the_same_outputs(qwen2_model, return_logprobs):
    lengths = [6, 2, 4, 5, 3, 6, 1, 4]
    input_ids, attention_mask = left_padded_prompts(lengths, seed=1)
    P, R = input_ids.shape[1], 9
    whole = GenerationEngine.from_model(qwen2_model, device="cpu")
    row = whole.decoder.cache_row_bytes(P + R)
    budget = GenerationEngine.from_model(qwen2_model, device="cpu", kv_cache_bytes=3 * row + row // 2)
    assert budget.max_cache_rows(P + R, P, len(lengths)) == 3
    kw = dict(eos_token_id=2, pad_token_id=0, return_logprobs=return_logprobs)
    a = whole.generate(input_ids, attention_mask, R, GREEDY, **kw)
    b = budget.generate(input_ids, attention_mask, R, GREEDY, **kw)
    assert budget.decoder.cache_capacity()[0] == 3  # 8 rows ran as 3 + 3 + 2
    assert torch.equal(a.responses, b.responses) and torch.equal(a.response_mask, b.response_mask)
    if return_logprobs:
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    free = hf_greedy_loop(qwen2_model, input_ids, attention_mask, R)
    assert torch.equal(b.responses[b.response_mask.bool()], free[b.response_mask.bool()])


def test_a_pause_in_one_chunk_ends_the_whole_batch_at_that_column(qwen2_model):
    input_ids, attention_mask = left_padded_prompts([6, 2, 4, 5, 3], seed=2)
    P, R = input_ids.shape[1], 8
    whole = GenerationEngine.from_model(qwen2_model, device="cpu")
    row = whole.decoder.cache_row_bytes(P + R)
    budget = GenerationEngine.from_model(qwen2_model, device="cpu", kv_cache_bytes=2 * row)
    checks = []

    def pause():  # the third check asks to stop: in the first chunk (rows 0-1), after 3 columns
        checks.append(1)
        return len(checks) == 3

    out = budget.generate(input_ids, attention_mask, R, GREEDY, pad_token_id=0, pause=pause)
    assert out.paused_at == 3 and out.responses.shape == (5, R)
    assert len(checks) == 3  # later chunks generate 3 columns without asking again
    ref = whole.generate(input_ids, attention_mask, R, GREEDY, pad_token_id=0)
    assert torch.equal(out.responses[:, :3], ref.responses[:, :3])
    assert out.response_mask[:, 3:].eq(0).all() and out.responses[:, 3:].eq(0).all()


def test_a_budget_without_room_for_one_sequence_is_explained(qwen2_model):
    engine = GenerationEngine.from_model(qwen2_model, device="cpu", kv_cache_bytes=10)
    input_ids, attention_mask = left_padded_prompts([4, 3])
    with pytest.raises(RuntimeError, match="gpu_memory_utilization"):
        engine.generate(input_ids, attention_mask, 4, GREEDY)


def test_the_cache_only_grows_so_alternating_shapes_do_not_reallocate(qwen2_model):
    engine = GenerationEngine.from_model(qwen2_model, device="cpu")
    wide = left_padded_prompts([3, 2, 3, 1, 2, 3])
    long = left_padded_prompts([12, 9], seed=4)
    engine.generate(*wide, 4, GREEDY)
    engine.generate(*long, 10, GREEDY)  # fewer rows but longer: grows to cover both shapes
    k_cache = engine.decoder.k_cache
    assert engine.decoder.cache_capacity() == (6, 22)
    for inputs, new_tokens in ((wide, 4), (long, 10), (wide, 4)):
        out = engine.generate(*inputs, new_tokens, GREEDY)
        assert engine.decoder.k_cache is k_cache
        assert torch.equal(out.responses, hf_greedy_loop(qwen2_model, *inputs, new_tokens))


def test_memory_utilization_outside_its_range_is_explained(qwen2_model):
    with pytest.raises(ValueError, match="gpu_memory_utilization=1.5"):
        GenerationEngine.from_model(qwen2_model, device="cpu", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="rollout.gpu_memory_utilization=0"):
        engine_config(gpu_memory_utilization=0)


# ------------------------------------------------------------------------------------- prefill
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("fan_out", [False, True])
def test_chunked_prefill_equals_one_pass(arch, fan_out, request):
    """Logits and every cache column of a prefill in chunks of 2 prompts equal one pass over all of
    them (llama: grouped-query heads expanded for the masked kernel); with `rows`, each cache row
    gets its prompt's keys and values."""
    model = request.getfixturevalue(f"{arch}_model")
    input_ids, attention_mask = left_padded_prompts([7, 3, 5, 1, 7], seed=3)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    rows = torch.tensor([4, 0, 0, 2, 1, 3, 4, 2]) if fan_out else None
    N, P = (len(rows) if fan_out else 5), input_ids.shape[1]
    results = []
    for tokens in (None, 2 * P):
        engine = GenerationEngine.from_model(model, device="cpu", prefill_tokens=tokens)
        assert engine.decoder.prefill_rows(P) == (2 if tokens else 1 << 62)
        engine.decoder.reserve(N, P + 4, P + 4)
        logits = engine.decoder.prefill(input_ids, attention_mask, positions, rows=rows)
        d = engine.decoder
        results.append((logits, d.k_cache[:, :N, :, :P].clone(), d.v_cache[:, :N, :, :P].clone(), d.key_bias.clone()))
    for whole, chunked in zip(*results):
        torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=5e-5)  # GEMMs of other row counts round differently
    # each prompt's logits equal transformers' last-position logits
    with torch.no_grad():
        ref = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits[:, -1]
    torch.testing.assert_close(results[1][0], ref, rtol=1e-4, atol=1e-4)
    if fan_out:  # cache row r holds prompt rows[r]'s keys
        engine = GenerationEngine.from_model(model, device="cpu")
        engine.decoder.reserve(5, P + 4, P + 4)
        engine.decoder.prefill(input_ids, attention_mask, positions)
        single = engine.decoder.k_cache[:, :5, :, :P]
        torch.testing.assert_close(results[1][1], single[:, rows], rtol=1e-5, atol=1e-5)


def test_generation_with_prefill_chunks_of_one_prompt_matches_transformers(llama_model):
    engine = GenerationEngine.from_model(llama_model, device="cpu", prefill_tokens=1)
    input_ids, attention_mask = left_padded_prompts([7, 3, 5, 1], seed=5)
    out = engine.generate(input_ids, attention_mask, 8, GREEDY)
    assert torch.equal(out.responses, hf_greedy_loop(llama_model, input_ids, attention_mask, 8))


# --------------------------------------------------------------------------------------- decode
def test_decode_scores_are_fp32_for_bf16_caches():
    """bf16 q and keys: the scores are the fp32 products (exact for bf16 inputs), not rounded to bf16."""
    model = build_model("llama")
    decoder = GenerationEngine.from_model(model, device="cpu", dtype=torch.bfloat16).decoder
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(6, 2, 64, generator=gen).bfloat16()
    keys = torch.randn(6, 9, 64, generator=gen).bfloat16()
    scores = decoder._scores(q, keys)
    assert scores.dtype == torch.float32
    exact = q.double() @ keys.double().transpose(1, 2)
    torch.testing.assert_close(scores.double(), exact, rtol=1e-6, atol=1e-5)
    assert not torch.equal(scores, (q @ keys.transpose(1, 2)).float())  # what bf16 output would lose


def test_decode_step_writes_its_logits_into_a_given_buffer(qwen2_model):
    """What every CUDA graph does with the runner's one static output buffer."""
    decoder = GenerationEngine.from_model(qwen2_model, device="cpu").decoder
    decoder.fused_attention = False
    input_ids, attention_mask = left_padded_prompts([4, 2, 3])
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    decoder.reserve(3, 16, 16)
    tokens = decoder.prefill(input_ids, attention_mask, positions).argmax(-1)
    step = torch.tensor([input_ids.shape[1]])
    expected = decoder.decode_step(tokens, positions[:, -1] + 1, step, step.item() + 1)
    decoder.prefill(input_ids, attention_mask, positions)
    buffer = torch.full((8, decoder.spec.vocab_size), float("nan"))
    out = decoder.decode_step(tokens, positions[:, -1] + 1, step, step.item() + 1, out=buffer[:3])
    assert out.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(buffer[:3], expected, rtol=0, atol=0)
    assert buffer[3:].isnan().all()


def test_rope_table_grows_geometrically():
    decoder = GenerationEngine.from_model(build_model("qwen2"), device="cpu").decoder
    assert isinstance(decoder, LlamaDecoder)
    decoder.cuda_graphs = True  # every rebuild would recapture the graphs
    decoder.reserve(2, 16, 16)
    assert decoder._cos.shape[0] == 4096  # room for long positions without a rebuild
    assert decoder.reserve(2, 16, 5000) and decoder._cos.shape[0] == 8192
    assert not decoder.reserve(2, 16, 6000)


def test_rope_table_without_cuda_graphs_starts_at_the_positions_asked_for_and_doubles():
    decoder = GenerationEngine.from_model(build_model("qwen2"), device="cpu").decoder
    assert not decoder.cuda_graphs
    decoder.reserve(2, 16, 20)
    assert decoder._cos.shape[0] == 20  # rebuilt after every sleep: only what this call needs
    assert decoder.reserve(2, 16, 30) and decoder._cos.shape[0] == 40
    assert not decoder.reserve(2, 16, 40)


# -------------------------------------------------------------------------------- rollout config
def _default_rollout_config(overrides=()):
    from verl.trainer.config import load_ppo_config

    return omega_conf_to_dataclass(
        load_ppo_config(list(overrides), config_name="arith_demo").actor_rollout_ref.rollout, RolloutConfig
    )


def test_default_yaml_turns_cuda_graphs_on_for_the_hf_engine_on_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_CACHE_DIR", str(tmp_path))
    config = _default_rollout_config()
    assert config.gpu_memory_utilization == 0.5 and config.max_num_batched_tokens == 8192
    # rollout.enforce_eager=true (upstream's default, a vLLM key) does not turn the graphs off
    assert cuda_graphs_enabled(config, torch.device("cuda", 0))
    assert not cuda_graphs_enabled(config, torch.device("cpu"))
    eager = _default_rollout_config(["+actor_rollout_ref.rollout.engine_kwargs.hf.enforce_eager=true"])
    assert not cuda_graphs_enabled(eager, torch.device("cuda", 0))


def test_unknown_hf_engine_kwargs_are_errors_naming_the_valid_ones(qwen2_model):
    config = engine_config(engine_kwargs={"hf": {"cuda_graph": False}, "vllm": {"swap_space": 0}})
    with pytest.raises(ValueError, match=r"engine_kwargs.hf has unknown keys \['cuda_graph'\].*enforce_eager"):
        HFRollout(qwen2_model, config, device="cpu")


def test_rollout_reports_graph_captures_and_passes_its_budget_to_the_engine(qwen2_model):
    config = engine_config(response_length=4, gpu_memory_utilization=0.3, max_num_batched_tokens=64)
    rollout = HFRollout(qwen2_model, config, device="cpu")
    assert rollout.engine.gpu_memory_utilization == 0.3 and rollout.engine.decoder.prefill_tokens == 64
    from verl.protocol import DataProto

    input_ids, attention_mask = left_padded_prompts([3, 2])
    out = rollout.generate_sequences(
        DataProto.from_dict(
            tensors={"input_ids": input_ids, "attention_mask": attention_mask},
            meta_info={"eos_token_id": 2, "pad_token_id": 0, "do_sample": False},
        )
    )
    metrics = out.meta_info["metrics"]
    assert metrics["rollout/cuda_graph_captures"] == 0 and metrics["timing_s/cuda_graph_capture"] == 0.0
