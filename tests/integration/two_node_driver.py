"""Run by test_multinode.py in a fresh process (its own RAY_TMPDIR): a two-node Ray cluster on this
machine (`ray.cluster_utils.Cluster`, two raylets with 2 CPUs each), then

1. `run_ppo` with trainer.nnodes=2 x trainer.n_gpus_per_node=1 for two steps with a checkpoint,
   joining the cluster through RAY_ADDRESS as a user's driver would;
2. `python -m verl.trainer.main_ppo` with trainer.nnodes=3 (one node missing), which must fail
   fast with a message;
3. a bare RayResourcePool([1, 1]) placed twice, and RayResourcePool([1, 1, 1]).

Writes what it saw as JSON to argv[1]; the test asserts on it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback


def _overrides(work_dir: str, nnodes: int) -> list[str]:
    prompts = 4 * nnodes  # x 4 samples: 16 sequences per rank
    return [
        "trainer.device=cpu",
        f"trainer.nnodes={nnodes}",
        "trainer.n_gpus_per_node=1",
        "trainer.total_training_steps=2",
        "trainer.save_freq=2",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.logger=[console,file]",
        f"trainer.default_local_dir={work_dir}/ckpt",
        f"trainer.run_dir={work_dir}/run",
        f"data.train_batch_size={prompts}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.n=4",
    ]


def _worker_nodes() -> dict[int, str]:
    """Rank -> node id of every worker-group actor the run started (dead ones included)."""
    from ray._private.state import actors

    ranks = {}
    for info in actors().values():
        name = info["Name"] or ""
        if info["ActorClassName"].startswith("WorkerDict") and ":" in name:
            ranks[int(name.rsplit(":", 1)[1])] = info["Address"]["NodeID"]
    return ranks


def _wait_until_free(cpus: float, timeout_s: float = 60.0) -> None:
    """Wait for the finished run's workers and placement groups to give their CPUs back."""
    import ray

    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0) < cpus:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the cluster still holds resources {timeout_s:g} s after the run: {ray.available_resources()}"
            )
        time.sleep(0.2)


def _timed_error(fn) -> dict:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return {
            "type": type(exc).__name__,
            "mro": [c.__name__ for c in type(exc).__mro__],
            "message": str(exc),
            "seconds": time.monotonic() - start,
        }
    return {"type": None, "seconds": time.monotonic() - start}


def main(out_path: str, work_dir: str) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from tests.integration.ray_cluster_helpers import free_ports
    from verl.single_controller.ray import RayResourcePool
    from verl.trainer.config import load_ppo_config
    from verl.trainer.main_ppo import run_ppo

    head_agent_port, node_agent_port = free_ports(2)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False, "dashboard_agent_listen_port": head_agent_port},
    )
    cluster.add_node(num_cpus=2, dashboard_agent_listen_port=node_agent_port)
    cluster.wait_for_nodes()
    os.environ["RAY_ADDRESS"] = cluster.address
    result: dict = {}
    try:
        start = time.monotonic()
        metrics = run_ppo(load_ppo_config(_overrides(work_dir, nnodes=2), config_name="arith_demo"))
        result["train"] = {
            "seconds": time.monotonic() - start,
            "global_step": metrics.get("training/global_step"),
            "rank_nodes": _worker_nodes(),
        }
        result["node_ids"] = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        result["node_ips"] = sorted({n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]})

        _wait_until_free(cpus=4)
        start = time.monotonic()
        cli = subprocess.run(
            [
                sys.executable,
                "-m",
                "verl.trainer.main_ppo",
                "--config-name=arith_demo",
                *_overrides(work_dir, nnodes=3),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        result["missing_node"] = {
            "returncode": cli.returncode,
            "stderr": cli.stderr[-3000:],
            "seconds": time.monotonic() - start,
        }

        _wait_until_free(cpus=4)
        placements = []
        for _ in range(2):
            pool = RayResourcePool([1, 1], use_gpu=False, max_colocate_count=1, name_prefix="stability")
            pool.get_placement_groups()
            placements.append(pool.pg_node_ids)
            pool.remove_placement_groups()
        result["pool_placements"] = placements
        result["pool_missing_node"] = _timed_error(
            lambda: RayResourcePool([1, 1, 1], use_gpu=False, max_colocate_count=1).get_placement_groups()
        )
    except Exception:
        result["crash"] = traceback.format_exc()
    finally:
        with open(out_path, "w") as f:
            json.dump(result, f)
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
