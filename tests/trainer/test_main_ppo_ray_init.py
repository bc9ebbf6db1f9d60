"""How `main_ppo` calls `ray.init`: a local run ships this checkout to the workers through
PYTHONPATH; inside a submitted Ray job the job's own env vars win, because Ray refuses to merge a
job runtime_env and a `ray.init` runtime_env that set the same variable."""

from __future__ import annotations

import json
from pathlib import Path

from verl.trainer.config import load_ppo_config
from verl.trainer.main_ppo import _ray_init_kwargs

ROOT = Path(__file__).resolve().parents[2]


def test_local_run_puts_this_checkout_on_the_workers_pythonpath(monkeypatch):
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    kwargs = _ray_init_kwargs(load_ppo_config([], config_name="arith_demo"))
    env_vars = kwargs["runtime_env"]["env_vars"]
    assert env_vars["PYTHONPATH"].split(":") == [str(ROOT), "/somewhere/else"]
    assert env_vars["TOKENIZERS_PARALLELISM"] == "true"
    assert kwargs["include_dashboard"] is False


def test_env_vars_set_by_the_submitted_job_are_left_to_the_job(monkeypatch):
    job_config = {"runtime_env": {"working_dir": "gcs://_ray_pkg_x.zip", "env_vars": {"PYTHONPATH": "/job/code"}}}
    job_config["runtime_env"]["env_vars"]["TOKENIZERS_PARALLELISM"] = "false"
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(job_config))
    # the driver's device preference (earlier in-process runs may have set it) reaches the workers
    monkeypatch.setenv("VERL_DEVICE", "cpu")
    env_vars = _ray_init_kwargs(load_ppo_config([], config_name="arith_demo"))["runtime_env"]["env_vars"]
    assert "PYTHONPATH" not in env_vars and "TOKENIZERS_PARALLELISM" not in env_vars
    assert env_vars["VERL_DEVICE"] == "cpu"  # a default the job did not set is still passed on
    # Ray's own merge rule accepts the pair (it returns None on a conflict).
    from ray.runtime_env.runtime_env import _merge_runtime_env

    assert _merge_runtime_env(job_config["runtime_env"], {"env_vars": env_vars}) is not None


def test_a_ray_init_runtime_env_from_the_config_overrides_the_defaults(monkeypatch):
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    cfg = load_ppo_config(
        ["+ray_kwargs.ray_init.runtime_env={env_vars:{VERL_LOGGING_LEVEL:DEBUG}}"], config_name="arith_demo"
    )
    env_vars = _ray_init_kwargs(cfg)["runtime_env"]["env_vars"]
    assert env_vars["VERL_LOGGING_LEVEL"] == "DEBUG"
