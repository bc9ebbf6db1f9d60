"""The Ray side lives in several modules (see verl/single_controller/ray/base.py), but upstream's
import paths still give every name it has there: code written against upstream keeps working."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from verl.single_controller.base.worker import Worker
from verl.single_controller.ray import resource_pool, resource_pool_manager, worker_class, worker_group

# name -> the module that defines it now
UPSTREAM_BASE_NAMES = {
    "RayResourcePool": resource_pool,
    "SubRayResourcePool": resource_pool,
    "split_resource_pool": resource_pool,
    "merge_resource_pool": resource_pool,
    "ResourcePoolManager": resource_pool_manager,
    "RayClassWithInitArgs": worker_class,
    "create_colocated_worker_cls": worker_class,
    "create_colocated_worker_cls_fused": worker_class,
    "create_colocated_worker_raw_cls": worker_class,
    "RayWorkerGroup": worker_group,
}
UPSTREAM_PACKAGE_NAMES = [
    "RayClassWithInitArgs",
    "RayResourcePool",
    "SubRayResourcePool",
    "RayWorkerGroup",
    "ResourcePoolManager",
    "create_colocated_worker_cls",
    "create_colocated_worker_cls_fused",
]


@pytest.mark.parametrize("name", sorted(UPSTREAM_BASE_NAMES))
def test_upstreams_base_module_gives_the_same_object_as_the_defining_module(name):
    base = importlib.import_module("verl.single_controller.ray.base")
    assert getattr(base, name) is getattr(UPSTREAM_BASE_NAMES[name], name)
    assert name in base.__all__


@pytest.mark.parametrize("name", UPSTREAM_PACKAGE_NAMES)
def test_the_package_exports_upstreams_names(name):
    package = importlib.import_module("verl.single_controller.ray")
    assert name in package.__all__
    assert getattr(package, name) is getattr(UPSTREAM_BASE_NAMES[name], name)


def test_base_reexports_worker_as_upstream_does():
    from verl.single_controller.ray.base import Worker as reexported

    assert reexported is Worker


def test_the_modules_import_downwards_only():
    # pool and class know nothing of groups; the group needs both (base.py's docstring)
    def verl_imports(module):  # every `from verl.single_controller.ray... import`, inside functions too
        tree = ast.parse(Path(module.__file__).read_text())
        return {
            node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("verl.single_controller.ray")
        }

    assert verl_imports(resource_pool) == set()
    assert verl_imports(worker_class) == set()
    assert verl_imports(resource_pool_manager) == {"verl.single_controller.ray.resource_pool"}
    assert verl_imports(worker_group) == {
        "verl.single_controller.ray.cpu_allocator",
        "verl.single_controller.ray.resource_pool",
        "verl.single_controller.ray.worker_class",
    }
