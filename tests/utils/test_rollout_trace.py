"""verl.utils.rollout_trace: pass-through without a recording backend, spans and tags with MLflow."""

import asyncio
import logging
import sys

import pytest

from verl.utils.rollout_trace import RolloutTraceConfig, rollout_trace_attr, rollout_trace_op


class Agent:
    def __init__(self):
        self.calls = 0

    @rollout_trace_op
    async def generate(self, prompt, n=2):
        self.calls += 1
        return {"out": prompt * n}

    @rollout_trace_op
    def score(self, x):
        return x + 1


@pytest.fixture
def fresh_config():
    RolloutTraceConfig.reset()
    yield
    RolloutTraceConfig.reset()


def test_without_backend_calls_pass_through(fresh_config):
    agent = Agent()

    async def run():
        with rollout_trace_attr(sample_index=0, step=1):
            return await agent.generate("a", n=3)

    assert asyncio.run(run()) == {"out": "aaa"} and agent.score(1) == 2 and agent.calls == 1
    assert RolloutTraceConfig.get_backend() is None


@pytest.mark.parametrize("backend", ["dummy", "wandb"])
def test_a_non_recording_backend_is_kept_and_calls_pass_through_without_importing_a_tracer(
    fresh_config, backend, monkeypatch
):
    # a weave module whose every use fails: nothing may reach for a tracer under these backends
    monkeypatch.setitem(sys.modules, "weave", None)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    RolloutTraceConfig.init("p", "e", backend)
    agent = Agent()

    async def run():
        with rollout_trace_attr(sample_index=0, step=1):
            first = await agent.generate("a", n=3)
        with rollout_trace_attr(step=2, trace=False):
            second = await agent.generate("b")
        return first, second

    assert asyncio.run(run()) == ({"out": "aaa"}, {"out": "bb"}) and agent.score(4) == 5
    assert RolloutTraceConfig.get_backend() == backend and RolloutTraceConfig.recording_backend() is None


def test_only_a_misspelt_backend_name_is_warned_about(fresh_config, caplog):
    with caplog.at_level(logging.WARNING, logger="verl.utils.rollout_trace"):
        RolloutTraceConfig.init("p", "e", "dummy")
    assert caplog.records == []
    RolloutTraceConfig.reset()
    with caplog.at_level(logging.WARNING, logger="verl.utils.rollout_trace"):
        RolloutTraceConfig.init("p", "e", "wandb")
    assert "'wandb' records nothing" in caplog.text and "['weave', 'mlflow']" in caplog.text


def test_mlflow_backend_records_spans_inputs_outputs_and_tags(fresh_config, tmp_path, monkeypatch, request):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    RolloutTraceConfig.init("verl_trace_test", "exp1", "mlflow")
    # the backend sets process-wide mlflow state (async logging, tracking URI): undo it for later tests
    request.addfinalizer(lambda: (mlflow.config.enable_async_logging(False), mlflow.set_tracking_uri(None)))
    agent = Agent()

    async def run():
        with rollout_trace_attr(sample_index=3, step=7, rollout_n=1):
            first = await agent.generate("ab")
        with rollout_trace_attr(step=8, trace=False):
            await agent.generate("zz")  # tracing off inside this block
        return first

    assert asyncio.run(run()) == {"out": "abab"} and agent.calls == 2
    assert agent.score(1) == 2
    mlflow.flush_trace_async_logging()
    traces = mlflow.search_traces(return_type="list")
    spans = {tuple(s.name for s in t.data.spans): t for t in traces}
    assert set(spans) == {("Agent.score",), ("rollout_trace", "Agent.generate")}
    tagged = spans[("rollout_trace", "Agent.generate")]
    assert {k: tagged.info.tags[k] for k in ("sample_index", "step", "rollout_n", "validate", "experiment_name")} == {
        "sample_index": "3",
        "step": "7",
        "rollout_n": "1",
        "validate": "False",
        "experiment_name": "exp1",
    }
    generate = tagged.data.spans[1]
    assert generate.inputs == {"prompt": "ab", "n": 2} and generate.outputs == {"out": "abab"}
    score = spans[("Agent.score",)].data.spans[0]
    assert score.inputs == {"x": 1} and score.outputs == 2


def test_the_trace_sections_own_names_win_over_the_trainers():
    from omegaconf import OmegaConf

    from verl.workers.engine_workers import trace_run_names

    own = OmegaConf.create({"rollout": {"trace": {"project_name": "traces", "experiment_name": "run7"}}})
    assert trace_run_names(own, "proj", "exp") == {"project_name": "traces", "experiment_name": "run7"}
    unset = OmegaConf.create({"rollout": {"trace": {"project_name": None, "experiment_name": None}}})
    assert trace_run_names(unset, "proj", "exp") == {"project_name": "proj", "experiment_name": "exp"}
