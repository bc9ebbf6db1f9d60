"""Worker groups on Ray (see base.py for the design)."""

from verl.single_controller.ray.base import (
    RAY_SYSTEM_CONFIG,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    create_colocated_worker_cls,
)
from verl.single_controller.ray.resource_pool_manager import ResourcePoolManager

__all__ = [
    "RAY_SYSTEM_CONFIG",
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "ResourcePoolManager",
    "create_colocated_worker_cls",
]
