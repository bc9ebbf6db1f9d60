"""Agent loops written against upstream's API (`run(sampling_params, **row) -> AgentLoopOutput`, one
instance per episode, a `server_manager`) run here unchanged, next to this project's loops.

The loops below are written the way upstream's docs and recipes write them (imports from
`verl.experimental.agent_loop.agent_loop`, `@register`, `self.server_manager.generate(...)`,
`self.apply_chat_template(...)`); the references are plain generation, the scripted engine's tokens
and hand-worked token lists.
"""

from __future__ import annotations

import asyncio
import copy
from uuid import uuid4

import numpy as np
import pytest
import torch

from tests.config_helpers import engine_config
from tests.experimental.agent_loop.conftest import ForcedRollout, encode
from tests.experimental.agent_loop.test_tool_agent_loop import P, question_batch
from verl.experimental.agent_loop import AgentLoopRollout
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    AsyncLLMServerManager,
    register,
    uses_upstream_api,
)
from verl.experimental.agent_loop.engine import AsyncRolloutEngine, TokenOutput

pytestmark = pytest.mark.usefixtures("one_thread")

QUESTIONS = ["What is 12+34?", "What is 56+78?", "What is 10+99?"]


def arc(response_length: int = 16, **rollout):
    """The composed `actor_rollout_ref` section (upstream's defaults) with a few rollout keys set."""
    from verl.trainer.config.loader import compose_config

    overrides = ["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]
    overrides.append(f"actor_rollout_ref.rollout.response_length={response_length}")
    overrides += [f"actor_rollout_ref.rollout.{key}={value}" for key, value in rollout.items()]
    return compose_config(overrides, config_name="ppo_trainer").actor_rollout_ref


def looped(inner, section, tokenizer, batch, **kwargs):
    rollout = AgentLoopRollout(inner, section.rollout, tokenizer, trainer_config={"actor_rollout_ref": section})
    return rollout.generate_sequences(batch)


class UpstreamSingleTurn(AgentLoopBase):
    """Upstream's single-turn loop, as a user would write it."""

    async def run(self, sampling_params, **kwargs):
        prompt_ids = await self.apply_chat_template(kwargs["raw_prompt"])
        output = await self.server_manager.generate(
            request_id=uuid4().hex, prompt_ids=prompt_ids, sampling_params=sampling_params
        )
        length = self.config.actor_rollout_ref.rollout.response_length
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=output.token_ids[:length],
            response_mask=[1] * len(output.token_ids[:length]),
            response_logprobs=output.log_probs[:length] if output.log_probs else None,
            num_turns=2,
            metrics=AgentLoopMetrics(generate_sequences=0.5),
        )


@pytest.fixture(autouse=True)
def restored_registry():
    """The loop registry is process-wide: what these tests register (by `@register` or a config file)
    is removed afterwards, so other tests see the registry they expect whatever the order."""
    from verl.experimental.agent_loop.agent_loop import AGENT_LOOP_KWARGS, AGENT_LOOPS

    saved = dict(AGENT_LOOPS), dict(AGENT_LOOP_KWARGS)
    yield
    for registry, before in zip((AGENT_LOOPS, AGENT_LOOP_KWARGS), saved):
        registry.clear()
        registry.update(before)


@pytest.fixture
def registered():
    """`@register` as upstream users apply it."""
    register("upstream_single_turn")(UpstreamSingleTurn)


@pytest.fixture(scope="module")
def hf_rollout(tokenizer):
    from verl.models import bundled_model_path
    from verl.workers.rollout.hf_rollout import HFRollout

    config = engine_config(response_length=16, prompt_length=P, calculate_log_probs=True)
    return HFRollout(bundled_model_path(), config=config, tokenizer=tokenizer, device="cpu")


def test_an_upstream_style_loop_reproduces_plain_generation(tokenizer, hf_rollout, registered):
    assert uses_upstream_api(UpstreamSingleTurn)
    batch = question_batch(tokenizer, QUESTIONS)
    batch.non_tensor_batch["agent_name"] = np.array(["upstream_single_turn"] * len(QUESTIONS), dtype=object)
    plain = hf_rollout.generate_sequences(copy.deepcopy(batch))
    out = looped(hf_rollout, arc(16, calculate_log_probs=True), tokenizer, batch)
    for key in ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask"):
        assert torch.equal(plain.batch[key], out.batch[key]), key
    torch.testing.assert_close(plain.batch["rollout_log_probs"], out.batch["rollout_log_probs"])
    assert out.non_tensor_batch["__num_turns__"].tolist() == [2] * len(QUESTIONS)
    assert out.meta_info["metrics"]["agent_loop/generate_sequences"] == 0.5
    assert "rm_scores" not in out.batch  # no loop scored its episode


class UpstreamTwoTurns(AgentLoopBase):
    """Two model turns with an inserted user message between them; scores its own episode and returns
    the sampling params it was given and its constructor argument as extra fields."""

    def __init__(self, *args, bonus: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.bonus = bonus

    async def run(self, sampling_params, **kwargs):
        request = uuid4().hex
        prompt_ids = await self.apply_chat_template(kwargs["raw_prompt"])
        first = await self.server_manager.generate(request, prompt_ids=prompt_ids, sampling_params=sampling_params)
        inserted = await self.apply_chat_template([{"role": "user", "content": "sure?"}], remove_system_prompt=True)
        context = prompt_ids + first.token_ids + inserted
        second = await self.server_manager.generate(request, prompt_ids=context, sampling_params=sampling_params)
        response = first.token_ids + inserted + second.token_ids
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response,
            response_mask=[1] * len(first.token_ids) + [0] * len(inserted) + [1] * len(second.token_ids),
            reward_score=float(kwargs["index"]) + self.bonus,
            num_turns=4,
            metrics=AgentLoopMetrics(),
            extra_fields={"seen": dict(sampling_params), "turn_scores": [0.25], "stop": first.stop_reason},
        )


def test_a_multi_turn_upstream_loop_is_token_exact_scored_and_keeps_its_extra_fields(tokenizer, tiny_model, tmp_path):
    eos = tokenizer.eos_token_id
    forced = ForcedRollout(tiny_model, lambda context: encode(tokenizer, "46") + [eos])
    (tmp_path / "agents.yaml").write_text(f"- name: two_turns\n  _target_: {__name__}.UpstreamTwoTurns\n  bonus: 0.5\n")
    section = arc(32, temperature=0.7, top_p=0.9, top_k=5, **{"agent.agent_loop_config_path": tmp_path / "agents.yaml"})
    batch = question_batch(tokenizer, QUESTIONS[:2])
    batch.non_tensor_batch["agent_name"] = np.array(["two_turns"] * 2, dtype=object)
    batch.non_tensor_batch["index"] = np.array([3, 7], dtype=object)
    out = looped(forced, section, tokenizer, batch)

    answer = encode(tokenizer, "46") + [eos]
    inserted = encode(tokenizer, "<|user|>sure?<|assistant|>")  # the template's <bos> prefix cut
    expected = answer + inserted + answer
    mask = [1] * len(answer) + [0] * len(inserted) + [1] * len(answer)
    n = len(expected)
    for row in range(2):
        assert out.batch["responses"][row, :n].tolist() == expected
        assert out.batch["response_mask"][row].tolist() == mask + [0] * (32 - n)
        assert out.batch["rm_scores"][row].tolist() == [0.0] * (n - 1) + [[3.5, 7.5][row]] + [0.0] * (32 - n)
    seen = out.non_tensor_batch["seen"][0]
    # logprobs: rollout.calculate_log_probs, true by default since upstream v0.9
    assert seen == {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "repetition_penalty": 1.0, "logprobs": True}
    assert out.non_tensor_batch["turn_scores"].tolist() == [[0.25], [0.25]]
    assert out.non_tensor_batch["stop"].tolist() == ["stop", "stop"]
    assert out.non_tensor_batch["__num_turns__"].tolist() == [4, 4]


def test_validation_gives_the_loop_the_val_kwargs(tokenizer, tiny_model, tmp_path):
    forced = ForcedRollout(tiny_model, lambda context: [tokenizer.eos_token_id])
    (tmp_path / "agents.yaml").write_text(f"- name: two_turns\n  _target_: {__name__}.UpstreamTwoTurns\n")
    section = arc(
        16,
        **{
            "val_kwargs.temperature": 0.3,
            "val_kwargs.top_k": 2,
            "agent.agent_loop_config_path": tmp_path / "agents.yaml",
        },
    )
    batch = question_batch(tokenizer, QUESTIONS[:1], validate=True)
    batch.non_tensor_batch["agent_name"] = np.array(["two_turns"], dtype=object)
    batch.non_tensor_batch["index"] = np.array([0], dtype=object)
    seen = looped(forced, section, tokenizer, batch).non_tensor_batch["seen"][0]
    assert (seen["temperature"], seen["top_k"], seen["top_p"]) == (0.3, 2, 1.0)


class RecordingEngine(AsyncRolloutEngine):
    def __init__(self):
        self.calls = []

    async def generate(self, prompt_ids, sampling, max_new_tokens):
        self.calls.append((list(prompt_ids), dict(sampling), max_new_tokens))
        return TokenOutput(token_ids=[5, 6], stopped=False)


def test_the_server_manager_maps_upstream_sampling_params_onto_the_engine():
    engine = RecordingEngine()
    manager = AsyncLLMServerManager(engine, {"do_sample": True, "validate": False}, response_length=20)
    params = {"temperature": 0.5, "top_p": 0.8, "top_k": -1, "logprobs": True, "repetition_penalty": 1.0}
    out = asyncio.run(manager.generate("r1", prompt_ids=[1, 2], sampling_params={**params, "max_tokens": 8}))
    asyncio.run(manager.generate("r1", prompt_ids=[1, 2, 3], sampling_params={"max_new_tokens": 50}))
    asyncio.run(manager.generate("r1", prompt_ids=[1], sampling_params={}))
    sampled = {"do_sample": True, "validate": False, "temperature": 0.5, "top_p": 0.8, "top_k": -1}
    assert engine.calls == [
        ([1, 2], sampled, 8),
        ([1, 2, 3], {"do_sample": True, "validate": False}, 20),  # capped at the response budget
        ([1], {"do_sample": True, "validate": False}, 20),
    ]
    assert out.token_ids == [5, 6] and out.stop_reason == "length"


@pytest.mark.parametrize(
    ("params", "error"),
    [
        ({"repetition_penalty": 1.1}, r"repetition_penalty=1.1 is not supported .* \(only 1.0\)"),
        ({"min_p": 0.1}, r"keys \['min_p'\] are not supported .* supported: \['temperature'"),
    ],
)
def test_unsupported_sampling_params_are_refused(params, error):
    manager = AsyncLLMServerManager(RecordingEngine(), {}, response_length=4)
    with pytest.raises(ValueError, match=error):
        asyncio.run(manager.generate("r", prompt_ids=[1], sampling_params=params))


class ReturnsAList(AgentLoopBase):
    async def run(self, sampling_params, **kwargs):
        return [1, 2, 3]


class OverridesNothing(AgentLoopBase):
    pass


@pytest.mark.parametrize(
    ("loop", "error"),
    [
        ("ReturnsAList", (TypeError, r"ReturnsAList.run returned list, not an AgentLoopOutput")),
        ("OverridesNothing", (NotImplementedError, r"must override run_episode\(engine, sample\) .* or run\(")),
    ],
)
def test_a_loop_that_breaks_the_contract_says_how(tokenizer, tiny_model, loop, error):
    batch = question_batch(tokenizer, QUESTIONS[:1])
    batch.non_tensor_batch["agent_name"] = np.array([f"{__name__}.{loop}"], dtype=object)
    forced = ForcedRollout(tiny_model, lambda context: [tokenizer.eos_token_id])
    with pytest.raises(error[0], match=error[1]):
        looped(forced, arc(8), tokenizer, batch)


def test_a_batch_without_raw_prompt_says_which_data_key_to_set(tokenizer, tiny_model):
    batch = question_batch(tokenizer, QUESTIONS[:1])
    batch.non_tensor_batch.pop("raw_prompt")
    batch.non_tensor_batch["agent_name"] = np.array([f"{__name__}.UpstreamSingleTurn"], dtype=object)
    forced = ForcedRollout(tiny_model, lambda context: [tokenizer.eos_token_id])
    with pytest.raises(ValueError, match=r"UpstreamSingleTurn .* no raw_prompt column: set data.return_raw_chat=true"):
        looped(forced, arc(8), tokenizer, batch)


def test_the_system_prompt_helpers_find_the_templates_prefix_and_generation_prompt(tokenizer):
    from verl.utils.chat_template import extract_system_prompt_and_generation, initialize_system_prompt

    templated = copy.deepcopy(tokenizer)
    templated.chat_template = "{{ '<|system|>be brief' }}" + tokenizer.chat_template
    assert initialize_system_prompt(tokenizer) == [tokenizer.bos_token_id]  # `{{ bos_token }}` opens each chat
    system, generation = extract_system_prompt_and_generation(templated)
    assert system == encode(tokenizer, "<|system|>be brief<bos>")
    assert generation == encode(tokenizer, "<|assistant|>")


def test_the_rollout_worker_runs_an_upstream_loop_from_a_config_file_with_every_column(
    one_process, tokenizer, tmp_path
):
    """Through the real worker and the driver's generation input: the loop sees the worker's
    `actor_rollout_ref` as `self.config` and every column of its row; its scores come back as rm_scores."""
    from verl.models import bundled_model_path
    from verl.trainer.config import load_ppo_config
    from verl.trainer.ppo.generation import generation_input
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    (tmp_path / "agents.yaml").write_text(
        "- name: self_scored\n  _target_: tests.experimental.agent_loop.upstream_loops.ScoresItsOwnEpisodes\n"
    )
    cfg = load_ppo_config(
        [
            f"actor_rollout_ref.model.path={bundled_model_path()}",
            "trainer.n_gpus_per_node=1",
            "actor_rollout_ref.rollout.response_length=8",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={tmp_path / 'agents.yaml'}",
            "actor_rollout_ref.rollout.agent.default_agent_loop=self_scored",
        ],
        config_name="arith_demo",
    )
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="rollout", rollout_wrapper=AgentLoopRollout)
    worker.init_model()
    batch = question_batch(tokenizer, QUESTIONS[:2])
    batch.non_tensor_batch["data_source"] = np.array(["arith", "gsm8k"], dtype=object)
    batch.meta_info.clear()
    gen = generation_input(batch, tokenizer, 1, True, do_sample=False)
    out = worker.generate_sequences(gen)
    assert out.non_tensor_batch["source"].tolist() == ["arith", "gsm8k"]
    assert out.non_tensor_batch["model"].tolist() == [bundled_model_path()] * 2
    lengths = out.batch["attention_mask"][:, P:].sum(-1)
    for row in range(2):
        assert out.batch["rm_scores"][row].sum() == 0.25
        assert out.batch["rm_scores"][row, lengths[row] - 1] == 0.25


def test_upstreams_agent_loop_module_paths_and_gpt_oss_helpers():
    from verl.experimental.agent_loop import SingleTurnAgentLoop
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop as ByPath
    from verl.experimental.agent_loop.utils import (
        add_generation_prompt_for_gpt_oss,
        build_gpt_oss_tool_response_text,
        format_gpt_oss_tool_response_manually,
    )

    assert ByPath is SingleTurnAgentLoop
    assert format_gpt_oss_tool_response_manually("42", "calculator") == (
        "<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>42<|end|>"
    )
    assert add_generation_prompt_for_gpt_oss("x") == "x<|start|>assistant"
    text = build_gpt_oss_tool_response_text(
        [{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}], ["a", "b"]
    )
    assert text == (
        "<|start|>functions.a to=assistant<|channel|>commentary<|message|>1<|end|>"
        "<|start|>functions.b to=assistant<|channel|>commentary<|message|>2<|end|><|start|>assistant"
    )


def test_get_trajectory_info_numbers_the_repeats_of_each_prompt():
    import asyncio

    from verl.experimental.agent_loop.agent_loop import get_trajectory_info

    info = asyncio.run(get_trajectory_info(7, [4, 4, 4, 9, 4, 9, 9], True))
    assert [(i["sample_index"], i["rollout_n"]) for i in info] == [
        (4, 0),
        (4, 1),
        (4, 2),
        (9, 0),
        (4, 0),
        (9, 0),
        (9, 1),
    ]
    assert {(i["step"], i["validate"]) for i in info} == {(7, True)}
