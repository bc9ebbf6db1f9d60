"""The class a worker group starts: one worker class with its arguments, or several roles fused.

`RayClassWithInitArgs(cls, *args, **kwargs)` is a worker class (plain or `ray.remote`-decorated)
with its constructor arguments and Ray actor options; a worker group starts one actor of it per
bundle (`create_actor`).

`create_colocated_worker_cls({role: cls})` fuses several roles into one actor class; methods
appear as `<role>_<method>`, and `wg.spawn(prefix_set=...)` returns one view per role
(`wg.fuse(prefix_set)` sets them as `wg.<role>`). `create_colocated_worker_raw_cls` is the
fused class itself, `create_colocated_worker_cls_fused` upstream's name for the same pairing;
in the process the roles reach each other through `self.fused_worker_dict`.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import ray

from verl.single_controller.base.decorator import _REGISTER_ATTR, Dispatch, RegisteredMethod, get_registered_methods
from verl.single_controller.base.worker import Worker, enable_async_rpc
from verl.single_controller.base.worker_group import ClassWithInitArgs

__all__ = [
    "RayClassWithInitArgs",
    "async_method_names",
    "create_colocated_worker_cls",
    "create_colocated_worker_cls_fused",
    "create_colocated_worker_raw_cls",
]


class RayClassWithInitArgs(ClassWithInitArgs):
    """A worker class (plain or `ray.remote`-decorated) plus its constructor arguments and actor
    options (`update_options`, `set_additional_resource`)."""

    def __init__(self, cls, *args, **kwargs):
        super().__init__(cls, *args, **kwargs)
        self._options: dict[str, Any] = {}
        self._additional_resource: dict[str, float] = {}

    @property
    def worker_cls(self) -> type:
        """The user's class, unwrapped from `ray.remote`."""
        return getattr(self.cls, "__ray_actor_class__", self.cls)

    def update_options(self, options: Mapping[str, Any]) -> None:
        self._options.update(options)

    def set_additional_resource(self, additional_resource: Mapping[str, float]) -> None:
        self._additional_resource = dict(additional_resource)

    def create_actor(self, options: Mapping[str, Any], env_vars: Mapping[str, str]):
        """Start one actor with our options plus the user's, and `env_vars` in its environment."""
        merged = {**self._options, **options}
        runtime_env = dict(self._options.get("runtime_env") or {})
        runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), **env_vars}
        merged["runtime_env"] = runtime_env
        if self._additional_resource:
            merged["resources"] = {**merged.get("resources", {}), **self._additional_resource}
        actor_cls = ray.remote(self.worker_cls) if not hasattr(self.cls, "__ray_actor_class__") else self.cls
        return actor_cls.options(**merged).remote(*self.args, **self.kwargs)


def async_method_names(cls) -> frozenset[str]:
    """Names of the `async def` methods of a worker class: the group calls them through `_verl_rpc_async`."""
    return frozenset(
        name for name in dir(cls) if not name.startswith("__") and inspect.iscoroutinefunction(getattr(cls, name, None))
    )


def _forwarder(role: str, method_name: str, info: RegisteredMethod):
    if info.is_async:

        async def forward(self, *args, **kwargs):
            return await getattr(self.worker_dict[role], method_name)(*args, **kwargs)

    else:

        def forward(self, *args, **kwargs):
            return getattr(self.worker_dict[role], method_name)(*args, **kwargs)

    forward.__name__ = f"{role}_{method_name}"
    # Same dispatch as the role's method; futures are materialized by that method itself.
    setattr(forward, _REGISTER_ATTR, info)
    return forward


def create_colocated_worker_cls(class_dict: Mapping[str, RayClassWithInitArgs | type]) -> RayClassWithInitArgs:
    """One worker class holding an instance of each role's class in the same process.

    `class_dict` maps a role name to a `RayClassWithInitArgs` (or a bare class, constructed without
    arguments). The fused class exposes each role's registered methods as `<role>_<method>`; its
    instances keep the role objects in `worker_dict` (also `fused_worker_dict`, and each role as an
    attribute of its own name), so roles may reach each other in-process.
    """
    fused_cls, options = _build_colocated_class(class_dict)
    fused = RayClassWithInitArgs(fused_cls)
    fused.update_options(options)
    return fused


def create_colocated_worker_raw_cls(class_dict: Mapping[str, RayClassWithInitArgs | type]) -> type:
    """The fused Worker class of `create_colocated_worker_cls`, not wrapped (for `ray.remote` or direct use).

    Besides the `<role>_<method>` methods it has upstream's `_fuw_execute("<role>_fwmn_<method>",
    ...)`, which calls any method of a role by name, and `raw_cls_dict` ({role: class})."""
    return _build_colocated_class(class_dict)[0]


def create_colocated_worker_cls_fused(class_dict: Mapping[str, RayClassWithInitArgs | type]) -> RayClassWithInitArgs:
    """Upstream's name for the fused pairing: the same class as `create_colocated_worker_cls`, marked
    `fused_worker_used`; `wg.spawn(...)` / `wg.fuse(...)` give the per-role groups."""
    fused = create_colocated_worker_cls(class_dict)
    fused.fused_worker_used = True
    return fused


def _build_colocated_class(class_dict: Mapping[str, RayClassWithInitArgs | type]) -> tuple[type, dict]:
    if not class_dict:
        raise ValueError("create_colocated_worker_cls needs at least one {role: worker class} entry")
    specs: dict[str, tuple[type, tuple, dict]] = {}
    options: dict[str, Any] = {}
    for role, spec in class_dict.items():
        if not role.isidentifier():
            raise ValueError(f"role name {role!r} must be a Python identifier (it prefixes method names)")
        if hasattr(Worker, role) or role in ("worker_dict", "fused_worker_dict", "raw_cls_dict"):
            raise ValueError(f"role name {role!r} is taken by a Worker attribute (each role is also an attribute)")
        if not isinstance(spec, ClassWithInitArgs):
            spec = RayClassWithInitArgs(spec)
        user_cls = getattr(spec.cls, "__ray_actor_class__", spec.cls)
        if not (isinstance(user_cls, type) and issubclass(user_cls, Worker)):
            raise TypeError(f"role {role!r}: {user_cls!r} is not a subclass of verl.single_controller.base.Worker")
        specs[role] = (user_cls, spec.args, spec.kwargs)
        options.update(getattr(spec, "_options", {}))

    class WorkerDict(Worker):
        def __init__(self):
            super().__init__()
            self.worker_dict = {role: cls(*args, **kwargs) for role, (cls, args, kwargs) in specs.items()}
            self.fused_worker_dict = self.worker_dict
            for role, worker in self.worker_dict.items():
                setattr(self, role, worker)
                worker.fused_worker_dict = self.worker_dict  # the roles see each other, as upstream's

        def _fuw_execute(self, method_name: str, *args, **kwargs):
            role, sep, method = method_name.partition("_fwmn_")
            if not sep or role not in self.worker_dict:
                raise ValueError(
                    f"_fuw_execute({method_name!r}): expected '<role>_fwmn_<method>' with a role of {list(self.worker_dict)}"
                )
            return getattr(self.worker_dict[role], method)(*args, **kwargs)

        def _query_dispatch_info(self, mesh_name):
            for worker in (self, *self.worker_dict.values()):
                info = Worker._query_dispatch_info(worker, mesh_name)
                if info is not None:
                    return info
            return None

        def _query_collect_info(self, mesh_name):
            for worker in (self, *self.worker_dict.values()):
                info = Worker._query_collect_info(worker, mesh_name)
                if info is not None:
                    return info
            return None

    role_methods: dict[str, tuple[str, str]] = {}
    for role, (user_cls, _, _) in specs.items():
        for method_name, info in get_registered_methods(user_cls).items():
            fused_name = f"{role}_{method_name}"
            if fused_name in role_methods or hasattr(WorkerDict, fused_name):
                raise ValueError(
                    f"colocated method name {fused_name!r} is produced twice (role/method names overlap); rename a role"
                )
            setattr(WorkerDict, fused_name, _forwarder(role, method_name, info))
            role_methods[fused_name] = (role, method_name)
            if info.dispatch_mode is Dispatch.DIRECT_ROLLOUT_METHOD and "rollout" in role:
                # upstream binds a rollout role's direct methods without the prefix (servers call them by name)
                if hasattr(WorkerDict, method_name):
                    raise ValueError(f"direct rollout method {method_name!r} of role {role!r} clashes with another")
                setattr(WorkerDict, method_name, _forwarder(role, method_name, info))
    WorkerDict._verl_roles = tuple(specs)
    WorkerDict._verl_role_methods = role_methods
    WorkerDict.raw_cls_dict = {role: user_cls for role, (user_cls, _, _) in specs.items()}
    WorkerDict.is_fused_worker = True
    WorkerDict.__qualname__ = WorkerDict.__name__ = "WorkerDict_" + "_".join(specs)
    enable_async_rpc(WorkerDict)  # its forwarders were added after the class statement
    return WorkerDict, options
