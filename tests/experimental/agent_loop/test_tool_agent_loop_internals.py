"""Loops that subclass `ToolAgentLoop` and drive upstream's state machine (`AgentData`, `AgentState`,
the `_handle_*_state` handlers), as upstream's collabllm recipe does, run here on the bundled tiny model.

The loops below are written the way such recipes write them (their own `run`, a deep copy of the
episode's `AgentData` per repeated interaction rollout, `multi_turn.num_repeat_rollouts` read from
`self.config`); the expected token sequences are written out from the texts of the scripted turns.
"""

from __future__ import annotations

import copy
import json
from uuid import uuid4

import pytest

from tests.experimental.agent_loop.conftest import ForcedRollout, chat_prompt_ids, encode
from tests.experimental.agent_loop.test_interaction_agent_loop import YAML, batch_with_ground_truths, guessing_script
from tests.experimental.agent_loop.test_tool_agent_loop import (
    assistant_turns,
    calculator_script,
    call_text,
    question_batch,
)
from tests.experimental.agent_loop.test_upstream_agent_loop_api import arc, looped
from verl.experimental.agent_loop import AgentLoopRollout
from verl.experimental.agent_loop.agent_loop import (
    AGENT_LOOP_KWARGS,
    AGENT_LOOPS,
    AgentLoopOutput,
    register,
    uses_upstream_api,
)
from verl.experimental.agent_loop.tool_agent_loop import AgentData, AgentState, ToolAgentLoop
from verl.experimental.agent_loop.tool_parser import FunctionCall
from verl.interactions.gsm8k_interaction import CORRECT, INCORRECT
from verl.tools.schemas import ToolResponse
from verl.workers.rollout.schemas import Message

pytestmark = pytest.mark.usefixtures("one_thread")

R = 160


class RepeatedInteractionLoop(ToolAgentLoop):
    """One answer, then `num_repeat_rollouts` continuations of the conversation with the simulated user,
    each on its own copy of the episode's state. Trains on the first continuation; returns every
    continuation's conversation as `Message`s (what a conversation-level reward manager reads)."""

    async def run(self, sampling_params, **kwargs):
        interaction_kwargs = kwargs["extra_info"]["interaction_kwargs"]
        interaction = self.interaction_map[interaction_kwargs["name"]]
        request_id = uuid4().hex
        await interaction.start_interaction(request_id, **interaction_kwargs)
        agent_data = AgentData(
            messages=list(kwargs["raw_prompt"]),
            image_data=None,
            metrics={},
            request_id=request_id,
            tools_kwargs={},
            interaction=interaction,
            interaction_kwargs=interaction_kwargs,
        )
        assert await self._handle_pending_state(agent_data, sampling_params) == AgentState.GENERATING
        state = await self._handle_generating_state(agent_data, sampling_params)
        repeats = 0
        if state != AgentState.TERMINATED:
            repeats = self.config.actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts
        continuations = [copy.deepcopy(agent_data) for _ in range(repeats)]
        for continuation in continuations:
            await self.drive(continuation, sampling_params, AgentState.INTERACTING)
        trained = continuations[0] if continuations else agent_data
        n = len(trained.prompt_ids) - len(trained.response_mask)
        return AgentLoopOutput(
            prompt_ids=trained.prompt_ids[:n],
            response_ids=trained.prompt_ids[n:],
            response_mask=trained.response_mask,
            num_turns=trained.user_turns + trained.assistant_turns + 1,
            metrics=trained.metrics,
            extra_fields={
                "turn_scores": trained.turn_scores,
                "messages": {"messages": [[Message(**m) for m in c.messages] for c in continuations]},
            },
        )

    async def drive(self, agent_data, sampling_params, state):
        while state != AgentState.TERMINATED:
            if state == AgentState.GENERATING:
                state = await self._handle_generating_state(agent_data, sampling_params)
            elif state == AgentState.PROCESSING_TOOLS:
                state = await self._handle_processing_tools_state(agent_data)
            elif state == AgentState.INTERACTING:
                state = await self._handle_interacting_state(agent_data)


class CountsToolTurns(ToolAgentLoop):
    """Upstream's own `run`; only a handler is overridden (it records the calls it handles)."""

    handled: list[list[str]] = []

    async def _handle_processing_tools_state(self, agent_data):
        CountsToolTurns.handled.append([call.name for call in agent_data.tool_calls])
        return await super()._handle_processing_tools_state(agent_data)


@pytest.fixture
def loops():
    saved = dict(AGENT_LOOPS), dict(AGENT_LOOP_KWARGS)
    register("repeated_interaction")(RepeatedInteractionLoop)
    register("counts_tool_turns")(CountsToolTurns)
    yield
    for registry, before in zip((AGENT_LOOPS, AGENT_LOOP_KWARGS), saved):
        registry.clear()
        registry.update(before)


@pytest.fixture
def interaction_config(tmp_path):
    path = tmp_path / "interaction.yaml"
    path.write_text(YAML)
    return str(path)


def test_which_subclasses_run_in_upstreams_style():
    class OwnEpisodes(ToolAgentLoop):
        async def run_episode(self, engine, sample):
            return await super().run_episode(engine, sample)

    assert not uses_upstream_api(ToolAgentLoop)  # one instance serves every episode
    assert uses_upstream_api(RepeatedInteractionLoop)  # overrides run
    assert uses_upstream_api(CountsToolTurns)  # overrides a handler only: written against upstream
    assert not uses_upstream_api(OwnEpisodes)


def test_a_collabllm_style_loop_drives_the_handlers_token_exactly(tokenizer, tiny_model, interaction_config, loops):
    forced = ForcedRollout(tiny_model, guessing_script(tokenizer, ["5", "42"]))
    section = arc(
        R,
        **{
            "multi_turn.enable": True,
            "multi_turn.interaction_config_path": interaction_config,
            "multi_turn.num_repeat_rollouts": 2,
            "agent.default_agent_loop": "repeated_interaction",
        },
    )
    out = looped(forced, section, tokenizer, batch_with_ground_truths(tokenizer, ["42"]))
    eos = tokenizer.eos_token_id

    prompt = chat_prompt_ids(tokenizer, "What is 42?")
    turn1 = encode(tokenizer, "#### 5") + [eos]
    user_turn = encode(tokenizer, f"<|user|>{INCORRECT}<|assistant|>")
    turn2 = encode(tokenizer, "#### 42") + [eos]
    n1, nu, n2 = len(turn1), len(user_turn), len(turn2)
    assert (n1, n2) == (7, 8)  # character-level tokens: "#### 5" + eos, "#### 42" + eos
    response = out.batch["responses"][0].tolist()
    assert response[: n1 + nu + n2] == turn1 + user_turn + turn2
    mask = out.batch["response_mask"][0].tolist()
    assert mask[:n1] == [1] * 7 and mask[n1 : n1 + nu] == [0] * nu and mask[n1 + nu : n1 + nu + n2] == [1] * 8
    assert sum(mask) == 15  # only the model's 15 tokens are trained
    assert out.batch["prompts"][0][-len(prompt) :].tolist() == prompt
    # one first turn; each continuation asked the engine to continue exactly the trained prefix
    assert [assistant_turns(tokenizer, c) for c in forced.contexts] == [1, 2, 2]
    assert forced.contexts[1] == forced.contexts[2] == prompt + turn1 + user_turn

    assert out.non_tensor_batch["turn_scores"][0] == [0.0, 1.0]
    assert out.non_tensor_batch["__num_turns__"].tolist() == [4]
    (conversations,) = out.non_tensor_batch["messages"]
    expected = [
        {"role": "user", "content": "What is 42?"},
        {"role": "assistant", "content": "#### 5"},
        {"role": "user", "content": INCORRECT},
        {"role": "assistant", "content": "#### 42"},
        {"role": "user", "content": CORRECT},  # the stopping reply is in the conversation, not in the ids
    ]
    assert [[m.model_dump(exclude_none=True) for m in c] for c in conversations["messages"]] == [expected] * 2
    assert CORRECT not in tokenizer.decode(out.batch["responses"][0])


def test_no_repeats_when_the_first_turn_uses_up_the_budget(tokenizer, tiny_model, interaction_config, loops):
    forced = ForcedRollout(tiny_model, guessing_script(tokenizer, ["5"]))
    section = arc(
        4,
        **{
            "multi_turn.enable": True,
            "multi_turn.interaction_config_path": interaction_config,
            "multi_turn.num_repeat_rollouts": 3,
            "agent.default_agent_loop": "repeated_interaction",
        },
    )
    out = looped(forced, section, tokenizer, batch_with_ground_truths(tokenizer, ["42"]))
    assert out.batch["responses"][0].tolist() == encode(tokenizer, "####")  # cut at the 4-token budget
    assert out.batch["response_mask"][0].tolist() == [1] * 4
    assert out.non_tensor_batch["messages"][0] == {"messages": []}
    assert len(forced.contexts) == 1


def test_upstreams_run_with_an_overridden_handler_reads_tools_from_the_config_file(
    tokenizer, tiny_model, tmp_path, loops
):
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: verl.tools.calculator_tool.CalculatorTool\n    config: {type: native}\n")
    section = arc(
        128,
        **{
            "multi_turn.enable": True,
            "multi_turn.tool_config_path": str(tools),
            "agent.default_agent_loop": "counts_tool_turns",
        },
    )
    batch = question_batch(tokenizer, ["What is 12+34*5?"])
    CountsToolTurns.handled.clear()
    out = looped(ForcedRollout(tiny_model, calculator_script(tokenizer)), section, tokenizer, batch)
    # the same episode through this project's entry point (one shared instance, tools given directly)
    reference = AgentLoopRollout(
        ForcedRollout(tiny_model, calculator_script(tokenizer)),
        section.rollout,
        tokenizer,
        trainer_config={"actor_rollout_ref": section},
    )
    reference.default_agent = "tool_agent"
    ref = reference.generate_sequences(question_batch(tokenizer, ["What is 12+34*5?"]))
    for key in ("prompts", "responses", "input_ids", "attention_mask", "response_mask"):
        assert out.batch[key].tolist() == ref.batch[key].tolist(), key
    assert CountsToolTurns.handled == [["calculator"]]  # the overridden handler ran the one tool turn
    assert "182" in tokenizer.decode(out.batch["responses"][0])  # the calculator answered
    assert out.non_tensor_batch["tool_rewards"][0] == [0.0]  # the calculator's step reward, as upstream's
    assert out.non_tensor_batch["__num_turns__"].tolist() == [4]


class RecipeCallTool(ToolAgentLoop):
    """A recipe's own per-call helper (upstream's `_call_tool` signature): answers from its own table
    instead of running the tool, and pays 0.5 per call."""

    seen: list = []

    async def _call_tool(self, tool_call, tools_kwargs, agent_data):
        RecipeCallTool.seen.append((tool_call, tools_kwargs, agent_data.assistant_turns, type(agent_data)))
        value = {"12+34*5": 182}[json.loads(tool_call.arguments)["expression"]]
        return ToolResponse(text=f"recipe says {value}"), 0.5, {"looked_up": 1}


class CheckedCallTool(ToolAgentLoop):
    """Wraps the base helper (which runs the configured calculator through `call_tool`)."""

    async def _call_tool(self, tool_call, tools_kwargs, agent_data):
        response, reward, metrics = await super()._call_tool(tool_call, tools_kwargs, agent_data)
        return ToolResponse(text=response.text + " checked"), reward + 1.0, metrics


@pytest.fixture
def call_tool_loops():
    saved = dict(AGENT_LOOPS), dict(AGENT_LOOP_KWARGS)
    register("recipe_call_tool")(RecipeCallTool)
    register("checked_call_tool")(CheckedCallTool)
    yield
    for registry, before in zip((AGENT_LOOPS, AGENT_LOOP_KWARGS), saved):
        registry.clear()
        registry.update(before)


@pytest.mark.parametrize(
    "loop, answer, reward",
    [("recipe_call_tool", "recipe says 182", 0.5), ("checked_call_tool", "182 checked", 1.0)],
)
def test_a_subclass_overriding_upstreams_call_tool_answers_the_tool_turn(
    tokenizer, tiny_model, tmp_path, call_tool_loops, loop, answer, reward
):
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: verl.tools.calculator_tool.CalculatorTool\n    config: {type: native}\n")
    section = arc(
        256,
        **{"multi_turn.enable": True, "multi_turn.tool_config_path": str(tools), "agent.default_agent_loop": loop},
    )
    RecipeCallTool.seen.clear()
    forced = ForcedRollout(tiny_model, calculator_script(tokenizer))
    out = looped(forced, section, tokenizer, question_batch(tokenizer, ["What is 12+34*5?"]))

    eos = tokenizer.eos_token_id
    turn1 = encode(tokenizer, call_text("12+34*5")) + [eos]
    tool_turn = encode(tokenizer, f"<|user|><tool_response>{answer}</tool_response><|assistant|>")
    turn2 = encode(tokenizer, answer) + [eos]  # the script repeats the tool's answer
    n1, nt, n2 = len(turn1), len(tool_turn), len(turn2)
    assert out.batch["responses"][0, : n1 + nt + n2].tolist() == turn1 + tool_turn + turn2
    assert out.batch["response_mask"][0].tolist()[: n1 + nt + n2 + 1] == [1] * n1 + [0] * nt + [1] * n2 + [0]
    assert out.non_tensor_batch["tool_rewards"][0] == [reward]
    assert out.non_tensor_batch["__num_turns__"].tolist() == [4]
    if loop == "recipe_call_tool":  # called once, with upstream's argument types
        assert RecipeCallTool.seen == [
            (FunctionCall(name="calculator", arguments='{"expression": "12+34*5"}'), {}, 1, AgentData)
        ]
