"""Agent-loop episodes carry the rollout engine's MoE routing (router replay R3).

With `rollout.enable_rollout_routing_replay` the built-in engine records every token's experts
(tests/workers/rollout/test_rollout_routing_record.py checks the engine against a plain HF forward).
Through agent loops each episode keeps the routing of its last engine call, whose forwards saw the
whole context, and the rollout lays it out as the batch's `routed_experts` [B, P + R, layers, k]
(prompt left-padded, zeros at padding). References: the plain rollout's own output for a single
model turn (greedy: the same tokens and the same forwards), and a plain float32 HF forward of the
finished sequences for a two-call episode with an inserted turn.
"""

from __future__ import annotations

import copy
from uuid import uuid4

import numpy as np
import pytest
import torch

from tests.config_helpers import engine_config
from tests.experimental.agent_loop.conftest import encode
from tests.experimental.agent_loop.test_tool_agent_loop import P, question_batch
from tests.experimental.agent_loop.test_upstream_agent_loop_api import arc, looped
from tests.workers.rollout.test_generation_engine_moe import moe_model
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register

pytestmark = pytest.mark.usefixtures("one_thread")

R = 12
TOP_K = 2
QUESTIONS = ["What is 12+34?", "What is 5+78?", "What is 10+9?"]


@pytest.fixture(scope="module")
def moe():
    return moe_model(seed=0)


@pytest.fixture(scope="module")
def recording_rollout(moe, tokenizer):
    from verl.workers.rollout.hf_rollout import HFRollout

    config = engine_config(response_length=R, prompt_length=P, enable_rollout_routing_replay=True)
    return HFRollout(moe, config=config, tokenizer=tokenizer, device="cpu")


def _section():
    return arc(R, enable_rollout_routing_replay=True)


def _hf_routing(model, batch) -> torch.Tensor:
    """[B, S, layers, k]: the top-k of one plain forward's router logits, zeros at padding."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=batch["position_ids"], output_router_logits=True)
    B, S = ids.shape
    layers = [logits.view(B, S, -1).topk(TOP_K, dim=-1).indices for logits in out.router_logits]
    return torch.stack(layers, dim=2) * mask[..., None, None].long()


def test_a_single_turn_episode_carries_the_plain_rollouts_routing(tokenizer, recording_rollout):
    batch = question_batch(tokenizer, QUESTIONS)
    plain = recording_rollout.generate_sequences(copy.deepcopy(batch))
    out = looped(recording_rollout, _section(), tokenizer, batch)
    assert torch.equal(plain.batch["input_ids"], out.batch["input_ids"])
    routing = out.batch["routed_experts"]
    assert routing.shape == (len(QUESTIONS), P + R, 2, TOP_K) and routing.dtype == plain.batch["routed_experts"].dtype
    assert torch.equal(routing, plain.batch["routed_experts"])
    assert int(routing[out.batch["attention_mask"].bool()].max()) > 0


class TwoCalls(AgentLoopBase):
    """Upstream-style: a model turn of 4 tokens, an inserted user turn, then a second model turn whose
    call sees the whole context; returns no routing itself."""

    async def run(self, sampling_params, **kwargs):
        prompt_ids = await self.apply_chat_template(kwargs["raw_prompt"])
        request = uuid4().hex
        first = await self.server_manager.generate(
            request, prompt_ids=prompt_ids, sampling_params={**sampling_params, "max_tokens": 4}
        )
        inserted = encode(self.tokenizer, "<|user|>go<|assistant|>")
        context = prompt_ids + first.token_ids + inserted
        second = await self.server_manager.generate(
            request, prompt_ids=context, sampling_params={**sampling_params, "max_tokens": 4}
        )
        response = first.token_ids + inserted + second.token_ids
        mask = [1] * len(first.token_ids) + [0] * len(inserted) + [1] * len(second.token_ids)
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response,
            response_mask=mask,
            num_turns=4,
            metrics=AgentLoopMetrics(),
        )


def test_a_two_call_episode_carries_its_last_calls_routing_over_the_whole_sequence(tokenizer, moe, recording_rollout):
    from verl.experimental.agent_loop.agent_loop import AGENT_LOOPS

    saved = dict(AGENT_LOOPS)
    register("routing_two_calls")(TwoCalls)
    try:
        batch = question_batch(tokenizer, QUESTIONS)
        batch.non_tensor_batch["agent_name"] = np.array(["routing_two_calls"] * len(QUESTIONS), dtype=object)
        out = looped(recording_rollout, _section(), tokenizer, batch)
    finally:
        AGENT_LOOPS.clear()
        AGENT_LOOPS.update(saved)
    mask = out.batch["response_mask"]
    assert (mask == 0).any(dim=-1).all(), "every episode has its inserted turn"
    expected = _hf_routing(moe, out.batch)
    routing = out.batch["routed_experts"].long()
    real = out.batch["attention_mask"].bool()
    assert torch.equal(routing[real], expected[real])
    assert int(routing[~real].max()) == 0


def test_an_episode_returning_routing_itself_keeps_it():
    from verl.experimental.agent_loop.agent_loop import trajectory_from_output
    from verl.experimental.agent_loop.rollout import trajectories_to_proto

    routing = torch.arange(5 * 1 * 2, dtype=torch.uint8).view(5, 1, 2) + 1  # 3 prompt + 2 response tokens
    output = AgentLoopOutput(
        prompt_ids=[4, 5, 6], response_ids=[7, 8], response_mask=[1, 1], routed_experts=routing, num_turns=2,
        metrics=AgentLoopMetrics(),
    )  # fmt: skip
    trajectory = trajectory_from_output(output)
    from verl.protocol import DataProto

    ids = torch.tensor([[0, 4, 5, 6]])
    mask = (ids > 0).long()
    prompts = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1)})
    out = trajectories_to_proto(prompts, [trajectory], response_length=3, pad=0, with_logprobs=False, meta={})
    got = out.batch["routed_experts"]
    assert got.shape == (1, 7, 1, 2)
    # prompt left-padded to 4 columns (one padding column), response from column 4, one padding column
    expected = torch.zeros(1, 7, 1, 2, dtype=torch.uint8)
    expected[0, 1:4] = routing[:3]
    expected[0, 4:6] = routing[3:]
    assert torch.equal(got, expected)
