"""MicroBatchEngine: concurrent requests become batches; tool latency overlaps instead of adding up."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.experimental.agent_loop.conftest import ForcedRollout, encode
from tests.experimental.agent_loop.test_tool_agent_loop import (
    assistant_turns,
    call_text,
    question_batch,
    rollout_config,
)
from verl.experimental.agent_loop import AgentLoopRollout, MicroBatchEngine, TokenOutput
from verl.tools.calculator_tool import CalculatorTool
from verl.tools.function_tool import FunctionTool

pytestmark = pytest.mark.usefixtures("one_thread")


def echo_batch(calls):
    """A batch function that answers each prompt with its reversed ids + stop token 0, recording batches."""

    def generate_batch(prompts, sampling, max_new_tokens):
        calls.append((len(prompts), dict(sampling), max_new_tokens))
        return [TokenOutput(list(reversed(p)) + [0], None, stopped=True) for p in prompts]

    return generate_batch


def test_concurrent_requests_share_a_batch_per_sampling_setting_and_are_cut_to_their_budget():
    calls = []

    async def main():
        engine = MicroBatchEngine(echo_batch(calls))
        try:
            greedy = [engine.generate([i, i + 1, i + 2], {"do_sample": False}, 2 + i) for i in range(4)]
            sampled = engine.generate([9], {"temperature": 0.5}, 8)
            return await asyncio.gather(*greedy, sampled)
        finally:
            await engine.aclose()

    outs = asyncio.run(main())
    assert sorted((n, tuple(s.items()), m) for n, s, m in calls) == [
        (1, (("temperature", 0.5),), 8),
        (4, (("do_sample", False),), 5),  # one batch, generated up to the largest budget
    ]
    assert outs[0] == TokenOutput([2, 1], None, stopped=False)  # 3 ids + stop cut to 2 tokens
    assert outs[3] == TokenOutput([5, 4, 3, 0], None, stopped=True)
    assert outs[4].token_ids == [9, 0]


def test_an_engine_error_reaches_every_waiting_request():
    def broken(prompts, sampling, max_new_tokens):
        raise RuntimeError("engine exploded")

    async def main():
        engine = MicroBatchEngine(broken)
        try:
            return await asyncio.gather(*(engine.generate([1], {}, 4) for _ in range(3)), return_exceptions=True)
        finally:
            await engine.aclose()

    results = asyncio.run(main())
    assert all(isinstance(r, RuntimeError) and str(r) == "engine exploded" for r in results)


def slow_tool_script(tokenizer, slow_questions=()):
    eos = tokenizer.eos_token_id

    def script(context):
        text = tokenizer.decode(context)
        if assistant_turns(tokenizer, context) > 1:
            return encode(tokenizer, "done") + [eos]
        name = "slow" if any(q in text for q in slow_questions) else "calculator"
        return encode(tokenizer, call_text("1+1", name=name)) + [eos]

    return script


async def _wait_until(condition, timeout_s: float = 60.0) -> None:
    """Poll `condition` on the tool's event loop. The timeout only ends a run whose tools do NOT overlap
    (which the test then reports); an overlapping run meets the condition within milliseconds."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def test_many_episodes_with_a_slow_tool_run_their_tool_calls_concurrently(tokenizer, tiny_model):
    # Concurrency proven without a clock: each call returns only once all 16 calls have started, so
    # calls made one after another would each see only themselves (after the 60 s fallback).
    n = 16
    started, seen = [], []
    lock = threading.Lock()

    async def slow(expression: str) -> str:
        with lock:
            started.append(expression)
        await _wait_until(lambda: len(started) >= n)
        seen.append(len(started))
        return "2"

    questions = [f"What is {i}+1?" for i in range(n)]
    forced = ForcedRollout(tiny_model, slow_tool_script(tokenizer, slow_questions=questions))
    rollout = AgentLoopRollout(forced, rollout_config(256), tokenizer, tools=[FunctionTool(slow)])
    out = rollout.generate_sequences(question_batch(tokenizer, questions))
    assert seen == [n] * n, f"calls in flight when each call ended: {seen}; the tool calls did not overlap"
    assert out.non_tensor_batch["__num_turns__"].tolist() == [4] * n
    assert forced.batch_sizes[0] == n and sum(forced.batch_sizes) == 2 * n


def test_a_slow_tool_holds_back_only_its_own_conversation(tokenizer, tiny_model):
    questions = [f"What is {i}+1?" for i in range(8)]

    async def slow(expression: str) -> str:
        # returns only after the seven fast conversations have had their second turn (8 first turns +
        # 7 second turns), so the verdict does not depend on how fast the machine runs them
        await _wait_until(lambda: sum(forced.batch_sizes) >= 8 + 7)
        return "2"

    forced = ForcedRollout(tiny_model, slow_tool_script(tokenizer, slow_questions=[questions[3]]))
    tools = [FunctionTool(slow), CalculatorTool()]
    AgentLoopRollout(forced, rollout_config(256), tokenizer, tools=tools).generate_sequences(
        question_batch(tokenizer, questions)
    )
    # first turns together; the seven fast conversations continue without waiting for the slow one
    assert forced.batch_sizes[0] == 8 and forced.batch_sizes[-1] == 1 and sum(forced.batch_sizes) == 16
