"""Backend-neutral pieces of the single controller (no ray or torch at import time)."""

from verl.single_controller.base.errors import (
    ResourceUnavailableError,
    WorkerDiedError,
    WorkerGroupError,
    WorkerMethodError,
    WorkerTimeoutError,
)
from verl.single_controller.base.worker import Worker
from verl.single_controller.base.worker_group import ClassWithInitArgs, ResourcePool, WorkerGroup

__all__ = [
    "ClassWithInitArgs",
    "ResourcePool",
    "ResourceUnavailableError",
    "Worker",
    "WorkerDiedError",
    "WorkerGroup",
    "WorkerGroupError",
    "WorkerMethodError",
    "WorkerTimeoutError",
]
