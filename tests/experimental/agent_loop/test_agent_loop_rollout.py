"""AgentLoopRollout over the built-in engine: the single-turn loop reproduces plain generation,
rows choose their loop, tool schemas reach the chat template."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tests.config_helpers import rollout_config as typed_rollout_config
from tests.experimental.agent_loop.conftest import ForcedRollout, encode
from tests.experimental.agent_loop.test_tool_agent_loop import P, question_batch, rollout_config
from verl.experimental.agent_loop import AgentLoopBase, AgentLoopRollout, AsyncRolloutEngine, Trajectory
from verl.experimental.agent_loop.engine import rollout_batch_generator
from verl.tools.calculator_tool import CalculatorTool

pytestmark = pytest.mark.usefixtures("one_thread")

QUESTIONS = ["What is 12+34?", "What is 56+78?", "What is 10+99?", "What is 45+45?"]


@pytest.fixture(scope="module")
def hf_rollout(tokenizer):
    from verl.models import bundled_model_path
    from verl.workers.rollout.hf_rollout import HFRollout

    # auto: the weights' float32 on CPU (the YAML's bfloat16 is a GPU engine's choice)
    config = typed_rollout_config(response_length=16, prompt_length=P, calculate_log_probs=True, dtype="auto")
    return HFRollout(bundled_model_path(), config=config, tokenizer=tokenizer, device="cpu")


@pytest.mark.parametrize("agent", ["single_turn_agent", "tool_agent"])
def test_without_tool_calls_agent_loops_reproduce_plain_generation(tokenizer, hf_rollout, agent):
    batch = question_batch(tokenizer, QUESTIONS)
    batch.non_tensor_batch["agent_name"] = np.array([agent] * len(QUESTIONS), dtype=object)
    plain = hf_rollout.generate_sequences(copy.deepcopy(batch))
    looped = AgentLoopRollout(hf_rollout, rollout_config(16), tokenizer, tools=[CalculatorTool()]).generate_sequences(
        batch
    )
    for key in ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask"):
        assert torch.equal(plain.batch[key], looped.batch[key]), key
    torch.testing.assert_close(plain.batch["rollout_log_probs"], looped.batch["rollout_log_probs"])
    assert looped.non_tensor_batch["__num_turns__"].tolist() == [2] * len(QUESTIONS)


class EchoLoop(AgentLoopBase):
    """A user-defined loop: answers with the prompt's last token, without calling the engine."""

    async def run_episode(self, engine, sample):
        return Trajectory(sample.prompt_ids, sample.prompt_ids[-1:], [1], num_turns=7)


def test_each_row_runs_the_loop_its_agent_name_column_names(tokenizer, tiny_model):
    eos = tokenizer.eos_token_id
    forced = ForcedRollout(tiny_model, lambda context: encode(tokenizer, "5") + [eos])
    batch = question_batch(tokenizer, QUESTIONS[:3])
    batch.non_tensor_batch["agent_name"] = np.array(["single_turn_agent", f"{__name__}.EchoLoop", None], dtype=object)
    out = AgentLoopRollout(forced, rollout_config(8), tokenizer).generate_sequences(batch)
    assert out.non_tensor_batch["__num_turns__"].tolist() == [2, 7, 2]  # None: the default tool_agent
    assert out.batch["responses"][1, 0] == tokenizer.convert_tokens_to_ids("<|assistant|>")


def test_an_unknown_agent_name_lists_the_registered_loops(tokenizer, tiny_model):
    batch = question_batch(tokenizer, QUESTIONS[:1])
    batch.non_tensor_batch["agent_name"] = np.array(["react_agent"], dtype=object)
    rollout = AgentLoopRollout(
        ForcedRollout(tiny_model, lambda c: [tokenizer.eos_token_id]), rollout_config(8), tokenizer
    )
    with pytest.raises(
        ValueError, match=r"unknown agent loop 'react_agent'; registered loops: \['single_turn_agent', 'tool_agent'\]"
    ):
        rollout.generate_sequences(batch)


def test_tool_schemas_are_rendered_into_the_prompt_by_the_chat_template(tokenizer, tiny_model):
    with_tools = copy.deepcopy(tokenizer)
    with_tools.chat_template = (
        "{% if tools %}{{ '<|system|>tools:' }}{% for t in tools %}{{ t['function']['name'] + ';' }}{% endfor %}{% endif %}"
        + tokenizer.chat_template
    )
    forced = ForcedRollout(tiny_model, lambda context: encode(tokenizer, "46") + [tokenizer.eos_token_id])
    out = AgentLoopRollout(forced, rollout_config(8), with_tools, tools=[CalculatorTool()]).generate_sequences(
        question_batch(tokenizer, QUESTIONS[:1], width=48)
    )
    prompt = out.batch["prompts"][0][out.batch["attention_mask"][0, :48].bool()].tolist()
    assert prompt == encode(tokenizer, "<|system|>tools:calculator;<bos><|user|>What is 12+34?<|assistant|>")
    assert out.meta_info["metrics"]["agent_loop/tokenization_mismatch"] == 0.0


def test_a_prompt_that_outgrows_the_prompt_width_says_what_to_raise(tokenizer, tiny_model):
    long_template = copy.deepcopy(tokenizer)
    long_template.chat_template = "{% if tools %}{{ 'x' * 40 }}{% endif %}" + tokenizer.chat_template
    rollout = AgentLoopRollout(
        ForcedRollout(tiny_model, lambda c: [tokenizer.eos_token_id]),
        rollout_config(8),
        long_template,
        tools=[CalculatorTool()],
    )
    with pytest.raises(ValueError, match="raise data.max_prompt_length"):
        rollout.generate_sequences(question_batch(tokenizer, QUESTIONS[:1]))


def test_tensor_parallelism_is_refused_for_an_engine_without_a_tensor_parallel_group(tokenizer, tiny_model):
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2.*ForcedRollout does not"):
        AgentLoopRollout(
            ForcedRollout(tiny_model, None), rollout_config(8, rollout={"tensor_model_parallel_size": 2}), tokenizer
        )


class PerRequestEngine(AsyncRolloutEngine):
    """An async-native engine: each request is its own call (as to a server that schedules them)."""

    def __init__(self, rollout, eos_ids, pad, with_logprobs):
        self.generate_batch = rollout_batch_generator(rollout, eos_ids, pad, with_logprobs)
        self.requests = 0

    async def generate(self, prompt_ids, sampling, max_new_tokens):
        self.requests += 1
        return self.generate_batch([list(prompt_ids)], sampling, max_new_tokens)[0]


class ServerRollout(ForcedRollout):
    """A rollout whose adapter offers its own async engine."""

    def async_engine(self, eos_token_ids, pad_token_id, with_logprobs):
        self.engine = PerRequestEngine(self, eos_token_ids, pad_token_id, with_logprobs)
        return self.engine


def test_a_rollout_with_its_own_async_engine_serves_the_episodes_directly(tokenizer, tiny_model):
    server = ServerRollout(tiny_model, lambda context: encode(tokenizer, "46") + [tokenizer.eos_token_id])
    out = AgentLoopRollout(server, rollout_config(8), tokenizer).generate_sequences(
        question_batch(tokenizer, QUESTIONS)
    )
    assert server.engine.requests == len(QUESTIONS) and server.batch_sizes == [1] * len(QUESTIONS)
    assert out.batch["responses"][:, :3].tolist() == [encode(tokenizer, "46") + [tokenizer.eos_token_id]] * 4
    assert "agent_loop/engine_batches" not in out.meta_info["metrics"]


class TurnCountLoop(AgentLoopBase):
    """A loop with a constructor argument, as an agent-loop config file's extra keys give it."""

    def __init__(self, tokenizer, settings, tools=(), interactions=None, num_turns: int = 2):
        super().__init__(tokenizer, settings, tools, interactions)
        self.num_turns = num_turns

    async def run_episode(self, engine, sample):
        return Trajectory(sample.prompt_ids, sample.prompt_ids[-1:], [1], num_turns=self.num_turns)


def test_agent_loop_config_path_registers_named_loops_with_their_arguments(
    tokenizer, tiny_model, tmp_path, monkeypatch
):
    # upstream's file format: a YAML list of {name, _target_, ...}; the path is relative to the working directory
    (tmp_path / "agents.yaml").write_text(
        f"- name: counted\n  _target_: {__name__}.TurnCountLoop\n  num_turns: 5\n"
        f"- name: counted_default\n  _target_: {__name__}.TurnCountLoop\n"
    )
    monkeypatch.chdir(tmp_path)
    batch = question_batch(tokenizer, QUESTIONS[:3])
    batch.non_tensor_batch["agent_name"] = np.array(["counted", "counted_default", None], dtype=object)
    config = rollout_config(
        8, rollout={"agent": {"agent_loop_config_path": "agents.yaml", "default_agent_loop": "counted"}}
    )
    forced = ForcedRollout(tiny_model, lambda context: [tokenizer.eos_token_id])
    out = AgentLoopRollout(forced, config, tokenizer).generate_sequences(batch)
    assert out.non_tensor_batch["__num_turns__"].tolist() == [5, 2, 5]  # None: the default, from the file


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("name: x\n", r"must be a YAML list"),
        ("- name: x\n", r"entry 0 .* needs a `name` .* and a `_target_`"),
        ("- name: x\n  _target_: no_such_module_xyz.Loop\n", r"agent loop 'x' of .*: cannot import _target_"),
        ("- name: x\n  _target_: collections.OrderedDict\n", r"is not a subclass of verl.experimental.agent_loop"),
    ],
)
def test_a_bad_agent_loop_config_file_says_which_entry_and_why(tmp_path, text, error):
    from verl.experimental.agent_loop import register_agent_loops_from_file

    path = tmp_path / "agents.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        register_agent_loops_from_file(str(path))


def test_a_missing_agent_loop_config_file_names_the_key_and_the_places_tried(tmp_path, monkeypatch):
    from verl.experimental.agent_loop import register_agent_loops_from_file

    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"agent_loop_config_path='nope.yaml': no such file \(looked at .*nope"):
        register_agent_loops_from_file("nope.yaml")
