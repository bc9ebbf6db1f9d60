"""The built-in engine records MoE routing (`rollout.enable_rollout_routing_replay`, router replay R3).

The reference is independent of the engine: one plain HF forward of each final sequence (prompt +
response, no KV cache) in float64, whose router logits' top-k must equal what the engine recorded
token for token while it prefilled and decoded: over repeated prompts (prefilled once and fanned
out), all-padding prompt columns (dropped before the prefill), rows that stop early on EOS and rows
that run to the length limit (whose last token no decode step fed otherwise). Padding holds zeros;
`HFRollout` returns the routing in the batch; a dense model and partial rollouts are refused.
"""

from __future__ import annotations

import pytest
import torch

from tests.config_helpers import engine_config
from tests.workers.rollout.test_generation_engine_moe import moe_model
from verl.protocol import DataProto
from verl.workers.rollout.hf_rollout import HFRollout
from verl.workers.rollout.native.engine import GenerationEngine
from verl.workers.rollout.sampling import SamplingParams

R = 8
TOP_K = 2


def _float64_engine(model) -> GenerationEngine:
    engine = GenerationEngine.from_model(model, device="cpu", dtype=torch.float64)
    engine.decoder.model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel on CPU
    return engine


def _prompts():
    """Three prompts, each twice (interleaved, as GRPO repeats them), left-padded to 7 columns of
    which the first is padding in every row."""
    gen = torch.Generator().manual_seed(3)
    rows = []
    for length in (6, 3, 5):
        ids = torch.randint(10, 250, (length,), generator=gen)
        rows += [ids, ids]
    input_ids = torch.zeros(len(rows), 7, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(rows):
        input_ids[row, 7 - len(ids) :] = ids
        attention_mask[row, 7 - len(ids) :] = 1
    return input_ids, attention_mask


def _hf_routing(model, input_ids, attention_mask) -> torch.Tensor:
    """[B, S, layers, k]: the top-k of a plain float64 forward's router logits, zeros at padding."""
    reference = moe_model(seed=0).to(torch.float64)
    reference.load_state_dict(model.state_dict())
    reference.set_experts_implementation("eager")
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = reference(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, output_router_logits=True
        )
    B, S = input_ids.shape
    layers = [logits.view(B, S, -1).topk(TOP_K, dim=-1).indices for logits in out.router_logits]
    return torch.stack(layers, dim=2) * attention_mask[..., None, None]


def test_recorded_routing_equals_a_plain_forward_of_the_final_sequences():
    model = moe_model(seed=0)
    engine = _float64_engine(model)
    input_ids, attention_mask = _prompts()
    eos = list(range(10, 263, 9))  # ~1 in 9 tokens stops a row: some stop early, some run to the limit
    out = engine.generate(
        input_ids,
        attention_mask,
        R,
        SamplingParams(temperature=1.0),
        eos_token_id=eos,
        generator=torch.Generator().manual_seed(0),
        record_routing=True,
    )
    lengths = out.response_mask.sum(-1)
    assert (lengths < R).any() and (lengths == R).any(), f"want early and full-length rows, got {lengths.tolist()}"
    routing = out.routed_experts
    assert routing.dtype == torch.uint8 and routing.shape == (6, 7 + R, 2, TOP_K), (routing.dtype, routing.shape)

    sequences = torch.cat([input_ids, out.responses], dim=1)
    mask = torch.cat([attention_mask, out.response_mask], dim=1)
    want = _hf_routing(model, sequences, mask)
    real = mask.bool()
    differ = (routing.long() != want).any(-1).any(-1) & real
    assert not differ.any(), (
        f"{int(differ.sum())} of {int(real.sum())} tokens routed differently, at {differ.nonzero()}"
    )
    assert int(routing[~real].max()) == 0, "padding columns hold zeros"
    assert len(set(want[real][:, 0, 0].tolist())) > 1, "a model routing every token alike would prove little"


def test_recording_changes_no_greedy_token_and_costs_nothing_when_off():
    model = moe_model(seed=0)
    engine = GenerationEngine.from_model(model, device="cpu")
    input_ids, attention_mask = _prompts()
    greedy = SamplingParams(do_sample=False)
    plain = engine.generate(input_ids, attention_mask, R, greedy, eos_token_id=[7])
    recorded = engine.generate(input_ids, attention_mask, R, greedy, eos_token_id=[7], record_routing=True)
    assert plain.routed_experts is None
    assert all(not router._forward_hooks for router in engine.routing_recorder().routers), "hooks left behind"
    torch.testing.assert_close(recorded.responses, plain.responses, rtol=0, atol=0)
    assert recorded.routed_experts.shape == (6, 7 + R, 2, TOP_K)


def test_hf_rollout_returns_routed_experts_over_prompt_and_response_columns():
    model = moe_model(seed=0)
    rollout = HFRollout(model, engine_config(response_length=R, enable_rollout_routing_replay=True), device="cpu")
    input_ids, attention_mask = _prompts()
    prompts = DataProto.from_dict(
        tensors={
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        },
        meta_info={"eos_token_id": 7, "pad_token_id": 0, "do_sample": False},
    )
    out = rollout.generate_sequences(prompts)
    routing = out.batch["routed_experts"]
    assert routing.shape == (*out.batch["input_ids"].shape, 2, TOP_K) and routing.dtype == torch.uint8
    real = out.batch["attention_mask"].bool()
    assert int(routing[~real].max()) == 0 and int(routing[real].max()) > 0

    plain = HFRollout(model, engine_config(response_length=R), device="cpu").generate_sequences(prompts)
    assert "routed_experts" not in plain.batch


def test_a_dense_model_and_partial_rollouts_are_refused():
    from tests.workers.rollout.rollout_helpers import build_model

    engine = GenerationEngine.from_model(build_model("qwen2"), device="cpu")
    input_ids, attention_mask = _prompts()
    with pytest.raises(ValueError, match="has no mixture-of-experts layers.*enable_rollout_routing_replay=false"):
        engine.generate(input_ids.clamp(max=40), attention_mask, 2, record_routing=True)

    rollout = HFRollout(moe_model(seed=0), engine_config(response_length=R, enable_rollout_routing_replay=True), "cpu")
    rollout.weight_refresh = object()
    prompts = DataProto.from_dict(
        tensors={"input_ids": input_ids, "attention_mask": attention_mask},
        meta_info={"eos_token_id": 7, "pad_token_id": 0, "partial_rollout": True},
    )
    with pytest.raises(NotImplementedError, match="enable_rollout_routing_replay with partial rollouts"):
        rollout.generate_sequences(prompts)


def test_the_vllm_and_sglang_adapters_refuse_to_record_routing():
    """Their shared base refuses the switch before any engine starts: they return no routing here."""
    from verl.workers.rollout.external_engine import ExternalEngineRollout

    class _Engine(ExternalEngineRollout):
        def _generate(self, prompts, sampling, max_new_tokens):
            raise AssertionError("never reached")

        update_weights = sleep = wake_up = _generate

    with pytest.raises(NotImplementedError, match="returns no expert routing here.*rollout.name=hf"):
        _Engine("/nonexistent", engine_config(enable_rollout_routing_replay=True))
