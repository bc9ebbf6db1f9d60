"""The environment Ray workers of a PPO run start with (upstream's `verl.trainer.constants_ppo`).

Recipes' drivers call `get_ppo_ray_runtime_env()` and pass it to `ray.init` themselves; `main_ppo`
builds its own (verl/trainer/main_ppo.py `_ray_init_kwargs`), with these variables among its defaults.
The variable names and values are upstream's: they quieten NCCL and vLLM, let vLLM load LoRA adapters
at run time, keep CUDA's connection count at one, and keep NCCL's cuMem allocator off (weight sync
between separate actor and rollout processes can hang with it on).
"""

from __future__ import annotations

import json
import os

# set by Ray's job manager in a submitted job's entrypoint: the job's config, its runtime_env included
RAY_JOB_CONFIG_JSON_ENV_VAR = "RAY_JOB_CONFIG_JSON_ENV_VAR"

PPO_RAY_RUNTIME_ENV = {
    "env_vars": {
        "TOKENIZERS_PARALLELISM": "true",
        "NCCL_DEBUG": "WARN",
        "VLLM_LOGGING_LEVEL": "WARN",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "NCCL_CUMEM_ENABLE": "0",
        "VLLM_DISABLE_COMPILE_CACHE": "1",
        "HCCL_HOST_SOCKET_PORT_RANGE": "auto",
        "HCCL_NPU_SOCKET_PORT_RANGE": "auto",
    },
}


def _job_working_dir() -> str | None:
    raw = os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR)
    return ((json.loads(raw).get("runtime_env") or {}).get("working_dir")) if raw else None


def get_ppo_ray_runtime_env() -> dict:
    """A runtime_env for `ray.init`: `PPO_RAY_RUNTIME_ENV`'s variables, less those this process's
    environment already sets (a submitted job's own values win, and Ray refuses a variable set by
    both), and `working_dir: None` outside a submitted job that brings its own working_dir (no upload
    of the current directory).

    Workers also import this checkout of verl: its root is put in front of the workers' PYTHONPATH
    (the same rule as `main_ppo`), unless PYTHONPATH is set here already (then they inherit it)."""
    env_vars = {k: v for k, v in PPO_RAY_RUNTIME_ENV["env_vars"].items() if os.environ.get(k) is None}
    if os.environ.get("PYTHONPATH") is None:
        env_vars["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    runtime_env: dict = {"env_vars": env_vars}
    if _job_working_dir() is None:
        runtime_env["working_dir"] = None
    return runtime_env
