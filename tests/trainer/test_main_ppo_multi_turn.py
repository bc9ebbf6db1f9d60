"""`main_ppo` with multi-turn rollouts and the calculator tool, end to end on CPU: real Ray, 2 FSDP2
workers, the built-in engine behind the agent loops, the bundled tool-calling tiny model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.trainer.main_ppo_runs import common_overrides, read_metrics, run_main_ppo, start_module_runs

pytestmark = pytest.mark.slow  # the slow tier (make test-all, CI): see docs/testing.md


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, shared_ray_cluster):
    """The runs of this module's selected tests, started at once: {name: future} (see start_module_runs).
    They are defined below, each before the test that reads it."""
    with start_module_runs(request, RUNS, TEST_RUNS, tmp_path_factory, shared_ray_cluster) as started:
        yield started


def _two_steps_with_validation(tmp_path: Path, cluster, started: dict) -> Path:
    cmd = [
        "bash",
        "examples/multi_turn/run_arith_calculator_tiny_cpu.sh",
        # common_overrides's model.path is arith-tiny; the example keeps its own tool-calling model
        *[arg for arg in common_overrides(tmp_path, steps=2) if not arg.startswith("actor_rollout_ref.model.path=")],
        "trainer.val_before_train=True",
        "trainer.log_val_generations=3",
        "data.val_max_samples=8",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    ]
    env = {"DATA_DIR": str(tmp_path / "data")}
    run_main_ppo(cmd, tmp_path, timeout=600, cluster=cluster, env=env)
    return tmp_path


def test_calculator_example_validates_and_trains_two_steps_with_tool_calls(runs):
    tmp = runs["two_steps_with_validation"].result()
    records = read_metrics(tmp)
    assert records[0]["step"] == 0 and "val-core/arith_tool/acc/mean@1" in records[0]["data"]
    train = [r for r in records if "num_turns/mean" in r["data"]]
    assert [r["step"] for r in train] == [1, 2]
    last = train[-1]["data"]
    # the model calls the calculator: 2 messages = no call, 4 = a call, its answer and a final answer
    assert last["num_turns/max"] >= 4 and last["agent_loop/tool_calls"] > 0
    assert last["num_turns/min"] >= 2
    # sampled turns may contain ids that re-encode differently (a lone byte of a UTF-8 character):
    # the ids are trained as sampled, and the check reports how often the template would disagree
    assert 0.0 <= last["agent_loop/tokenization_mismatch"] < 0.5
    assert 0.0 <= last["critic/score/mean"] <= 1.0
    # trainer.log_val_generations=3: three of the 8 validation samples, (input, output, score), logged
    # beside the metrics (the file tracker) at the validation before training
    generations = [json.loads(line) for line in (tmp / "run" / "val_generations.jsonl").read_text().splitlines()]
    assert [g["step"] for g in generations] == [0, 0, 0]
    assert all(set(g) == {"step", "input", "output", "score"} for g in generations)
    assert len({g["input"] for g in generations}) == 3


ONE_STEP_OFF_STEPS = 3


def _one_step_off_partial(tmp_path: Path, cluster, started: dict) -> Path:
    steps = ONE_STEP_OFF_STEPS
    cmd = [
        "bash",
        "examples/multi_turn/run_arith_calculator_tiny_cpu.sh",
        *[
            arg
            for arg in common_overrides(tmp_path, steps=steps)
            if not arg.startswith("actor_rollout_ref.model.path=")
        ],
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "trainer.n_gpus_per_node=1",
        "rollout.n_gpus_per_node=1",
        "async_training.staleness_threshold=1",
        "async_training.partial_rollout=true",
        "async_training.partial_rollout_check_steps=1",
        f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
    ]
    env = {"DATA_DIR": str(tmp_path / "data")}
    run_main_ppo(cmd, tmp_path, timeout=600, cluster=cluster, env=env)
    return tmp_path


def test_one_step_off_multi_turn_with_partial_rollouts_tags_episodes_within_the_bound(runs):
    """The calculator example with generation one step ahead in its own rollout pool and partial
    rollouts checked every decode step: each trained episode's versions (over all its model turns)
    are ordered, the oldest within the bound, the newest never ahead of the trainer."""
    import json

    from tests.trainer.test_main_ppo_async import assert_partial_rollout_tags

    steps, tmp_path = ONE_STEP_OFF_STEPS, runs["one_step_off_partial"].result()
    trained = {
        int(f.stem): [json.loads(line) for line in f.read_text().splitlines()]
        for f in (tmp_path / "rollouts").glob("*.jsonl")
    }
    assert_partial_rollout_tags(trained, steps)
    assert all(len(rows) == 16 for rows in trained.values())
    records = {r["step"]: r["data"] for r in read_metrics(tmp_path) if "num_turns/mean" in r["data"]}
    assert sorted(records) == list(range(1, steps + 1))
    assert all(0.0 <= records[s]["async/mixed_version_frac"] <= 1.0 for s in records)
    assert max(records[s]["num_turns/max"] for s in records) >= 4  # tool calls were made
    print({s: (records[s]["async/mixed_version_frac"], records[s]["num_turns/mean"]) for s in records})


def _one_small_step(tmp_path: Path) -> list[str]:
    """The calculator example for one step of 4 prompts x 4 samples (its own tool-calling model)."""
    return [
        "bash",
        "examples/multi_turn/run_arith_calculator_tiny_cpu.sh",
        *[arg for arg in common_overrides(tmp_path, steps=1) if not arg.startswith("actor_rollout_ref.model.path=")],
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    ]


def _traced(tmp_path: Path, cluster, started: dict) -> tuple[Path, str]:
    pytest.importorskip("mlflow")  # the test that reads this run is skipped with the reason
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cmd = [
        *_one_small_step(tmp_path),
        "actor_rollout_ref.rollout.trace.backend=mlflow",
        "actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker=1",
        "actor_rollout_ref.rollout.over_sample_rate=0.25",
        "trainer.project_name=trace_e2e",
        "trainer.experiment_name=calc1",
    ]
    env = {"DATA_DIR": str(tmp_path / "data"), "MLFLOW_TRACKING_URI": uri}
    run_main_ppo(cmd, tmp_path, timeout=600, cluster=cluster, env=env)
    return tmp_path, uri


def test_calculator_example_traces_sampled_episodes_to_mlflow_and_cuts_the_tail(runs):
    """rollout.trace.* and rollout.over_sample_rate through main_ppo: the workers learn the run's names
    from the trainer, and the sample index reaches the rollout."""
    mlflow = pytest.importorskip("mlflow")
    tmp_path, uri = runs["traced"].result()
    train = [r for r in read_metrics(tmp_path) if "num_turns/mean" in r["data"]]
    last = train[-1]["data"]
    # 2 workers x 8 episodes: at least int(8 * 0.75) = 6 of each worker's finish
    assert 0.0 <= last["response/aborted_ratio"] <= 0.25 and 0.0 <= last["agent_loop/aborted_ratio"] <= 0.25

    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("trace_e2e")
    traces = [t for t in client.search_traces(locations=[experiment.experiment_id]) if t.info.tags.get("step") == "1"]
    # each of the 2 workers traces 1 of its 2 prompts, with all 4 of its samples
    assert len(traces) == 8, [t.info.tags for t in traces]
    by_index: dict[str, list[str]] = {}
    for trace in traces:
        assert trace.info.tags["experiment_name"] == "calc1" and trace.info.tags["validate"] == "False"
        by_index.setdefault(trace.info.tags["sample_index"], []).append(trace.info.tags["rollout_n"])
    assert sorted(map(sorted, by_index.values())) == [["0", "1", "2", "3"]] * 2


def _mcp_calculator(tmp_path: Path, cluster, started: dict) -> Path:
    """The calculator example with the calculator served by an MCP server (stdio, tests/tools/mcp) through
    upstream's MCP tool config: the servers file sits next to the tool config, named relatively."""
    import sys

    server = Path(__file__).parents[1] / "tools" / "mcp" / "fixture_server.py"
    config_dir = tmp_path / "tool_config"
    config_dir.mkdir()
    (config_dir / "mcp_server.json").write_text(
        json.dumps({"mcpServers": {"fixture": {"command": sys.executable, "args": [str(server)]}}})
    )
    (config_dir / "mcp_tool_config.yaml").write_text(
        "tools:\n"
        "  - class_name: verl.tools.mcp_base_tool.MCPBaseTool\n"
        "    config: {type: mcp, rate_limit: 200, timeout: 30}\n"
        "    mcp: {mcp_servers_config_path: ./mcp_server.json, tool_selected_list: [calculator]}\n"
    )
    cmd = [
        *_one_small_step(tmp_path),
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={config_dir / 'mcp_tool_config.yaml'}",
        f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
    ]
    env = {"DATA_DIR": str(tmp_path / "data")}
    run_main_ppo(cmd, tmp_path, timeout=600, cluster=cluster, env=env)
    return tmp_path


def test_calculator_example_trains_with_the_calculator_served_over_mcp(runs):
    tmp_path = runs["mcp_calculator"].result()
    (step,) = [r["data"] for r in read_metrics(tmp_path) if "num_turns/mean" in r["data"]]
    assert step["agent_loop/tool_calls"] > 0
    rows = [json.loads(line) for line in (tmp_path / "rollouts" / "1.jsonl").read_text().splitlines()]
    answers = [m for row in rows for m in re.findall(r"<tool_response>(.*?)</tool_response>", row["output"], re.S)]
    # every call reached the MCP server: its answers are the calculator's values (or its error for a bad
    # expression), never a failed connection
    assert answers and not [a for a in answers if "failed" in a or "unexpected error" in a], answers
    assert sum(a.strip().lstrip("-").isdigit() for a in answers) >= len(answers) // 2, answers


# Every run of the file, by name: a function of (its own directory, the shared cluster, the started
# runs' futures) -> what its test reads.
RUNS = {
    "two_steps_with_validation": _two_steps_with_validation,
    "one_step_off_partial": _one_step_off_partial,
    "traced": _traced,
    "mcp_calculator": _mcp_calculator,
}
# test -> the runs it reads
TEST_RUNS = {
    "test_calculator_example_validates_and_trains_two_steps_with_tool_calls": ("two_steps_with_validation",),
    "test_one_step_off_multi_turn_with_partial_rollouts_tags_episodes_within_the_bound": ("one_step_off_partial",),
    "test_calculator_example_traces_sampled_episodes_to_mlflow_and_cuts_the_tail": ("traced",),
    "test_calculator_example_trains_with_the_calculator_served_over_mcp": ("mcp_calculator",),
}
