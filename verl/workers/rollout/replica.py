"""Upstream's rollout replicas: one generation server instance over a slice of worker processes.

Upstream's trainer runs its rollout as HTTP/actor servers ("replicas"), each spanning
`tensor_model_parallel_size x data_parallel_size x pipeline_model_parallel_size` workers, and syncs
weights into them with a checkpoint engine (`verl.checkpoint_engine.CheckpointEngineManager`). This
build's trainer generates inside the actor workers instead (the hybrid engine; a separate rollout
pool for asynchronous training), so it has no server replicas of its own. What is here is the
replica *interface*, for code written against upstream's: a subclass that implements
`get_ray_class_with_init_args` and `launch_servers` gets the placement (`init_hybrid`,
`init_hybrid_colocated`, `init_colocated`, `init_standalone`), the server fan-out (`sleep`,
`wake_up`, `clear_kv_cache`, profiling) and the checkpoint-engine hooks (`workers`,
`abort_all_requests`, `resume_all_requests`).

`get_rollout_replica_class("vllm" | "sglang" | "trtllm")` names upstream's server replicas, which
are not part of this build: the lookup says so and what runs instead; classes registered with
`RolloutReplicaRegistry.register(name, loader)` are returned as upstream's registry returns them.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from enum import Enum
from typing import Any

from pydantic import BaseModel

from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import HFModelConfig, RolloutConfig

logger = logging.getLogger(__name__)

__all__ = [
    "RolloutMode",
    "RolloutReplica",
    "RolloutReplicaRegistry",
    "TokenOutput",
    "get_rollout_replica_class",
]


class TokenOutput(BaseModel):
    """One generation's result in token space, as a server returns it."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    routed_experts: Any | None = None
    stop_reason: str | None = None  # "completed", "aborted", or None when not known
    num_preempted: int | None = None


class RolloutMode(Enum):
    """Where a replica's engine runs relative to the trainer."""

    HYBRID = "hybrid"  # in the trainer's processes, switching with weight syncs (on-policy training)
    COLOCATED = "colocated"  # own processes on the trainer's devices, no weight sync (an LLM judge)
    STANDALONE = "standalone"  # own devices (disaggregated, off-policy training)


class RolloutReplica(ABC):
    """One server instance spanning `world_size` workers, possibly over several nodes.

    Args:
        replica_rank: this replica's index among the replicas.
        config: the rollout section (`RolloutConfig`, or a DictConfig / dict of it).
        model_config: the model section (`HFModelConfig` or its DictConfig).
        gpus_per_node: devices per node; a replica wider than a node spans `nnodes` nodes.
        is_reward_model: a generative reward model's replica (named apart in the worker groups).
    """

    def __init__(
        self,
        replica_rank: int,
        config: RolloutConfig,
        model_config: HFModelConfig,
        gpus_per_node: int = 8,
        is_reward_model: bool = False,
    ) -> None:
        self.replica_rank = int(replica_rank)
        self.config = omega_conf_to_dataclass(config, RolloutConfig)
        self.model_config = model_config
        self.world_size = (
            int(self.config.tensor_model_parallel_size)
            * int(self.config.data_parallel_size)
            * int(self.config.pipeline_model_parallel_size)
        )
        self.gpus_per_node = int(gpus_per_node)
        self.gpus_per_replica_node = min(self.gpus_per_node, self.world_size)
        if self.world_size % self.gpus_per_replica_node:
            raise ValueError(
                f"a rollout replica of {self.world_size} workers (tensor x data x pipeline parallel sizes) does not "
                f"fill whole nodes of {self.gpus_per_replica_node} devices; make it a multiple of gpus_per_node "
                f"({self.gpus_per_node}) or at most one node"
            )
        self.nnodes = self.world_size // self.gpus_per_replica_node
        self.is_reward_model = bool(is_reward_model)
        self.rollout_mode: RolloutMode | None = None
        self.workers: list = []
        self.resource_pool = None
        self.bundle_indices: list[int] = []
        self.servers: list = []
        self._server_address: str | None = None
        self._server_handle = None

    # ------------------------------------------------------------ placement
    def _own_slice(self, worker_group) -> list:
        start = self.world_size * self.replica_rank
        workers = list(worker_group.workers[start : start + self.world_size])
        if len(workers) != self.world_size:
            raise ValueError(
                f"rollout replica {self.replica_rank} needs workers {start}..{start + self.world_size - 1} of the "
                f"worker group, which has {len(worker_group.workers)}; build at most "
                f"{len(worker_group.workers) // self.world_size} replicas of {self.world_size} over it"
            )
        return workers

    async def init_hybrid(self, worker_group) -> None:
        """The engine lives in the trainer's own workers (this replica's slice of `worker_group`)."""
        self.rollout_mode = RolloutMode.HYBRID
        self.workers = self._own_slice(worker_group)
        await self.launch_servers()

    async def init_hybrid_colocated(self, worker_group, resource_pool) -> None:
        """As `init_hybrid`, remembering the pool and this replica's bundles for servers of its own."""
        self.rollout_mode = RolloutMode.HYBRID
        self.workers = self._own_slice(worker_group)
        self.resource_pool = resource_pool
        start = self.replica_rank * self.world_size
        self.bundle_indices = list(range(start, start + self.world_size))
        await self.launch_servers()

    def _name_prefix(self, mode: str) -> str:
        role = "rollout_reward" if self.is_reward_model else "rollout"
        return f"{role}_{mode}_{self.replica_rank}"

    def _start_worker_group(self, mode: str):
        from verl.single_controller.ray import RayWorkerGroup

        group = RayWorkerGroup(
            resource_pool=self.resource_pool,
            ray_cls_with_init=self.get_ray_class_with_init_args(),
            name_prefix=self._name_prefix(mode),
        )
        self.workers = list(group.workers)
        return group

    async def init_colocated(self, resource_pool) -> None:
        """Own worker processes on the trainer's pool (its bundles are shared, the processes are not)."""
        self.rollout_mode = RolloutMode.COLOCATED
        self.resource_pool = resource_pool
        self._start_worker_group("colocate")
        await self.launch_servers()

    async def init_standalone(self) -> None:
        """A resource pool of its own (`nnodes` x `gpus_per_replica_node`), then its workers."""
        from verl.single_controller.ray import ResourcePoolManager

        self.rollout_mode = RolloutMode.STANDALONE
        pool_name = ("rollout_pool_reward_" if self.is_reward_model else "rollout_pool_") + str(self.replica_rank)
        manager = ResourcePoolManager(
            resource_pool_spec={pool_name: [self.gpus_per_replica_node] * self.nnodes}, mapping={}
        )
        manager.create_resource_pool()
        self.resource_pool = manager.resource_pool_dict[pool_name]
        self._start_worker_group("standalone")
        await self.launch_servers()

    @abstractmethod
    def get_ray_class_with_init_args(self):
        """The `RayClassWithInitArgs` of the worker processes `init_colocated` / `init_standalone` start."""

    @abstractmethod
    async def launch_servers(self) -> None:
        """Start this replica's servers over `self.workers` (fill `self.servers`, the address and handle)."""

    # ------------------------------------------------------------ the running servers
    @property
    def server_address(self) -> str | None:
        """Where the replica serves OpenAI-style requests."""
        return self._server_address

    @property
    def server_handle(self):
        """The actor handle for token-in, token-out generation."""
        return self._server_handle

    def rollout_worker_use_gpu(self) -> bool:
        return True

    async def _each_server(self, method: str, **kwargs) -> None:
        await asyncio.gather(*[getattr(server, method).remote(**kwargs) for server in self.servers])

    async def wake_up(self) -> None:
        await self._each_server("wake_up")

    async def sleep(self) -> None:
        await self._each_server("sleep")

    async def clear_kv_cache(self) -> None:
        await self._each_server("clear_kv_cache")

    async def start_profile(self, **kwargs) -> None:
        await self._each_server("start_profile", **kwargs)

    async def stop_profile(self) -> None:
        await self._each_server("stop_profile")

    async def abort_all_requests(self) -> None:
        """Before a weight sync into running servers: upstream keeps this a log line (partial
        rollouts are its to-do); a subclass whose servers can pause overrides it."""
        logger.info("rollout replica %d: abort all requests", self.replica_rank)

    async def resume_all_requests(self) -> None:
        """After the sync; see `abort_all_requests`."""
        logger.info("rollout replica %d: resume all requests", self.replica_rank)


# upstream's built-in server replicas: what runs here instead
_NOT_IN_THIS_BUILD = {
    "vllm": "vLLMReplica (vLLM's HTTP server per replica)",
    "sglang": "SGLangReplica (SGLang's HTTP server per replica)",
    "trtllm": "TRTLLMReplica (TensorRT-LLM)",
}


class RolloutReplicaRegistry:
    """Rollout name -> a loader returning the replica class (imported only when asked for)."""

    _registry: dict[str, Callable[[], type[RolloutReplica]]] = {}

    @classmethod
    def register(cls, name: str, loader: Callable[[], type[RolloutReplica]]) -> None:
        cls._registry[name] = loader

    @classmethod
    def get(cls, name: str) -> type[RolloutReplica]:
        if name in cls._registry:
            return cls._registry[name]()
        if name in _NOT_IN_THIS_BUILD:
            raise NotImplementedError(
                f"rollout replica {name!r}: upstream's {_NOT_IN_THIS_BUILD[name]} is not part of this build; here "
                f"the {name} engine runs inside the rollout workers (actor_rollout_ref.rollout.name={name}), driven "
                "by the trainer, so no server replica is needed. Register a RolloutReplica subclass of your own with "
                "RolloutReplicaRegistry.register(name, loader) to serve requests another way"
            )
        raise ValueError(f"Unknown rollout mode: {name}. Available: {sorted(cls._registry)}")


def get_rollout_replica_class(rollout: str) -> type[RolloutReplica]:
    """Upstream's lookup by rollout name (`RolloutReplicaRegistry.get`)."""
    return RolloutReplicaRegistry.get(rollout)
