"""Checkpoint engines: how the trainer's weights reach rollout servers, as upstream's API has it.

A checkpoint engine moves a stream of HF-named tensors from the trainer's rank 0 to every rollout
worker. Each sync runs the same steps on both sides, which `CheckpointEngineManager` drives over
two worker groups:

    prepare()                  -> metadata (the master's address; None elsewhere)
    build_topology(...)        -> per-rank keyword arguments of init_process_group (a classmethod)
    init_process_group(**kw)   -> join the transfer group (trainer rank 0 is rank 0; the other
                                  trainer ranks get -1 and only take part in the gathers)
    send_weights(generator)    -> trainer side;  receive_weights() -> rollout side (async generator)
    finalize()                 -> free the buffers (and the group, with rebuild_group)

Backends register by name with `@CheckpointEngineRegistry.register(name)`; `naive` (the colocated
engine: the generator is handed over in process) and `nccl` (bucketed broadcasts,
`verl.checkpoint_engine.nccl_checkpoint_engine`) are built in. Upstream's `hccl` (Ascend) and `nixl`
(the NIXL library) backends are not in this build: `HCCLCheckpointEngine` and `NIXLCheckpointEngine`
are None, as upstream's package leaves them where their libraries are missing.

This build's own trainer syncs weights with `verl.workers.weight_sync` (the same bucketed broadcast,
driven by the trainer's actor workers); this package serves code written against upstream's API:
custom training workers (`TrainingWorker` subclasses), rollout server adapters (`BaseRollout`
subclasses with an async `update_weights`) and replicas (`RolloutReplica`).
"""

from __future__ import annotations

import asyncio
import inspect
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any, TypedDict

import torch

from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.ray_utils import auto_await
from verl.workers.config import HFModelConfig, RolloutConfig

__all__ = [
    "CheckpointEngine",
    "CheckpointEngineManager",
    "CheckpointEngineRegistry",
    "CheckpointEngineWithCache",
    "CheckpointEngineWorker",
    "ColocatedCheckpointEngine",
    "TensorMeta",
]


class TensorMeta(TypedDict):
    """Where one tensor lies in a transfer bucket."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    offset: int


class CheckpointEngineRegistry:
    """Backend name -> checkpoint engine class."""

    _registry: dict[str, type[CheckpointEngine]] = {}

    @staticmethod
    def register(backend: str):
        """Class decorator: `@CheckpointEngineRegistry.register("mine")`."""

        def wrapper(cls: type[CheckpointEngine]) -> type[CheckpointEngine]:
            CheckpointEngineRegistry._registry[backend] = cls
            return cls

        return wrapper

    @classmethod
    def get(cls, backend: str) -> type[CheckpointEngine]:
        if backend not in cls._registry:
            raise ValueError(
                f"Checkpoint engine {backend} not registered; registered: {sorted(cls._registry)} "
                "(register one with @CheckpointEngineRegistry.register(name))"
            )
        return cls._registry[backend]

    @classmethod
    def new(cls, backend: str, *args, **kwargs) -> CheckpointEngine:
        """An instance of `backend`'s engine built with `args` / `kwargs`."""
        return cls.get(backend)(*args, **kwargs)


class CheckpointEngine(ABC):
    """One process's end of the weight transfer (see the module docstring for the call order)."""

    @abstractmethod
    def prepare(self) -> Any:
        """Allocate this sync's buffers; return what the others need to reach this process (or None)."""

    @classmethod
    @abstractmethod
    def build_topology(
        cls, trainer_world_size: int, rollout_world_size: int, metadata: list
    ) -> tuple[dict[str, list], dict[str, list]]:
        """From every worker's `prepare()` result (trainer ranks first), the keyword arguments of
        `init_process_group` for the trainer ranks and for the rollout ranks: each value a list with
        one entry per rank of that side."""

    @abstractmethod
    def init_process_group(self, **kwargs) -> None:
        """Join the transfer group with the arguments `build_topology` gave this rank."""

    @abstractmethod
    def finalize(self) -> None:
        """Free what `prepare` allocated (and the group, where the backend rebuilds it for every sync)."""

    @abstractmethod
    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send every `(name, tensor)` of `weights` (trainer side; every trainer rank iterates it to
        the end, since producing it may be a collective over the trainer's ranks)."""

    @abstractmethod
    def receive_weights(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """The `(name, tensor)` pairs as they arrive (rollout side)."""


class CheckpointEngineWithCache(CheckpointEngine):
    """An engine that also keeps the last weights received in a local cache (shared memory, disk),
    so a rollout can load them once its running requests are done."""

    @abstractmethod
    async def get_weights(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """The cached `(name, tensor)` pairs."""


@CheckpointEngineRegistry.register("naive")
class ColocatedCheckpointEngine(CheckpointEngine):
    """Trainer and rollout in one process: `send_weights` hands the generator over and
    `receive_weights` yields from it, so nothing is copied or communicated."""

    def __init__(self, bucket_size: int = 0, is_master: bool = False, **kwargs) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.weights: Iterable[tuple[str, torch.Tensor]] | None = None

    def prepare(self) -> None:
        return None

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int, metadata: list):
        return {}, {}

    def init_process_group(self, **kwargs) -> None:
        return None

    def finalize(self) -> None:
        self.weights = None

    def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.weights = weights

    def receive_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.weights is None:
            raise RuntimeError("ColocatedCheckpointEngine.receive_weights: nothing was sent (call send_weights first)")
        weights, self.weights = self.weights, None
        yield from weights


async def _as_async(weights) -> AsyncIterator[tuple[str, torch.Tensor]]:
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


async def load_weights(adapter, weights) -> Any:
    """Feed `weights` (a generator or an async generator) to `adapter.update_weights`: an upstream-style
    async adapter gets an async generator; this build's engines (a plain iterable, loaded synchronously)
    run in a helper thread that pulls the async generator through this event loop, so buckets keep
    arriving while the engine loads."""
    update = adapter.update_weights
    if inspect.iscoroutinefunction(update):
        return await update(_as_async(weights))
    if not hasattr(weights, "__aiter__"):
        return update(weights)
    loop = asyncio.get_running_loop()
    source = weights.__aiter__()

    def pulled() -> Iterator[tuple[str, torch.Tensor]]:
        while True:
            try:
                yield asyncio.run_coroutine_threadsafe(source.__anext__(), loop).result()
            except StopAsyncIteration:
                return

    return await loop.run_in_executor(None, update, pulled())


class CheckpointEngineWorker(Worker):
    """A rollout worker's end of the sync: a checkpoint engine plus the engine it loads into.

    Args:
        rollout_config: the rollout section; its `checkpoint_engine` chooses the backend, the bucket
            size (`update_weights_bucket_megabytes`) and the backend's options (`engine_kwargs.<backend>`).
        model_config: the model section.
        server_adapter: what receives the weights (a `BaseRollout`); None builds this build's engine for
            `rollout_config.name` from `model_config.path` (it can then generate in this worker).
    """

    def __init__(self, rollout_config: RolloutConfig, model_config: HFModelConfig, server_adapter=None) -> None:
        super().__init__()
        from verl.utils.distributed import initialize_global_process_group_ray

        self.rollout_config = omega_conf_to_dataclass(rollout_config, RolloutConfig)
        self.model_config = omega_conf_to_dataclass(model_config, HFModelConfig)
        initialize_global_process_group_ray(timeout_second=None, backend="cpu:gloo")
        self.server_adapter = server_adapter if server_adapter is not None else self._build_engine()
        self.checkpoint_engine = new_checkpoint_engine(self.rollout_config.checkpoint_engine)

    def _build_engine(self):
        from verl.utils import hf_tokenizer
        from verl.utils.model import model_dir_with_config
        from verl.workers.rollout import get_rollout_class

        model = self.model_config
        tokenizer = hf_tokenizer(model.tokenizer_path or model.path, chat_template=model.custom_chat_template)
        model_dir = model_dir_with_config(model.path, model.hf_config_path)
        return get_rollout_class(self.rollout_config.name)(model_dir, config=self.rollout_config, tokenizer=tokenizer)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self):
        return await load_weights(self.server_adapter, self.checkpoint_engine.receive_weights())

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)


def new_checkpoint_engine(config, is_master: bool = False) -> CheckpointEngine:
    """The engine a `CheckpointEngineConfig` names: its backend, `update_weights_bucket_megabytes` as the
    bucket size in bytes, and the backend's `engine_kwargs`."""
    backend = config.backend
    bucket_size = int(config.update_weights_bucket_megabytes) << 20
    options = dict((config.engine_kwargs or {}).get(backend) or {})
    if backend != "naive":
        options["is_master"] = is_master
    return CheckpointEngineRegistry.new(backend, bucket_size=bucket_size, **options)


def _collect_workers(replicas) -> list:
    workers = []
    for replica in replicas:
        workers.extend(replica.workers)
    return workers


class CheckpointEngineManager:
    """Drives a weight sync from a trainer worker group into rollout replicas.

    The trainer group's workers hold a checkpoint engine and register `update_weights` (send their
    `engine.get_per_tensor_param()` through it) and `execute_checkpoint_engine(method, ...)`; the
    replicas' workers are `CheckpointEngineWorker`s (or subclasses). With the `naive` backend the
    rollout lives in the trainer's processes and `update_weights` is the trainer group's own.

    Args:
        backend: the checkpoint engine backend (a registered name).
        trainer: the trainer's `RayWorkerGroup`.
        replicas: the `RolloutReplica`s to update.
    """

    def __init__(self, backend: str, trainer, replicas: list) -> None:
        self.backend = backend
        self.backend_cls = CheckpointEngineRegistry.get(backend)
        self.trainer = trainer
        self.replicas = list(replicas)

    def build_process_group(self, rollout) -> None:
        """Prepare every worker, build the topology from their metadata and form the transfer group."""
        import ray

        trainer = self.trainer
        metadata = ray.get(
            trainer.execute_checkpoint_engine(["prepare"] * trainer.world_size)
            + rollout.execute_checkpoint_engine(["prepare"] * rollout.world_size)
        )
        trainer_kwargs, rollout_kwargs = self.backend_cls.build_topology(
            trainer.world_size, rollout.world_size, metadata
        )
        for side, kwargs, size in (
            ("trainer", trainer_kwargs, trainer.world_size),
            ("rollout", rollout_kwargs, rollout.world_size),
        ):
            for key, values in kwargs.items():
                if len(values) != size:
                    raise ValueError(
                        f"{self.backend_cls.__name__}.build_topology gave {side} argument {key!r} {len(values)} "
                        f"values for {size} {side} workers; it must give one per worker"
                    )
        trainer_kwargs = {**trainer_kwargs, "method": ["init_process_group"] * trainer.world_size}
        rollout_kwargs = {**rollout_kwargs, "method": ["init_process_group"] * rollout.world_size}
        ray.get(
            trainer.execute_checkpoint_engine(**trainer_kwargs) + rollout.execute_checkpoint_engine(**rollout_kwargs)
        )

    def add_replicas(self, replicas: list) -> None:
        """More replicas (elastic scale-up); the next sync forms a group that includes them."""
        self.replicas.extend(replicas)

    def remove_replicas(self, replicas: list) -> None:
        """Fewer replicas (elastic scale-down)."""
        gone = {id(r) for r in replicas}
        self.replicas = [r for r in self.replicas if id(r) not in gone]

    @auto_await
    async def sleep_replicas(self) -> None:
        """Free the replicas' weights and KV caches (colocated rollout only: a disaggregated one keeps them)."""
        if self.backend != "naive":
            return
        await asyncio.gather(*[replica.sleep() for replica in self.replicas])

    @auto_await
    async def update_weights(self) -> None:
        """One sync: pause the replicas' requests, form the group, send and receive, free, resume."""
        import ray

        if self.backend == "naive":  # the rollout is in the trainer's processes
            ray.get(self.trainer.update_weights())
            return
        from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

        await asyncio.gather(*[replica.abort_all_requests() for replica in self.replicas])
        workers = _collect_workers(self.replicas)
        if not workers:
            raise ValueError(
                "CheckpointEngineManager.update_weights: the replicas have no workers (call init_hybrid first)"
            )
        rollout = RayWorkerGroup(
            worker_handles=workers, ray_cls_with_init=RayClassWithInitArgs(cls=CheckpointEngineWorker)
        )
        self.build_process_group(rollout)
        ray.get(self.trainer.update_weights() + rollout.update_weights())
        ray.get(
            self.trainer.execute_checkpoint_engine(["finalize"] * self.trainer.world_size)
            + rollout.execute_checkpoint_engine(["finalize"] * rollout.world_size)
        )
        await asyncio.gather(*[replica.resume_all_requests() for replica in self.replicas])
