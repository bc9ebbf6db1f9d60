"""Worker groups on Ray (base.py says which module holds what)."""

from verl.single_controller.ray.base import (
    RAY_SYSTEM_CONFIG,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    ResourcePoolManager,
    SubRayResourcePool,
    create_colocated_worker_cls,
    create_colocated_worker_cls_fused,
)

__all__ = [
    "RAY_SYSTEM_CONFIG",
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "ResourcePoolManager",
    "SubRayResourcePool",
    "create_colocated_worker_cls",
    "create_colocated_worker_cls_fused",
]
