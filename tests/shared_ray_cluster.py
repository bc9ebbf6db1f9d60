"""One Ray cluster for the `main_ppo` subprocess runs of a test session.

Each `python -m verl.trainer.main_ppo` that starts its own cluster pays ~8-13 s for Ray's daemons
(GCS, raylet, dashboard agent) before training starts and again to stop them. The end-to-end tests
that check what a run trains, logs or saves (not how a process starts or dies) instead join this
cluster: `RAY_ADDRESS` in their environment, which main_ppo honours as `ray.init` does (it then
passes no cluster-sizing arguments). The driver stays a subprocess, so each run still parses its
command line, builds its config and exits on its own, and leaves no state in pytest's process.

Per-run settings in the driver's environment (the metrics file, the dataset cache, MLflow's store)
do not reach workers of a cluster the driver did not start: those inherit the daemons' environment.
They are handed to the run's own Ray job through `ray_kwargs.ray_init.runtime_env.env_vars`, the
documented way to give a job's workers environment variables.

Tests of process-level behaviour keep their own cluster: CLI errors before Ray starts, `ray init`
arguments, kill -9 of a whole run (which kills the run's Ray daemons), signals, exit codes.

The cluster gets a private temp dir and free ports (other Ray instances may run on this machine),
starts with the Ray system config main_ppo gives a cluster it starts itself, uses token
authentication with a token in that temp dir, and is torn down by killing exactly its processes.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

from tests.integration.ray_cluster_helpers import free_ports, kill_cluster, short_temp_dir

# Environment variables of a test's driver that its workers read; forwarded into the job's runtime_env.
WORKER_ENV_VARS = ("VERL_FILE_LOGGER_PATH", "VERL_CACHE_DIR", "MLFLOW_TRACKING_URI")


class SharedRayCluster:
    """A `ray start --head` cluster; `env_for(env)` points a main_ppo subprocess at it."""

    def __init__(self) -> None:
        from verl.single_controller.ray import RAY_SYSTEM_CONFIG

        self.temp = short_temp_dir("vshr")
        token_path = Path(self.temp) / "auth_token"
        token_path.write_text(secrets.token_hex(32))
        gcs, *other = free_ports(9)
        self.auth_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
        env.update(self.auth_env)
        ray = str(Path(sys.executable).with_name("ray"))
        dashboard_agent, agent_grpc, env_agent, metrics, node_manager, object_manager, client, _ = other
        cmd = [
            ray, "start", "--head", "--disable-usage-stats", f"--num-cpus={os.cpu_count()}",
            f"--temp-dir={self.temp}/ray", f"--port={gcs}", "--include-dashboard=false",
            f"--system-config={json.dumps(RAY_SYSTEM_CONFIG)}",
            f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={dashboard_agent}",
            f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={env_agent}",
            f"--metrics-export-port={metrics}", f"--node-manager-port={node_manager}",
            f"--object-manager-port={object_manager}",
        ]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        if proc.returncode != 0:
            self.close()
            raise RuntimeError(f"ray start failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        self.address = f"127.0.0.1:{gcs}"

    def env_for(self, env: dict) -> dict:
        """`env` (a main_ppo subprocess's environment) joined to this cluster."""
        return {**env, **self.auth_env, "RAY_ADDRESS": self.address}

    @staticmethod
    def overrides_for(env: dict) -> list[str]:
        """Hydra overrides that give the run's workers the per-run variables of `env`."""
        return [f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}='{env[k]}'" for k in WORKER_ENV_VARS if k in env]

    def close(self) -> None:
        kill_cluster(self.temp)
        shutil.rmtree(self.temp, ignore_errors=True)
