"""The main_ppo subprocess runs of a test session join one Ray cluster: the `ray_session` one.

Each `python -m verl.trainer.main_ppo` that starts its own cluster pays several seconds for Ray's
daemons (GCS, raylet, agents) to start and stop. The end-to-end tests that check what a run trains,
logs or saves (not how a process starts or dies) instead join the session's cluster: `RAY_ADDRESS`
in their environment, which main_ppo honours as `ray.init` does (it then passes no cluster-sizing
arguments). The driver stays a subprocess, so each run still parses its command line, builds its
config and exits on its own, and leaves no state in pytest's process; its actors are named in its
own Ray job's namespace and die with the job.

Per-run settings in the driver's environment (the metrics file, the dataset cache, MLflow's store)
do not reach the workers of a cluster the driver did not start: they inherit the daemons'
environment. They are handed to the run's own Ray job through
`ray_kwargs.ray_init.runtime_env.env_vars`, the documented way to give a job's workers variables.

Tests of process-level behaviour keep a cluster of their own: CLI errors before Ray starts,
`ray.init` arguments, kill -9 of a whole run (which takes the run's Ray daemons down), signals,
exit codes, `ray job submit`, multi-node; so does a run that sizes its cluster
(`ray_kwargs.ray_init.num_cpus`), since `ray.init` refuses sizing arguments when it joins one.

Measured (2026-11-26, 2 cores): a separate `ray start --head` cluster for these runs was slower
than this one (the LoRA runs 46 s and 28 s against 28 s and 18 s; teardown 6 s against 1.4 s), so
the session shares the cluster that the in-process worker-group tests already use.
"""

from __future__ import annotations

# Environment variables of a test's driver that its workers read; forwarded into the job's runtime_env.
WORKER_ENV_VARS = ("VERL_FILE_LOGGER_PATH", "VERL_CACHE_DIR", "MLFLOW_TRACKING_URI")


class SharedRayCluster:
    """The running cluster of `ray` (initialized in this process); `env_for(env)` points a main_ppo
    subprocess at it, `overrides_for(env)` hands that run's per-run variables to its workers."""

    def __init__(self, ray) -> None:
        self.address = ray.get_runtime_context().gcs_address

    def env_for(self, env: dict) -> dict:
        """`env` (a main_ppo subprocess's environment) joined to this cluster."""
        return {**env, "RAY_ADDRESS": self.address}

    @staticmethod
    def overrides_for(env: dict) -> list[str]:
        """Hydra overrides that give the run's workers the per-run variables of `env`."""
        return [f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}='{env[k]}'" for k in WORKER_ENV_VARS if k in env]
