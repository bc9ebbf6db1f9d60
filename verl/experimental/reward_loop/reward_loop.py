"""Upstream's `RewardLoopManager` and `RewardLoopWorker`: a batch's rewards scored sample by sample in Ray actors.

`RewardLoopManager(config, rm_resource_pool=None)` takes the trainer config; `compute_rm_score(data)`
returns a DataProto with `rm_scores` [B, R] (each row's reward at its last valid response token, zeros
elsewhere), the per-sample extra info as non-tensor columns and their names in
`meta_info["reward_extra_keys"]`. Which reward, as upstream's worker decides it:

- `custom_reward_function.path` set, or no reward model: the rows are split over
  `reward_model.num_workers` `RewardLoopWorker` actors (contiguous chunks, in order), each scoring its rows
  concurrently with the reward-loop class `reward_model.reward_manager` (the registry,
  verl.experimental.reward_loop.reward_manager) or, with `reward_model.reward_loop_source=importlib`,
  `reward_loop_class_name` of the file `reward_loop_module_path`. The custom reward function's file is
  imported before the class is looked up, so a class it registers with `@register(name)` is found.
- `reward_model.enable` with a custom function: a generative reward model. This project's
  `RewardModelManager` (reward_model.py) serves it; its router address and the reward model's tokenizer
  are handed to the class, which passes them to the function (`reward_router_address`,
  `reward_model_tokenizer`).
- `reward_model.enable` without one: a discriminative reward model. Upstream posts each sample to a
  vLLM / SGLang classify server; here the batch is scored by this project's reward-model workers
  (verl.workers.reward_model_worker, the backend of `reward_model.strategy`), the same worker group the
  trainer scores a discriminative model with, on `rm_resource_pool` or a pool of its own of
  `reward_model.n_gpus_per_node x nnodes` workers (the trainer's `n_gpus_per_node x nnodes` where those
  are unset), so the scores are the trainer's. No reward-loop
  actors are started then; the extra info is empty, as upstream's.

Refused, each with the key to change: a `reward_model.reward_manager` no registry knows; an unknown
`reward_loop_source`; `RewardLoopWorker` asked to score a discriminative model itself (the manager does);
a generative model given `rm_resource_pool` (its servers place themselves, reward_model.py).

Rows without a valid response token carry no reward (there is no token to hold it), as the driver's
reward managers; upstream writes it to the last position. Extra-info keys that only some rows report
are filled with None. Ours beyond upstream: `shutdown()` ends the actors and frees a pool this manager made.
"""

from __future__ import annotations

import asyncio
import logging
import os

import numpy as np
import ray
import torch

from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls
from verl.experimental.reward_loop.reward_model import RewardModelManager
from verl.protocol import DataProto
from verl.trainer.config.reward_migration import migrate_legacy_reward_impl  # noqa: F401  (upstream's home)
from verl.trainer.ppo.reward import get_custom_reward_fn
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import RewardModelConfig
from verl.workers.reward_manager.reward_loop import load_reward_loop_class

__all__ = ["RewardLoopManager", "RewardLoopWorker"]

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))


def _custom_path(config):
    return (config.get("custom_reward_function") or {}).get("path")


def reward_loop_class(config) -> type:
    """The reward-loop class the config names (module docstring); import the custom reward file first."""
    rm = config.reward_model
    source = rm.get("reward_loop_source", "register")
    if source == "register":
        return get_reward_manager_cls(rm.get("reward_manager") or "naive")
    if source == "importlib":
        return load_reward_loop_class(omega_conf_to_dataclass(rm, RewardModelConfig))
    raise ValueError(
        f"Unknown reward_loop_source: {source}. Must be 'register' or 'importlib' (reward_model.reward_loop_source)"
    )


class _Worker:
    """The logic of `RewardLoopWorker` (a plain class: it runs and tests without Ray)."""

    def __init__(self, config, reward_router_address: str | None = None):
        from verl.utils.fs import copy_to_local
        from verl.utils.tokenizer import hf_tokenizer

        self.config = config
        self.reward_router_address = reward_router_address
        trust = bool(config.actor_rollout_ref.model.get("trust_remote_code", False))
        self.input_tokenizer = hf_tokenizer(copy_to_local(config.actor_rollout_ref.model.path), trust_remote_code=trust)
        self.reward_model_tokenizer = None
        if config.reward_model.enable:
            rm_model = config.reward_model.model
            self.reward_model_tokenizer = hf_tokenizer(
                copy_to_local(rm_model.path), trust_remote_code=bool(rm_model.get("trust_remote_code", False))
            )
        self.reward_fn = get_custom_reward_fn(config)  # before the look-up: the file may register the class
        self.reward_loop_cls = reward_loop_class(config)
        self.reward_loop = None  # built in the event loop that runs it (the base class keeps that loop)

    def _loop_instance(self):
        if self.reward_loop is None:
            self.reward_loop = self.reward_loop_cls(
                self.config,
                self.input_tokenizer,
                self.reward_fn,
                self.reward_router_address,
                self.reward_model_tokenizer,
            )
        return self.reward_loop

    async def compute_score_batch(self, data: DataProto) -> list[dict]:
        """One result per row, the rows scored concurrently."""
        return list(await asyncio.gather(*(self.compute_score(data[i : i + 1]) for i in range(len(data)))))

    async def compute_score(self, data: DataProto) -> dict:
        if len(data) != 1:
            raise ValueError(f"RewardLoopWorker.compute_score scores one sample; got a batch of {len(data)}")
        if self.config.reward_model.enable and not _custom_path(self.config):
            raise NotImplementedError(
                "a discriminative reward model (reward_model.enable without custom_reward_function.path) is scored by "
                "RewardLoopManager.compute_rm_score with this project's reward-model workers, not per sample by a "
                "RewardLoopWorker (upstream posts to a vLLM/SGLang classify server)"
            )
        return await self._loop_instance().run_single(data)


RewardLoopWorker = ray.remote(_Worker)
"""Upstream's actor: `RewardLoopWorker.remote(config, reward_router_address)`, `compute_score_batch(data)`."""


def place_scores(data: DataProto, scores) -> torch.Tensor:
    """[B, R] float32 zeros with each row's score at its last valid response token."""
    responses = data.batch["responses"]
    valid = data.batch["attention_mask"][:, -responses.shape[-1] :].sum(-1)
    rm_scores = torch.zeros(responses.shape, dtype=torch.float32)
    rows = torch.nonzero(valid > 0).flatten()
    rm_scores[rows, valid[rows] - 1] = torch.tensor([float(s) for s in scores], dtype=torch.float32)[rows]
    return rm_scores


def _column(values: list) -> np.ndarray:
    column = np.empty(len(values), dtype=object)
    column[:] = values
    try:
        typed = np.array(values)
    except ValueError:  # ragged
        return column
    return typed if typed.shape == (len(values),) and typed.dtype != object else column


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    bounds = np.linspace(0, n, parts + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


class RewardLoopManager:
    """The batch's rewards from reward-loop actors or the reward model (see the module docstring)."""

    def __init__(self, config, rm_resource_pool=None):
        self.config = config
        self.reward_model_manager = None
        self.reward_router_address = None
        self.reward_model_wg = None
        self._own_pool = None
        self.reward_loop_workers = []
        rm = config.reward_model
        if rm.enable and _custom_path(config):
            if rm_resource_pool is not None:
                raise NotImplementedError(
                    "RewardLoopManager(rm_resource_pool=...) with a generative reward model: its servers place "
                    "themselves here (verl/experimental/reward_loop/reward_model.py); pass rm_resource_pool=None"
                )
            self.reward_model_manager = RewardModelManager(config)
            self.reward_router_address = self.reward_model_manager.get_router_address()
        elif rm.enable:
            self._init_reward_model_workers(rm_resource_pool)
            return
        self._init_reward_loop_workers()

    def _init_reward_model_workers(self, pool) -> None:
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
        from verl.single_controller.ray.resource_pool_manager import bundles_hold_gpus

        rm = self.config.reward_model
        if rm.strategy == "megatron":
            from verl.workers.megatron_workers import RewardModelWorker
        else:
            from verl.workers.fsdp_workers import RewardModelWorker
        if pool is None:
            trainer = self.config.trainer
            per_node, nnodes = int(rm.get("n_gpus_per_node") or 0), int(rm.get("nnodes") or 0)
            if per_node < 1 or nnodes < 1:  # the reward model's own layout unset: the trainer's
                per_node, nnodes = int(trainer.n_gpus_per_node), int(trainer.nnodes)
            pool = RayResourcePool(
                process_on_nodes=[per_node] * nnodes,
                use_gpu=bundles_hold_gpus(str(trainer.get("device", "auto")), ray.cluster_resources().get("GPU", 0)),
                name_prefix="reward_loop_rm",
            )
            self._own_pool = pool
        self.reward_model_wg = RayWorkerGroup(
            resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(RewardModelWorker, config=rm)
        )
        self.reward_model_wg.init_model()

    def _init_reward_loop_workers(self) -> None:
        num_workers = int(self.config.reward_model.get("num_workers") or 1)
        if num_workers < 1:
            raise ValueError(f"reward_model.num_workers={num_workers} must be at least 1")
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
        for i in range(num_workers):  # round-robin over the nodes
            strategy = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                node_id=nodes[i % len(nodes)], soft=True
            )
            self.reward_loop_workers.append(
                RewardLoopWorker.options(scheduling_strategy=strategy).remote(self.config, self.reward_router_address)
            )

    def compute_rm_score(self, data: DataProto) -> DataProto:
        if self.reward_model_wg is not None:
            return self._score_with_reward_model(data)
        if self.reward_model_manager is not None:
            self.reward_model_manager.wake_up()
        parts = [(a, b) for a, b in _split(len(data), len(self.reward_loop_workers)) if b > a]
        refs = [w.compute_score_batch.remote(data[a:b]) for w, (a, b) in zip(self.reward_loop_workers, parts)]
        outputs = [item for chunk in ray.get(refs) for item in chunk]
        if self.reward_model_manager is not None:
            self.reward_model_manager.sleep()
        rm_scores = place_scores(data, [out["reward_score"] for out in outputs])
        infos = [out.get("reward_extra_info") or {} for out in outputs]
        keys = list(dict.fromkeys(key for info in infos for key in info))
        columns = {key: _column([info.get(key) for info in infos]) for key in keys}
        return DataProto.from_dict(
            tensors={"rm_scores": rm_scores}, non_tensors=columns, meta_info={"reward_extra_keys": keys}
        )

    def _score_with_reward_model(self, data: DataProto) -> DataProto:
        tensors = {k: data.batch[k] for k in ("input_ids", "attention_mask", "responses")}
        if "response_mask" in data.batch:
            tensors["response_mask"] = data.batch["response_mask"]
        else:
            tensors["response_mask"] = data.batch["attention_mask"][:, -data.batch["responses"].shape[-1] :]
        non_tensors = {k: v for k, v in data.non_tensor_batch.items() if k == "raw_prompt"}
        scored = self.reward_model_wg.compute_rm_score(DataProto.from_dict(tensors=tensors, non_tensors=non_tensors))
        return DataProto.from_dict(
            tensors={"rm_scores": scored.batch["rm_scores"]}, meta_info={"reward_extra_keys": []}
        )

    def shutdown(self) -> None:
        """End the actors and the workers, and free a resource pool this manager made (ours)."""
        for worker in self.reward_loop_workers:
            ray.kill(worker)
        self.reward_loop_workers = []
        if self.reward_model_wg is not None:
            self.reward_model_wg.shutdown()
            self.reward_model_wg = None
        if self._own_pool is not None:
            self._own_pool.remove_placement_groups()
            self._own_pool = None
