"""Shared fixtures. Everything runs on CPU; tests marked `gpu` skip with a reason when no CUDA
device is present, and `vllm` tests skip unless vllm imports (they run in the vllm virtualenv)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.distributed_helpers import nccl_group, one_gpu_group, one_process, one_rank_group  # noqa: F401  (fixtures)

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
    _bounded_ray_shutdown(ray)


def _bounded_ray_shutdown(ray, timeout_s: float = 60.0) -> None:
    """`ray.shutdown()`, given up after `timeout_s`: Ray's shutdown can hang joining its log-printing
    thread (ray-project/ray#44836; seen once in this suite's CI). Then the stuck call keeps Ray's
    shutdown lock, so Ray's own atexit shutdown would hang the interpreter: it is unregistered. The
    local cluster's processes then exit with this one (killing them here instead makes Ray's core
    worker end the process with status 1 a minute later)."""
    import atexit
    import threading
    import warnings

    thread = threading.Thread(target=ray.shutdown, name="ray-shutdown", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not thread.is_alive():
        return
    from ray._private import worker

    atexit.unregister(worker.shutdown)
    _UNCLEAN_RAY_SHUTDOWN.append(timeout_s)
    warnings.warn(
        f"ray.shutdown() did not return within {timeout_s:.0f} s; left the local cluster to exit with us, "
        "and pytest ends with os._exit after its summary"
    )


# Set when Ray's shutdown was given up. Ray's core worker threads are then still running, and the
# interpreter's own finalization can crash on them (one CI run ended with a segfault, exit 139, after
# "1061 passed"): pytest's exit status is then handed straight to os._exit once everything is reported.
_UNCLEAN_RAY_SHUTDOWN: list[float] = []
_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if not _UNCLEAN_RAY_SHUTDOWN:
        return
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT_STATUS[-1] if _EXIT_STATUS else 1)


@pytest.fixture(scope="session")
def shared_ray_cluster(ray_session):
    """The `ray_session` cluster as the end-to-end main_ppo subprocess runs join it
    (tests/shared_ray_cluster.py): Ray's start-up is paid once per session instead of once a run."""
    from tests.shared_ray_cluster import SharedRayCluster

    return SharedRayCluster(ray_session)
