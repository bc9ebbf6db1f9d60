"""Upstream's import path for the Ray side of the single controller; the code lives in four modules.

- `resource_pool`: `RayResourcePool` and `SubRayResourcePool` (placement groups, one bundle per
  worker, each node entry pinned to its own node), `split_resource_pool`, `merge_resource_pool`
  and the node helpers.
- `worker_class`: `RayClassWithInitArgs` (a worker class, its arguments and actor options) and
  `create_colocated_worker_cls` with its variants (several roles fused into one actor class).
- `worker_group`: `RayWorkerGroup` (one actor per bundle; the call path, its transport and its
  deadlines) and `RAY_SYSTEM_CONFIG`.
- `resource_pool_manager`: `ResourcePoolManager` (roles -> pools, checked against the cluster).

They import down that list's order (the group needs a pool and a class; the pool and the class
know nothing of groups), so each reads and tests alone. Upstream keeps all of this in one
`verl/single_controller/ray/base.py`; user code imports these names from here or from
`verl.single_controller.ray`, and both keep working (`Worker` too, which upstream's module
re-exports).
"""

from verl.single_controller.base.worker import Worker
from verl.single_controller.ray.resource_pool import (
    RayResourcePool,
    SubRayResourcePool,
    merge_resource_pool,
    sort_placement_groups_by_node,
    split_resource_pool,
)
from verl.single_controller.ray.resource_pool_manager import ResourcePoolManager
from verl.single_controller.ray.worker_class import (
    RayClassWithInitArgs,
    create_colocated_worker_cls,
    create_colocated_worker_cls_fused,
    create_colocated_worker_raw_cls,
)
from verl.single_controller.ray.worker_group import RAY_SYSTEM_CONFIG, RayWorkerGroup

__all__ = [
    "RAY_SYSTEM_CONFIG",
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "ResourcePoolManager",
    "SubRayResourcePool",
    "Worker",
    "create_colocated_worker_cls",
    "create_colocated_worker_cls_fused",
    "create_colocated_worker_raw_cls",
    "merge_resource_pool",
    "sort_placement_groups_by_node",
    "split_resource_pool",
]
