"""Shared fixtures. Everything runs on CPU; tests marked `gpu` skip with a reason when no CUDA
device is present, and `vllm` tests skip unless vllm imports (they run in the vllm virtualenv)."""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def pytest_collection_modifyitems(config, items):
    import torch

    has_gpu = torch.cuda.is_available()
    has_vllm = importlib.util.find_spec("vllm") is not None
    for item in items:
        # markers, not item.keywords: keywords also hold directory names (a checkout in .../vllm/)
        if item.get_closest_marker("gpu") and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device; none is visible to torch"))
        if item.get_closest_marker("vllm") and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="needs vllm; run in the vllm virtualenv (see .ci/run)"))


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster shared by every test that asks for it (start-up costs ~8 s)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=8,
            include_dashboard=False,
            log_to_driver=True,
            runtime_env={"env_vars": {"PYTHONPATH": os.getcwd(), "TOKENIZERS_PARALLELISM": "false"}},
        )
    yield ray
    ray.shutdown()
