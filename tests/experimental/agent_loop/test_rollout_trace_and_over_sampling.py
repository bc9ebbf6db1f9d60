"""AgentLoopRollout's tracing (rollout.trace.*) into a real MLflow store and its over-sampling cut
(rollout.over_sample_rate), over the bundled tiny model behind scripted responses."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tests.experimental.agent_loop.conftest import ForcedRollout, encode
from tests.experimental.agent_loop.test_tool_agent_loop import (
    P,
    assistant_turns,
    calculator_script,
    call_text,
    question_batch,
    rollout_config,
)
from verl.experimental.agent_loop import AgentLoopRollout
from verl.tools.calculator_tool import CalculatorTool
from verl.utils.rollout_trace import RolloutTraceConfig

pytestmark = pytest.mark.usefixtures("one_thread")

QUESTIONS = ["What is 12+34*5?", "What is 7*8-9?", "What is 2+3?"]


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch, request):
    """A fresh tracer configuration and an MLflow tracking store under tmp_path; the process-wide
    MLflow state the backend sets (async logging, tracking URI) is undone afterwards."""
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    RolloutTraceConfig.reset()

    def restore():
        RolloutTraceConfig.reset()
        mlflow.config.enable_async_logging(False)
        mlflow.set_tracking_uri(None)

    request.addfinalizer(restore)
    return mlflow


def traced_rollout(tokenizer, tiny_model, **trace):
    forced = ForcedRollout(tiny_model, calculator_script(tokenizer))
    config = rollout_config(rollout={"trace": {"backend": "mlflow", **trace}})
    return AgentLoopRollout(
        forced, config, tokenizer, tools=[CalculatorTool()], project_name="verl_test", experiment_name="run1"
    )


def indexed_batch(tokenizer, questions, index, n=1, **meta):
    batch = question_batch(tokenizer, questions, **meta)
    batch.non_tensor_batch["index"] = np.array(index, dtype=object)
    return batch.repeat(repeat_times=n, interleave=True) if n > 1 else batch


def stored_traces(mlflow):
    mlflow.flush_trace_async_logging()
    return mlflow.search_traces(return_type="list")


def test_each_episode_is_one_trace_tagged_as_upstream_with_spans_for_model_turns_and_tool_calls(
    tokenizer, tiny_model, mlflow_store
):
    rollout = traced_rollout(tokenizer, tiny_model, token2text=True)
    out = rollout.generate_sequences(indexed_batch(tokenizer, QUESTIONS[:2], [7, 9], n=2, global_steps=3))

    traces = stored_traces(mlflow_store)
    assert len(traces) == 4
    tags = sorted(
        tuple(t.info.tags[k] for k in ("sample_index", "rollout_n", "step", "validate", "experiment_name"))
        for t in traces
    )
    assert tags == [
        ("7", "0", "3", "False", "run1"),
        ("7", "1", "3", "False", "run1"),
        ("9", "0", "3", "False", "run1"),
        ("9", "1", "3", "False", "run1"),
    ]
    eos = tokenizer.eos_token_id
    for trace in traces:
        names = sorted(span.name for span in trace.data.spans)
        # the episode span, its two model turns (call the tool, state its answer) and the tool call
        assert names == sorted(
            ["agent_loop", "AgentLoopRollout.run_episode", "EpisodeEngine.generate", "EpisodeEngine.generate"]
            + ["ToolAgentLoop.call_tool"]
        ), names
        spans = {span.name: span for span in trace.data.spans}
        expression, answer = ("12+34*5", "182") if trace.info.tags["sample_index"] == "7" else ("7*8-9", "47")
        tool = spans["ToolAgentLoop.call_tool"]
        assert tool.inputs["call"] == {"name": "calculator", "arguments": {"expression": expression}}
        assert tool.outputs == [answer, True, 0.0]  # text, success, the tool's step reward
        turns = sorted(
            (s for s in trace.data.spans if s.name == "EpisodeEngine.generate"),
            key=lambda s: len(s.inputs["prompt_ids"]),
        )
        assert turns[0].outputs["token_ids"] == encode(tokenizer, call_text(expression)) + [eos]
        assert turns[1].outputs["text"] == tokenizer.decode(encode(tokenizer, answer) + [eos])  # token2text
        episode = spans["AgentLoopRollout.run_episode"]
        assert episode.outputs["response_text"].endswith(tokenizer.decode(encode(tokenizer, answer) + [eos]))

    # tracing observes, it changes nothing: the same rollout without a backend returns the same tensors
    RolloutTraceConfig.reset()
    plain = AgentLoopRollout(
        ForcedRollout(tiny_model, calculator_script(tokenizer)), rollout_config(), tokenizer, tools=[CalculatorTool()]
    ).generate_sequences(indexed_batch(tokenizer, QUESTIONS[:2], [7, 9], n=2, global_steps=3))
    for key in ("input_ids", "attention_mask", "response_mask", "position_ids", "rollout_log_probs"):
        assert torch.equal(out.batch[key], plain.batch[key]), key


def test_max_samples_per_step_per_worker_traces_all_rollouts_of_that_many_sample_indices(
    tokenizer, tiny_model, mlflow_store
):
    rollout = traced_rollout(tokenizer, tiny_model, max_samples_per_step_per_worker=1)
    rollout.generate_sequences(indexed_batch(tokenizer, QUESTIONS, [0, 1, 2], global_steps=1))
    first = stored_traces(mlflow_store)
    assert len(first) == 1 and first[0].info.tags["step"] == "1"

    rollout.generate_sequences(indexed_batch(tokenizer, QUESTIONS, [0, 1, 2], n=2, global_steps=2, validate=True))
    second = [t for t in stored_traces(mlflow_store) if t.info.tags["step"] == "2"]
    assert len(second) == 2  # one sample index, both of its rollouts
    assert len({t.info.tags["sample_index"] for t in second}) == 1
    assert sorted(t.info.tags["rollout_n"] for t in second) == ["0", "1"]
    assert {t.info.tags["validate"] for t in second} == {"True"}


def test_a_trace_backend_without_the_run_names_says_what_to_pass(tokenizer, tiny_model):
    RolloutTraceConfig.reset()
    forced = ForcedRollout(tiny_model, calculator_script(tokenizer))
    with pytest.raises(ValueError, match="pass project_name and experiment_name to AgentLoopRollout"):
        AgentLoopRollout(forced, rollout_config(rollout={"trace": {"backend": "mlflow"}}), tokenizer)
    assert RolloutTraceConfig.get_backend() is None


# ------------------------------------------------------------------------------ over-sampling
def tool_calls_then_answer(tokenizer):
    """Question `Q<k>: ...` calls the calculator k times, then answers: episode k finishes after k + 1 model
    turns, so the episodes finish one engine batch apart, in order of k."""
    eos = tokenizer.eos_token_id

    def script(context):
        text = tokenizer.decode(context)
        calls = int(re.search(r"Q(\d):", text).group(1))
        if assistant_turns(tokenizer, context) <= calls:
            return encode(tokenizer, call_text("1+1")) + [eos]
        return encode(tokenizer, "2") + [eos]

    return script


@pytest.mark.parametrize(("rate", "num_finished"), [(0.5, 2), (0.3, 2), (0.1, 3), (0.9, 1)])
def test_over_sampling_finishes_int_b_times_one_minus_rate_episodes_and_masks_the_rest(
    tokenizer, tiny_model, rate, num_finished
):
    """B = 4: int(4 * (1 - rate)) episodes finish (upstream's rounding; at least one)."""
    forced = ForcedRollout(tiny_model, tool_calls_then_answer(tokenizer))
    config = rollout_config(512, rollout={"over_sample_rate": rate})
    rollout = AgentLoopRollout(forced, config, tokenizer, tools=[CalculatorTool()])
    questions = [f"Q{k}: add" for k in (3, 0, 2, 1)]  # finishing order: rows 1, 3, 2, 0
    batch = question_batch(tokenizer, questions)
    out = rollout.generate_sequences(batch)

    finished_rows = sorted([1, 3, 2, 0][:num_finished])
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    response_lengths = out.batch["attention_mask"][:, P:].sum(-1).tolist()
    for row, k in enumerate((3, 0, 2, 1)):
        if row in finished_rows:
            assert out.batch["response_mask"][row].sum() > 0
            assert out.non_tensor_batch["__num_turns__"][row] == 2 + 2 * k
            n = response_lengths[row]
            assert out.batch["responses"][row, n - 2 : n].tolist() == encode(tokenizer, "2") + [eos]
        else:  # cut: the prompt as it came, an empty response, nothing to train on
            assert response_lengths[row] == 0
            assert out.batch["response_mask"][row].eq(0).all()
            assert out.batch["rollout_log_probs"][row].eq(0).all()
            assert out.batch["responses"][row].eq(pad).all()
            assert out.non_tensor_batch["__num_turns__"][row] == 0
        assert torch.equal(out.batch["prompts"][row], batch.batch["input_ids"][row])
        assert torch.equal(out.batch["attention_mask"][row, :P], batch.batch["attention_mask"][row])
    assert out.meta_info["metrics"]["agent_loop/aborted_ratio"] == pytest.approx(1 - num_finished / 4)


def test_validation_rollouts_are_never_cut(tokenizer, tiny_model):
    forced = ForcedRollout(tiny_model, tool_calls_then_answer(tokenizer))
    rollout = AgentLoopRollout(
        forced, rollout_config(512, rollout={"over_sample_rate": 0.5}), tokenizer, tools=[CalculatorTool()]
    )
    out = rollout.generate_sequences(question_batch(tokenizer, [f"Q{k}: add" for k in (3, 0, 2, 1)], validate=True))
    assert out.non_tensor_batch["__num_turns__"].tolist() == [8, 2, 6, 4]
    assert "agent_loop/aborted_ratio" not in out.meta_info["metrics"]


def test_an_over_sample_rate_of_one_is_refused(tokenizer, tiny_model):
    forced = ForcedRollout(tiny_model, tool_calls_then_answer(tokenizer))
    with pytest.raises(ValueError, match=r"over_sample_rate=1.0 must be in \[0, 1\)"):
        AgentLoopRollout(forced, rollout_config(512, rollout={"over_sample_rate": 1.0}), tokenizer)
