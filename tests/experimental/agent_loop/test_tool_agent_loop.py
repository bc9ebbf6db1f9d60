"""ToolAgentLoop through AgentLoopRollout, on the bundled tiny model with scripted model turns.

Every expected token sequence is written out independently of the implementation: the scripted
turns are encoded from their text, and the whole conversation is rendered in one call of the chat
template. Log-probs are checked against the trainer's own log-prob pass over the finished batch.
"""

from __future__ import annotations

import asyncio
import json
import re

import numpy as np
import pytest
import torch

from tests.config_helpers import rollout_config as typed_rollout_config
from tests.experimental.agent_loop.conftest import ForcedRollout, chat_prompt_ids, encode
from verl.experimental.agent_loop import AgentLoopRollout
from verl.protocol import DataProto
from verl.tools.calculator_tool import CalculatorTool
from verl.tools.function_tool import FunctionTool

pytestmark = pytest.mark.usefixtures("one_thread")

P = 24


def call_text(expression: str, name: str = "calculator") -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": {"expression": expression}}) + "</tool_call>"


def question_batch(tokenizer, questions: list[str], width: int = P, **meta) -> DataProto:
    """Chat prompts left-padded to `width`, with their messages as `raw_prompt` (as the dataset returns them)."""
    rows = [chat_prompt_ids(tokenizer, q) for q in questions]
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    raw = np.empty(len(questions), dtype=object)
    raw[:] = [[{"role": "user", "content": q}] for q in questions]
    meta = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "do_sample": False, **meta}
    return DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
        non_tensors={"raw_prompt": raw},
        meta_info=meta,
    )


def assistant_turns(tokenizer, context: list[int]) -> int:
    return context.count(tokenizer.convert_tokens_to_ids("<|assistant|>"))


def calculator_script(tokenizer):
    """Turn 1: call the calculator on the question's expression; turn 2: state the tool's answer."""
    eos = tokenizer.eos_token_id

    def script(context):
        text = tokenizer.decode(context)
        expression = re.search(r"What is ([0-9+*-]+)\?", text).group(1)
        if assistant_turns(tokenizer, context) == 1:
            return encode(tokenizer, call_text(expression)) + [eos]
        answer = re.findall(r"<tool_response>(.*?)</tool_response>", text)[-1]
        return encode(tokenizer, answer) + [eos]

    return script


def rollout_config(response_length=128, rollout: dict | None = None, **multi_turn):
    """The YAML's rollout config with multi-turn on, `tool_agent` for rows that name no loop (what
    upstream's multi-turn configs set), log-probs, `multi_turn` keys and `rollout` (other keys) merged in."""
    values = {
        "response_length": response_length,
        "calculate_log_probs": True,
        "multi_turn": {"enable": True, **multi_turn},
        "agent": {"default_agent_loop": "tool_agent"},
    }
    for key, value in (rollout or {}).items():
        values[key] = {**values[key], **value} if isinstance(values.get(key), dict) else value
    return typed_rollout_config(**values)


def test_tool_call_episode_is_token_exact_and_trains_only_on_model_tokens(tokenizer, tiny_model):
    forced = ForcedRollout(tiny_model, calculator_script(tokenizer))
    rollout = AgentLoopRollout(forced, rollout_config(), tokenizer, tools=[CalculatorTool()])
    questions = ["What is 12+34*5?", "What is 7*8-9?"]
    out = rollout.generate_sequences(question_batch(tokenizer, questions))
    eos = tokenizer.eos_token_id

    for row, (question, expression, answer) in enumerate(zip(questions, ["12+34*5", "7*8-9"], ["182", "47"])):
        turn1 = encode(tokenizer, call_text(expression)) + [eos]
        tool_turn = encode(tokenizer, f"<|user|><tool_response>{answer}</tool_response><|assistant|>")
        turn2 = encode(tokenizer, answer) + [eos]
        expected = turn1 + tool_turn + turn2
        n = len(expected)
        assert out.batch["responses"][row, :n].tolist() == expected
        assert out.batch["responses"][row, n:].eq(tokenizer.pad_token_id).all()
        assert out.batch["response_mask"][row].tolist() == [1] * len(turn1) + [0] * len(tool_turn) + [1] * len(
            turn2
        ) + [0] * (128 - n)
        assert out.batch["attention_mask"][row, P:].tolist() == [1] * n + [0] * (128 - n)

        # The whole sequence is exactly the chat template's rendering of the conversation.
        conversation = [
            {"role": "user", "content": question},
            {"role": "assistant", "content": call_text(expression)},
            {"role": "tool", "content": answer},
            {"role": "assistant", "content": answer},
        ]
        rendered = encode(tokenizer, tokenizer.apply_chat_template(conversation, tokenize=False))
        sequence = out.batch["input_ids"][row][out.batch["attention_mask"][row].bool()].tolist()
        assert sequence == rendered
        # position ids count the attended tokens, as the trainer's forward expects
        positions = out.batch["position_ids"][row][out.batch["attention_mask"][row].bool()]
        assert positions.tolist() == list(range(len(rendered)))

    # the engine was asked to continue exactly the prefix the trainer will see
    second_turn_contexts = [c for c in forced.contexts if assistant_turns(tokenizer, c) == 2]
    prompt = chat_prompt_ids(tokenizer, questions[0])
    turn1 = encode(tokenizer, call_text("12+34*5")) + [eos]
    assert prompt + turn1 + encode(tokenizer, "<|user|><tool_response>182</tool_response><|assistant|>") in (
        second_turn_contexts
    )
    assert out.non_tensor_batch["__num_turns__"].tolist() == [4, 4]
    metrics = out.meta_info["metrics"]
    assert metrics["agent_loop/tool_calls"] == 1.0
    assert metrics["agent_loop/tool_errors"] == 0.0
    assert metrics["agent_loop/tokenization_mismatch"] == 0.0
    assert metrics["agent_loop/engine_batches"] == 2.0  # both episodes' turns shared one engine call each


def test_rollout_log_probs_equal_the_trainers_log_probs_on_model_tokens(tokenizer, tiny_model):
    """Per-turn generation contexts and the trainer's single forward over the finished sequence
    agree token for token: same ids, same positions, same log-probs."""
    from verl.workers.actor import DataParallelPPOActor

    forced = ForcedRollout(tiny_model, calculator_script(tokenizer))
    rollout = AgentLoopRollout(forced, rollout_config(), tokenizer, tools=[CalculatorTool()])
    out = rollout.generate_sequences(question_batch(tokenizer, ["What is 12+34*5?", "What is 99*99+1?"]))

    actor_cfg = {"ppo_micro_batch_size_per_gpu": 2, "use_remove_padding": False, "ulysses_sequence_parallel_size": 1}
    actor = DataParallelPPOActor(actor_cfg, tiny_model)
    data = out.select(batch_keys=["responses", "input_ids", "attention_mask", "position_ids", "response_mask"])
    data.meta_info.update(micro_batch_size=2, temperature=1.0, use_dynamic_bsz=False)
    trainer_log_probs, _ = actor.compute_log_prob(data, calculate_entropy=False)

    mask = out.batch["response_mask"].bool()
    torch.testing.assert_close(trainer_log_probs[mask], out.batch["rollout_log_probs"][mask], atol=2e-5, rtol=0)
    assert out.batch["rollout_log_probs"][~mask].eq(0).all()


def test_generated_ids_are_kept_verbatim_even_when_re_tokenising_would_change_them(tokenizer, tiny_model):
    """The model spells '<eos>' with five byte tokens; decoding and re-encoding would turn them into
    the one special token. The trajectory keeps the five, and the sanity check reports the drift."""
    eos = tokenizer.eos_token_id
    spelled = [tokenizer.convert_tokens_to_ids(c) for c in "<eos>"]
    forced = ForcedRollout(tiny_model, lambda context: encode(tokenizer, "1") + spelled + [eos])
    batch = question_batch(tokenizer, ["What is 1+0?"])

    strict = AgentLoopRollout(forced, rollout_config(), tokenizer).generate_sequences(batch)
    response = strict.batch["responses"][0][strict.batch["response_mask"][0].bool()].tolist()
    assert response == encode(tokenizer, "1") + spelled + [eos]
    assert tokenizer.decode(response[:-1]) == "1<eos>" and encode(tokenizer, "1<eos>") == encode(tokenizer, "1") + [eos]
    assert strict.meta_info["metrics"]["agent_loop/tokenization_mismatch"] == 1.0

    lenient = AgentLoopRollout(forced, rollout_config(tokenization_sanity_check_mode="ignore_strippable"), tokenizer)
    assert lenient.generate_sequences(batch).meta_info["metrics"]["agent_loop/tokenization_mismatch"] == 0.0


def test_malformed_and_unknown_calls_are_answered_with_error_messages(tokenizer, tiny_model):
    eos = tokenizer.eos_token_id
    first = '<tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>{not json</tool_call>'

    def script(context):
        return encode(tokenizer, first if assistant_turns(tokenizer, context) == 1 else "ok") + [eos]

    loop_rollout = AgentLoopRollout(
        ForcedRollout(tiny_model, script),
        rollout_config(response_length=512, max_parallel_calls=4),
        tokenizer,
        tools=[CalculatorTool()],
    )
    out = loop_rollout.generate_sequences(question_batch(tokenizer, ["What is 1+1?"]))
    text = tokenizer.decode(out.batch["responses"][0][out.batch["attention_mask"][0, P:].bool()])
    assert "<tool_response>Error: unknown tool 'nope'; available tools: calculator</tool_response>" in text
    assert "<tool_response>Error: the tool call is not valid JSON" in text
    assert text.endswith("<|assistant|>ok<eos>")
    assert out.meta_info["metrics"]["agent_loop/tool_errors"] == 2.0
    assert out.non_tensor_batch["__num_turns__"].tolist() == [4]  # user, assistant, tool turn (2 messages), assistant


def always_calls(tokenizer):
    eos = tokenizer.eos_token_id
    return lambda context: encode(tokenizer, call_text("1+1")) + [eos]


def test_episode_stops_at_max_assistant_turns_on_a_model_turn(tokenizer, tiny_model):
    rollout = AgentLoopRollout(
        ForcedRollout(tiny_model, always_calls(tokenizer)),
        rollout_config(response_length=512, max_assistant_turns=3),
        tokenizer,
        tools=[CalculatorTool()],
    )
    out = rollout.generate_sequences(question_batch(tokenizer, ["What is 1+1?"]))
    assert out.non_tensor_batch["__num_turns__"].tolist() == [1 + 3 + 2]
    n = int(out.batch["attention_mask"][0, P:].sum())
    assert out.batch["response_mask"][0, n - 1] == 1  # the last token is the model's


def test_tool_answer_that_leaves_no_room_for_the_model_ends_the_episode(tokenizer, tiny_model):
    turn = encode(tokenizer, call_text("1+1")) + [tokenizer.eos_token_id]
    rollout = AgentLoopRollout(
        ForcedRollout(tiny_model, always_calls(tokenizer)),
        rollout_config(response_length=len(turn) + 10),  # the tool turn alone is longer than 10 tokens
        tokenizer,
        tools=[CalculatorTool()],
    )
    out = rollout.generate_sequences(question_batch(tokenizer, ["What is 1+1?"]))
    assert out.batch["response_mask"][0].tolist() == [1] * len(turn) + [0] * 10
    assert out.non_tensor_batch["__num_turns__"].tolist() == [2]


def test_a_turn_cut_by_the_response_budget_ends_the_episode(tokenizer, tiny_model):
    rollout = AgentLoopRollout(
        ForcedRollout(tiny_model, always_calls(tokenizer)), rollout_config(response_length=20), tokenizer
    )
    out = rollout.generate_sequences(question_batch(tokenizer, ["What is 1+1?"]))
    assert out.batch["response_mask"][0].tolist() == [1] * 20
    assert out.batch["responses"][0].tolist() == encode(tokenizer, call_text("1+1"))[:20]
    assert "agent_loop/tokenization_mismatch" not in out.meta_info["metrics"]  # no finished message to compare


def test_a_tool_that_overruns_its_timeout_is_answered_with_an_error(tokenizer, tiny_model):
    async def calculator(expression: str) -> str:
        await asyncio.sleep(30)
        return "never"

    eos = tokenizer.eos_token_id

    def script(context):
        return encode(tokenizer, call_text("1+1") if assistant_turns(tokenizer, context) == 1 else "2") + [eos]

    slow = FunctionTool(calculator, config={"timeout": 0.2})
    rollout = AgentLoopRollout(ForcedRollout(tiny_model, script), rollout_config(256), tokenizer, tools=[slow])
    out = rollout.generate_sequences(question_batch(tokenizer, ["What is 1+1?"]))
    text = tokenizer.decode(out.batch["responses"][0][out.batch["attention_mask"][0, P:].bool()])
    assert "<tool_response>Error: tool 'calculator' timed out after 0.2 s</tool_response>" in text


def test_long_tool_answers_are_cut_on_the_configured_side(tokenizer, tiny_model):
    eos = tokenizer.eos_token_id

    def script(context):
        return encode(tokenizer, call_text("1") if assistant_turns(tokenizer, context) == 1 else "x") + [eos]

    def calculator(expression: str) -> str:
        return "0123456789" * 3

    rollout = AgentLoopRollout(
        ForcedRollout(tiny_model, script),
        rollout_config(256, max_tool_response_length=10, tool_response_truncate_side="middle"),
        tokenizer,
        tools=[FunctionTool(calculator)],
    )
    out = rollout.generate_sequences(question_batch(tokenizer, ["What is 1?"]))
    text = tokenizer.decode(out.batch["responses"][0][out.batch["attention_mask"][0, P:].bool()])
    assert "<tool_response>01234...(truncated)...56789</tool_response>" in text


def test_a_blocking_function_that_overruns_its_timeout_does_not_hold_up_the_rollout(tokenizer, tiny_model):
    import threading

    # The function blocks until the test releases it (60 s at most), and a thread cannot be
    # cancelled: a rollout that waited for it could only return after the function did. Checked by
    # that order of events, not by a wall-clock bound that depends on the machine's load.
    release, returned = threading.Event(), threading.Event()

    def calculator(expression: str) -> str:
        release.wait(timeout=60)
        returned.set()
        return "late"

    eos = tokenizer.eos_token_id

    def script(context):
        return encode(tokenizer, call_text("1+1") if assistant_turns(tokenizer, context) == 1 else "2") + [eos]

    tool = FunctionTool(calculator, config={"timeout": 0.2})
    rollout = AgentLoopRollout(ForcedRollout(tiny_model, script), rollout_config(256), tokenizer, tools=[tool])
    try:
        out = rollout.generate_sequences(question_batch(tokenizer, ["What is 1+1?"]))
        assert not returned.is_set(), "the rollout waited for the overrunning function to return"
    finally:
        release.set()
    assert out.meta_info["metrics"]["agent_loop/tool_errors"] == 1.0


def test_text_the_template_puts_after_the_end_of_turn_token_goes_into_the_tool_turn(tokenizer, tiny_model):
    """Like Qwen's template (a newline after `<|im_end|>`): the tool turn starts with that newline,
    so the sequence is the template's rendering, except the final newline the model never writes."""
    import copy

    qwen_like = copy.deepcopy(tokenizer)
    qwen_like.chat_template = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] == 'user' %}{{ '<|user|>' + m['content'] + '\\n' }}"
        "{% elif m['role'] == 'assistant' %}{{ '<|assistant|>' + m['content'] + eos_token + '\\n' }}"
        "{% else %}{{ '<|user|><tool_response>' + m['content'] + '</tool_response>\\n' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    )
    forced = ForcedRollout(tiny_model, calculator_script(tokenizer))
    rollout = AgentLoopRollout(forced, rollout_config(), qwen_like, tools=[CalculatorTool()])
    out = rollout.generate_sequences(question_batch(tokenizer, ["What is 12+34*5?"]))  # re-rendered by this template

    eos = tokenizer.eos_token_id
    tool_turn = encode(tokenizer, "\n<|user|><tool_response>182</tool_response>\n<|assistant|>")
    expected = encode(tokenizer, call_text("12+34*5")) + [eos] + tool_turn + encode(tokenizer, "182") + [eos]
    assert out.batch["responses"][0, : len(expected)].tolist() == expected
    assert out.batch["prompts"][0, -3:].tolist() == encode(tokenizer, "?\n<|assistant|>")
    assert out.meta_info["metrics"]["agent_loop/tokenization_mismatch"] == 0.0


class _VersionedForcedRollout(ForcedRollout):
    """ForcedRollout with a weight version, as a rollout worker of asynchronous training holds one:
    with `partial_rollout` in a request it asks its `weight_refresh` before the batch (the engines
    ask between decode steps) and stamps every row with the version it generated with."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.weight_refresh = None
        self.metas: list[dict] = []

    def generate_sequences(self, prompts):
        self.metas.append(dict(prompts.meta_info))
        refresh = self.weight_refresh if prompts.meta_info.get("partial_rollout") else None
        if refresh is not None and refresh.pending():
            refresh.load()
        out = super().generate_sequences(prompts)
        if refresh is not None:
            out.non_tensor_batch["weight_version"] = np.full(len(out), refresh.version, dtype=np.int64)
            out.non_tensor_batch["weight_version_max"] = np.full(len(out), refresh.version, dtype=np.int64)
        return out


class _NewWeightsAfterFirstBatch:
    """Newer weights are announced once the engine has run its first batch."""

    def __init__(self, rollout):
        self.rollout, self.version, self.checks = rollout, 0, 0

    def pending(self) -> bool:
        self.checks += 1
        return self.version == 0 and len(self.rollout.batch_sizes) >= 1

    def load(self) -> int:
        self.version = 1
        return self.version


def test_partial_rollouts_tag_each_episode_with_the_versions_of_all_its_model_turns(tokenizer, tiny_model):
    """Turn 1 of both episodes runs with v0, the weights change before turn 2: each episode spans
    v0..v1. The partial-rollout keys reach the engine with every turn; without them the engine's
    refresh is never consulted and the rows carry no version (the worker stamps its own)."""
    forced = _VersionedForcedRollout(tiny_model, calculator_script(tokenizer))
    rollout = AgentLoopRollout(forced, rollout_config(), tokenizer, tools=[CalculatorTool()])
    rollout.weight_refresh = _NewWeightsAfterFirstBatch(forced)  # the worker sets it on the wrapper
    assert forced.weight_refresh is rollout.weight_refresh
    questions = ["What is 12+34*5?", "What is 7*8-9?"]
    out = rollout.generate_sequences(
        question_batch(tokenizer, questions, partial_rollout=True, partial_rollout_check_steps=4)
    )
    assert out.non_tensor_batch["weight_version"].tolist() == [0, 0]
    assert out.non_tensor_batch["weight_version_max"].tolist() == [1, 1]
    assert forced.batch_sizes == [2, 2]  # both episodes' turns shared each engine call
    assert all(m["partial_rollout"] is True and m["partial_rollout_check_steps"] == 4 for m in forced.metas)
    # the episodes themselves are unchanged by the tagging
    assert out.non_tensor_batch["__num_turns__"].tolist() == [4, 4]

    # episodes run wholly after the switch carry the new version alone
    one_turn = AgentLoopRollout(forced, rollout_config(), tokenizer, tools=[CalculatorTool()])
    out = one_turn.generate_sequences(
        question_batch(tokenizer, questions[:1], partial_rollout=True, partial_rollout_check_steps=4)
    )
    assert out.non_tensor_batch["weight_version"].tolist() == [1]

    plain = _VersionedForcedRollout(tiny_model, calculator_script(tokenizer))
    refresh = _NewWeightsAfterFirstBatch(plain)
    rollout = AgentLoopRollout(plain, rollout_config(), tokenizer, tools=[CalculatorTool()])
    rollout.weight_refresh = refresh
    out = rollout.generate_sequences(question_batch(tokenizer, questions))
    assert refresh.checks == 0 and "weight_version" not in out.non_tensor_batch


@pytest.mark.parametrize(("default", "runs_tools"), [("single_turn_agent", False), ("tool_agent", True)])
def test_rows_without_an_agent_name_run_rollout_agent_default_agent_loop(tokenizer, tiny_model, default, runs_tools):
    """Upstream's `rollout.agent.default_agent_loop` picks the loop of a row with no `agent_name`: the
    single-turn loop keeps the model's tool call as its answer, the tool loop runs the tool and continues."""
    forced = ForcedRollout(tiny_model, calculator_script(tokenizer))
    config = rollout_config(rollout={"agent": {"default_agent_loop": default}})
    rollout = AgentLoopRollout(forced, config, tokenizer, tools=[CalculatorTool()])
    out = rollout.generate_sequences(question_batch(tokenizer, ["What is 12+34*5?"]))
    length = int(out.batch["attention_mask"][0, P:].sum())
    response = tokenizer.decode(out.batch["responses"][0, :length].tolist())
    assert call_text("12+34*5") in response
    assert ("<tool_response>182</tool_response>" in response) is runs_tools, response
