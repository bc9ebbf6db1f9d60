"""`actor_rollout_ref.rollout.checkpoint_engine.backend` / `engine_kwargs`: each upstream backend's
accept/refuse rule and its message. naive everywhere; nccl on GPUs with a separate rollout pool and
its three options; hccl (Ascend), nixl (no NIXL transport), nccl on CPU or without a rollout pool,
unknown options, and options of a backend not selected refused, each naming what to set instead."""

from __future__ import annotations

import pytest

from tests.trainer.config.test_config_validation import defaults, error_of, with_  # noqa: F401
from verl.trainer.config import validate_ppo_config
from verl.workers.config import CheckpointEngineConfig

KEY = "actor_rollout_ref.rollout.checkpoint_engine"
BACKEND = f"{KEY.replace('.', '__')}__backend"
KWARGS = f"{KEY.replace('.', '__')}__engine_kwargs"
GPU_POOL = {"trainer__device": "cuda", "async_training__staleness_threshold": 1}
NCCL = {**GPU_POOL, BACKEND: "nccl"}


@pytest.mark.parametrize(
    "changes", [{}, GPU_POOL, {"async_training__staleness_threshold": 1}, {"trainer__device": "cuda"}]
)
def test_naive_validates_colocated_and_with_a_rollout_pool_on_cpu_and_gpu(defaults, changes):  # noqa: F811
    validate_ppo_config(with_(defaults, **changes, **{BACKEND: "naive"}))


def test_nccl_validates_on_gpus_with_a_rollout_pool_and_its_three_options(defaults):  # noqa: F811
    options = {"group_name": "sync", "rebuild_group": True, "rollout_dtype": "float16"}
    validate_ppo_config(with_(defaults, **NCCL, **{KWARGS: {"nccl": options}}))
    validate_ppo_config(with_(defaults, **NCCL, **{KWARGS: {"nccl": {}, "naive": {}}}))  # empty entries: no options


@pytest.mark.parametrize(
    "changes,message",
    [
        (
            {BACKEND: "nccl", "trainer__device": "cpu", "async_training__staleness_threshold": 1},
            f"{KEY}.backend=nccl needs NVIDIA GPUs (NCCL), but trainer.device=cpu; on CPU set {KEY}.backend=naive, "
            "which broadcasts the weights to a separate rollout pool over gloo",
        ),
        (
            {BACKEND: "nccl", "trainer__device": "cuda"},
            f"{KEY}.backend=nccl sends the weights to a separate rollout pool, but async_training.staleness_threshold=0 "
            "colocates the rollout with the trainer",
        ),
        ({BACKEND: "hccl"}, "Ascend NPUs"),
        ({**GPU_POOL, BACKEND: "nixl"}, f"{KEY}.backend=nixl "),
        ({BACKEND: "gloo"}, "naive, nccl, hccl, nixl"),
        (
            {**NCCL, KWARGS: {"nccl": {"bucket_size": 1}}},
            f"{KEY}.engine_kwargs.nccl.bucket_size is not an option of the nccl backend here; valid: group_name, "
            "rebuild_group, rollout_dtype",
        ),
        (
            {**NCCL, KWARGS: {"nccl": {"rollout_dtype": "int8"}}},
            f"{KEY}.engine_kwargs.nccl.rollout_dtype='int8' is not a floating-point dtype",
        ),
        ({**NCCL, KWARGS: {"nccl": {"rebuild_group": "yes"}}}, f"{KEY}.engine_kwargs.nccl.rebuild_group='yes' must be"),
        ({**NCCL, KWARGS: {"nccl": {"group_name": ""}}}, f"{KEY}.engine_kwargs.nccl.group_name='' must be"),
        (
            {KWARGS: {"nccl": {"rebuild_group": True}}},
            f"{KEY}.engine_kwargs.nccl is set but checkpoint_engine.backend=naive: those options apply only with "
            "backend=nccl",
        ),
        ({KWARGS: {"naive": {"x": 1}}}, "the naive backend takes no options"),
        ({KWARGS: {"vllm": {}}}, f"{KEY}.engine_kwargs.vllm names no backend"),
    ],
)
def test_each_refused_backend_or_option_says_why_and_what_to_set(defaults, changes, message):  # noqa: F811
    assert message in error_of(with_(defaults, **changes))


def test_nccl_with_device_auto_on_a_machine_without_cuda_is_refused(defaults, monkeypatch):  # noqa: F811
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    message = error_of(with_(defaults, **{**NCCL, "trainer__device": "auto"}))
    assert "trainer.device=auto picks the CPU on this machine (torch sees no CUDA GPU)" in message


def test_nixl_names_the_missing_library_when_it_is_not_installed(defaults, monkeypatch):  # noqa: F811
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nixl" else real(name, *a))
    assert "needs the NIXL library (the nixl package), which is not installed" in error_of(
        with_(defaults, **GPU_POOL, **{BACKEND: "nixl"})
    )


def test_nccl_options_read_with_upstreams_defaults_and_only_under_nccl():
    nccl = CheckpointEngineConfig(backend="nccl", engine_kwargs={"nccl": {"rollout_dtype": "torch.bfloat16"}})
    assert nccl.nccl_option("rollout_dtype") == "bfloat16"
    assert nccl.nccl_option("group_name") == "default" and nccl.nccl_option("rebuild_group") is False
    naive = CheckpointEngineConfig()
    assert [naive.nccl_option(k) for k in ("group_name", "rebuild_group", "rollout_dtype")] == ["default", False, None]
    with pytest.raises(KeyError):
        naive.nccl_option("bucket_size")
