"""trainer.nnodes x trainer.n_gpus_per_node on a real two-node Ray cluster (two raylets on this
machine, each with room for both workers): the run trains and checkpoints with one rank per node
in node order, a missing node is an immediate error that says so, and a pool lands on the same
nodes in the same order every time. The cluster runs in a child process with its own RAY_TMPDIR
(tests/integration/two_node_driver.py), so it cannot meet any other Ray instance on the machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.ray_cluster_helpers import kill_cluster, short_temp_dir

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_node_run():
    work_dir = short_temp_dir("vmn")
    out = Path(work_dir) / "result.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(
        PYTHONPATH=str(ROOT),
        RAY_TMPDIR=work_dir,
        VERL_CACHE_DIR=f"{work_dir}/cache",
        VERL_FILE_LOGGER_PATH=f"{work_dir}/metrics.jsonl",
        RAY_DEDUP_LOGS="0",
    )
    try:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).with_name("two_node_driver.py")), str(out), work_dir],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=420,
        )
        result = json.loads(out.read_text()) if out.exists() else {}
        assert proc.returncode == 0 and "crash" not in result, (
            f"exit {proc.returncode}\n{result.get('crash', '')}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
        yield result, Path(work_dir)
    finally:
        kill_cluster(work_dir)
        shutil.rmtree(work_dir, ignore_errors=True)


def test_two_nodes_train_and_checkpoint_with_one_rank_per_node_in_node_order(two_node_run):
    result, work_dir = two_node_run
    assert result["train"]["global_step"] == 2
    # Same IP for both nodes here, so the node id decides the order; rank r sits on the r-th node.
    assert len(result["node_ips"]) == 1 and len(result["node_ids"]) == 2
    rank_nodes = {int(rank): node for rank, node in result["train"]["rank_nodes"].items()}
    assert rank_nodes == {0: result["node_ids"][0], 1: result["node_ids"][1]}

    ckpt = work_dir / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    actor_files = {p.name for p in (ckpt / "global_step_2" / "actor").iterdir()}
    # every rank wrote its own shard (the real multi-node case needs a shared filesystem for this)
    for rank in (0, 1):
        assert any(f"world_size_2_rank_{rank}" in name for name in actor_files), sorted(actor_files)
    lines = (work_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines if line.strip()][-1] == 2


def test_a_missing_node_is_a_clear_error_within_seconds(two_node_run):
    result, _ = two_node_run
    run = result["missing_node"]  # python -m verl.trainer.main_ppo trainer.nnodes=3 against the 2-node cluster
    assert run["returncode"] == 1, run
    assert run["seconds"] < 90, run  # interpreter, Ray connection and task runner start-up; no placement wait
    stderr = run["stderr"]
    assert "verl: the Ray cluster cannot hold this run" in stderr
    assert "pool 'global_pool' spans 3 nodes [1, 1, 1] but the cluster has 2 alive node(s)" in stderr
    assert "trainer.nnodes" in stderr and "Traceback" not in stderr


def test_a_pool_lands_on_the_same_nodes_in_the_same_order_every_time(two_node_run):
    result, _ = two_node_run
    first, second = result["pool_placements"]
    assert first == second == result["node_ids"]


def test_a_pool_asking_for_more_nodes_than_exist_fails_at_once(two_node_run):
    error = two_node_run[0]["pool_missing_node"]
    assert error["type"] == "ResourceUnavailableError", error
    assert error["seconds"] < 5, error
    assert "needs 3 distinct nodes" in error["message"] and "has 2 alive node(s)" in error["message"]
