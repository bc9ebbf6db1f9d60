"""The Ray-facing workers on the Megatron-core backend (`strategy=megatron`).

Same RPCs, roles and returned keys as `verl.workers.fsdp_workers`, so the trainer does not know
which backend it drives. The training logic is `MegatronPPOActor` / `MegatronPPOCritic`; this
module builds the megatron model from the HF checkpoint, wires it to devices, optimizer,
checkpoints and the rollout engine, and tells the worker group how data is laid out.

Design decisions:
- Layout: the worker group's ranks are carved into megatron's tensor / pipeline / data parallel
  groups (`verl.utils.megatron.parallel_state`). Data-carrying RPCs use the mesh-aware dispatch
  (`make_nd_compute_dataproto_dispatch_fn`): every rank of one data-parallel replica receives
  the same chunk, and only one rank per replica (tensor rank 0 on the last pipeline stage, where
  the loss and the log-probs live) is collected.
- Rollout (hybrid engine): the generation engine is the same one the FSDP workers use, holding
  full HF weights. Only the collecting rank of each data-parallel replica builds one and
  generates; the other ranks of the replica take part in the weight gather (a collective over
  the tensor and pipeline groups) and return nothing. Generation is thus data-parallel over
  replicas, not tensor-parallel; a tensor-parallel engine (vLLM/SGLang with
  `rollout.tensor_model_parallel_size`) is the route for models that do not fit one device.
- Weights: every rank reads the HF checkpoint at start-up and keeps its shard
  (`verl.models.mcore.load_hf_state_dict`); the rollout engine and `hf_model` checkpoints get
  full HF-named tensors streamed one at a time (`mcore_to_hf_named_tensors`).
- Optimizer: torch AdamW over this rank's shards with the FSDP backend's lr schedules (why not
  megatron's optimizer: see `verl.workers.actor.megatron_actor`). Checkpoints: dist_checkpointing
  for weights and Adam moments, reshardable across layouts
  (`verl.utils.checkpoint.megatron_checkpoint_manager`).
- Offload (`megatron.param_offload` / `optimizer_offload`): parameters and Adam moments live on
  the host between the RPCs that use them; no-ops on a CPU device.
- `megatron.sequence_parallel` changes memory, not results; it needs TransformerEngine or apex
  kernels, so without them (always on CPU) it is turned off with a warning.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings

import torch
from omegaconf import DictConfig, open_dict

from verl.protocol import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.utils import device as dev
from verl.workers.fsdp_workers import (
    _ROLES,
    _join_group,
    _log_prob_meta,
    _mfu_metric,
    _normalize_batch_sizes,
    _plain,
    _seed_sampling,
)

_ACTOR_MESH = make_nd_compute_dataproto_dispatch_fn("actor")
_CRITIC_MESH = make_nd_compute_dataproto_dispatch_fn("critic")

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def _sequence_parallel(megatron_cfg: dict) -> bool:
    """`sequence_parallel` as asked when it can run here, else False with a warning (same results)."""
    asked = bool(megatron_cfg.get("sequence_parallel", False))
    if not asked or int(megatron_cfg.get("tensor_model_parallel_size", 1)) < 2:
        return False
    from importlib.util import find_spec

    if dev.is_cuda_available() and (find_spec("transformer_engine") or find_spec("apex")):
        return True
    warnings.warn(
        "megatron.sequence_parallel=true needs TransformerEngine or apex on a GPU; running without it "
        "(same results, more activation memory). Set megatron.sequence_parallel=false to silence this.",
        stacklevel=2,
    )
    return False


def _setup_parallel(megatron_cfg: dict) -> None:
    from verl.utils.megatron.parallel_state import initialize_model_parallel

    initialize_model_parallel(
        tensor_model_parallel_size=int(megatron_cfg.get("tensor_model_parallel_size", 1)),
        pipeline_model_parallel_size=int(megatron_cfg.get("pipeline_model_parallel_size", 1)),
        virtual_pipeline_model_parallel_size=megatron_cfg.get("virtual_pipeline_model_parallel_size"),
        context_parallel_size=int(megatron_cfg.get("context_parallel_size", 1)),
        seed=int(megatron_cfg.get("seed", 42)),
    )


def _register_mesh(worker: Worker, mesh: str) -> None:
    """This rank's data-parallel replica, and whether it is the replica's collecting rank."""
    from megatron.core import parallel_state as mpu

    collect = mpu.get_tensor_model_parallel_rank() == 0 and mpu.is_pipeline_last_stage(ignore_virtual=True)
    worker._register_dispatch_collect_info(mesh, mpu.get_data_parallel_rank(), collect)
    return collect


class _MegatronModel:
    """This rank's megatron chunks of the HF model at `model_cfg.path` (weights converted on load)."""

    def __init__(self, model_cfg: DictConfig, megatron_cfg, for_training: bool, value_head: bool = False):
        from verl.models.mcore import build_model_chunks, hf_to_mcore_config, load_hf_state_dict
        from verl.utils.model import load_causal_lm, load_model_config, load_valuehead_model

        meg = _plain(megatron_cfg)
        trust = model_cfg.get("trust_remote_code", False)
        overrides = _plain(model_cfg.get("override_config"))
        self.hf_config = load_model_config(model_cfg.path, trust, overrides)
        self.value_head = value_head
        dtype = _DTYPES[str(meg.get("dtype", "fp32"))]
        tf_config = hf_to_mcore_config(self.hf_config, {**meg, "sequence_parallel": _sequence_parallel(meg)}, dtype)
        for key, value in (meg.get("override_transformer_config") or {}).items():
            if not hasattr(tf_config, key):
                raise ValueError(
                    f"megatron.override_transformer_config.{key}: megatron's TransformerConfig has no field {key!r}"
                )
            setattr(tf_config, key, value)
        self.chunks = build_model_chunks(self.hf_config, tf_config, value_head=value_head)
        loader = load_valuehead_model if value_head else load_causal_lm
        hf_model = loader(model_cfg.path, trust_remote_code=trust, override_config=overrides)
        state = {k: v for k, v in hf_model.state_dict().items()}
        if getattr(self.hf_config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        load_hf_state_dict(self.chunks, state, self.hf_config, value_head=value_head)
        del hf_model, state
        for chunk in self.chunks:
            chunk.to(dev.get_device())
            if not for_training:
                chunk.requires_grad_(False)
        self.optimizer = None
        self.param_offload = bool(meg.get("param_offload", False))
        self.optimizer_offload = bool(meg.get("optimizer_offload", False)) and for_training
        self._offload(optimizer=False)

    def parameters(self):
        return [p for chunk in self.chunks for p in chunk.parameters()]

    def _offload(self, optimizer: bool) -> None:
        from verl.utils.fsdp_utils import offload_fsdp_model_to_cpu, offload_fsdp_optimizer

        if self.param_offload:
            for chunk in self.chunks:
                offload_fsdp_model_to_cpu(chunk)
        if optimizer and self.optimizer_offload and self.optimizer is not None:
            offload_fsdp_optimizer(self.optimizer)

    @contextlib.contextmanager
    def on_device(self, optimizer: bool = False):
        """Parameters (and Adam moments) on the device for the block; back on the host when offloaded."""
        from verl.utils.fsdp_utils import load_fsdp_model_to_device, load_fsdp_optimizer

        if self.param_offload:
            for chunk in self.chunks:
                load_fsdp_model_to_device(chunk)
        if optimizer and self.optimizer_offload and self.optimizer is not None:
            load_fsdp_optimizer(self.optimizer)
        try:
            yield
        finally:
            self._offload(optimizer)

    def hf_params(self):
        """`(hf_name, full_tensor)` pairs, streamed; a collective over the tensor and pipeline groups."""
        from verl.models.mcore import mcore_to_hf_named_tensors

        return mcore_to_hf_named_tensors(self.chunks, self.hf_config, value_head=self.value_head)


class _OptimizedMegatronModel(_MegatronModel):
    """A megatron model with AdamW over its shards, the lr schedule and the checkpoint manager."""

    def __init__(self, model_cfg, megatron_cfg, optim_cfg, checkpoint_cfg, tokenizer, value_head: bool = False):
        super().__init__(model_cfg, megatron_cfg, for_training=True, value_head=value_head)
        from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager
        from verl.utils.optim import build_lr_scheduler, build_optimizer

        self.optimizer = build_optimizer([p for p in self.parameters() if p.requires_grad], optim_cfg)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, optim_cfg)
        self.checkpoint_manager = MegatronCheckpointManager(
            self.chunks,
            self.optimizer,
            self.lr_scheduler,
            tokenizer,
            checkpoint_cfg,
            hf_config=self.hf_config,
            value_head=value_head,
        )

    def step_scheduler(self) -> float:
        lr = self.lr_scheduler.get_last_lr()[0]
        self.lr_scheduler.step()
        return lr

    def save(self, local_path: str, global_step: int, max_ckpt_to_keep: int | None) -> None:
        with self.on_device(optimizer=True):
            self.checkpoint_manager.save_checkpoint(
                local_path, global_step=global_step, max_ckpt_to_keep=max_ckpt_to_keep
            )

    def load(self, local_path: str) -> None:
        with self.on_device(optimizer=True):
            self.checkpoint_manager.load_checkpoint(local_path)


def _memory_metrics(metrics: dict) -> None:
    mem = dev.memory_stats()
    for key in ("max_allocated_gb", "cpu_rss_gb"):
        if key in mem:
            metrics[f"perf/{'max_memory_allocated_gb' if key == 'max_allocated_gb' else key}"] = mem[key]


class ActorRolloutRefWorker(Worker):
    """Actor (megatron training), rollout (generation engine) and reference policy, in any combination."""

    def __init__(self, config: DictConfig, role: str):
        super().__init__()
        if role not in _ROLES:
            raise ValueError(f"unknown worker role {role!r}; valid roles: {sorted(_ROLES)}")
        if role == "rollout":
            raise ValueError(
                "the megatron workers do not serve a rollout-only pool; asynchronous training "
                "(async_training.staleness_threshold >= 1) runs with actor.strategy=fsdp"
            )
        self.config = config
        self.role = role
        self.parts = _ROLES[role]
        os.environ["VERL_ROLE"] = role
        _join_group(self)
        _setup_parallel(_plain(config.actor.megatron))
        from megatron.core import parallel_state as mpu

        self.is_collect = _register_mesh(self, "actor")
        self.dp_size = mpu.get_data_parallel_world_size()
        if "actor" in self.parts:
            _normalize_batch_sizes(self.config.actor, self.config.rollout.n, self.dp_size)
        self.actor = self.rollout = self.ref = None

    def _need(self, part: str, method: str):
        if part not in self.parts:
            raise RuntimeError(f"{method} needs the {part} part, but this worker has role {self.role!r}")
        return getattr(self, part)  # None for the rollout on a replica's non-collecting ranks

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from verl.utils.tokenizer import hf_tokenizer
        from verl.workers.actor.megatron_actor import MegatronPPOActor

        cfg = self.config
        self.tokenizer = hf_tokenizer(cfg.model.get("tokenizer_path") or cfg.model.path)
        if "actor" in self.parts:
            self.actor_model = _OptimizedMegatronModel(
                cfg.model, cfg.actor.megatron, cfg.actor.optim, cfg.actor.get("checkpoint"), self.tokenizer
            )
            self.actor = MegatronPPOActor(
                cfg.actor, self.actor_model.chunks, self.actor_model.hf_config, self.actor_model.optimizer
            )
        if "rollout" in self.parts and self.is_collect:
            from verl.workers.rollout import get_rollout_class

            rollout_cls = get_rollout_class(cfg.rollout.name)
            self.rollout = rollout_cls(cfg.model.path, config=cfg.rollout, tokenizer=self.tokenizer)
            if (cfg.rollout.get("multi_turn") or {}).get("enable", False):
                from verl.experimental.agent_loop import AgentLoopRollout

                self.rollout = AgentLoopRollout(self.rollout, cfg.rollout, self.tokenizer)
            if self.actor is not None:
                self.rollout.sleep()  # weights arrive from the actor before each generation
        if "ref" in self.parts:
            ref_meg = (cfg.get("ref") or {}).get("megatron") or cfg.actor.megatron
            self.ref_model = _MegatronModel(cfg.model, ref_meg, for_training=False)
            self.ref = MegatronPPOActor(cfg.actor, self.ref_model.chunks, self.ref_model.hf_config)
        _seed_sampling()

    @register(dispatch_mode=_ACTOR_MESH)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Gather the actor's weights into the engine (every rank: a collective), generate on the
        replica's collecting rank, put the engine to sleep."""
        self._need("rollout", "generate_sequences")
        rollout = self.rollout
        metrics = {}
        if self.actor is not None:
            start = time.perf_counter()
            with self.actor_model.on_device():
                params = self.actor_model.hf_params()
                if rollout is None:
                    for _ in params:  # take part in the gathers; this rank keeps no engine
                        pass
                else:
                    rollout.wake_up()
                    rollout.update_weights(params)
            metrics["timing_s/update_weights"] = time.perf_counter() - start
        if rollout is None:
            return DataProto()
        start = time.perf_counter()
        output = rollout.generate_sequences(prompts)
        metrics["timing_s/generate_sequences"] = time.perf_counter() - start
        if self.actor is not None and self.config.rollout.get("free_cache_engine", True):
            rollout.sleep()
        output.meta_info["metrics"] = {**output.meta_info.get("metrics", {}), **metrics}
        dev.empty_cache()
        return output

    @register(dispatch_mode=_ACTOR_MESH)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        actor = self._need("actor", "compute_log_prob")
        _log_prob_meta(data, self.config.rollout, self.config.rollout.temperature)
        with self.actor_model.on_device():
            log_probs, entropys = actor.compute_log_prob(data, calculate_entropy=True)
        tensors = {"old_log_probs": log_probs}
        if entropys is not None:
            tensors["entropys"] = entropys
        return DataProto.from_dict(tensors=tensors)

    @register(dispatch_mode=_ACTOR_MESH)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        ref = self._need("ref", "compute_ref_log_prob")
        _log_prob_meta(data, self.config.get("ref", {}) or self.config.rollout, self.config.rollout.temperature)
        with self.ref_model.on_device():
            log_probs, _ = ref.compute_log_prob(data, calculate_entropy=False)
        return DataProto.from_dict(tensors={"ref_log_prob": log_probs})

    @register(dispatch_mode=_ACTOR_MESH)
    def update_actor(self, data: DataProto) -> DataProto:
        actor = self._need("actor", "update_actor")
        data.meta_info.setdefault("temperature", self.config.rollout.temperature)
        start = time.perf_counter()
        with self.actor_model.on_device(optimizer=True):
            metrics = actor.update_policy(data)
        metrics["actor/lr"] = self.actor_model.step_scheduler()
        metrics["perf/update_actor_s"] = seconds = time.perf_counter() - start
        # the HF config stands in for the model in the FLOP count (the model is split over ranks)
        holder = type("_Model", (), {"config": self.actor_model.hf_config})()
        actor_mfu = _mfu_metric(holder, data, seconds, self.config.actor.get("ppo_epochs", 1))
        if actor_mfu is not None:
            metrics["perf/mfu/actor"] = actor_mfu
        _memory_metrics(metrics)
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0, max_ckpt_to_keep: int | None = None) -> None:
        self._need("actor", "save_checkpoint")
        self.actor_model.save(local_path, global_step, max_ckpt_to_keep)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str, del_local_after_load: bool = False) -> None:
        self._need("actor", "load_checkpoint")
        self.actor_model.load(local_path)


class CriticWorker(Worker):
    """The value model on megatron: the LM body with a [1, hidden] head, trained with the clipped value loss."""

    def __init__(self, config: DictConfig):
        super().__init__()
        self.config = config
        os.environ["VERL_ROLE"] = "critic"
        _join_group(self)
        _setup_parallel(_plain(config.megatron))
        from megatron.core import parallel_state as mpu

        _register_mesh(self, "critic")
        dp = mpu.get_data_parallel_world_size()
        with open_dict(self.config):
            n = config.get("rollout_n", 1)
            self.config.ppo_mini_batch_size = config.ppo_mini_batch_size * n // dp

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from verl.utils.tokenizer import hf_tokenizer
        from verl.workers.critic.megatron_critic import MegatronPPOCritic

        cfg = self.config
        self.tokenizer = hf_tokenizer(cfg.model.get("tokenizer_path") or cfg.model.path)
        self.critic_model = _OptimizedMegatronModel(
            cfg.model, cfg.megatron, cfg.optim, cfg.get("checkpoint"), self.tokenizer, value_head=True
        )
        self.critic = MegatronPPOCritic(cfg, self.critic_model.chunks, self.critic_model.optimizer)

    @register(dispatch_mode=_CRITIC_MESH)
    def compute_values(self, data: DataProto) -> DataProto:
        data.meta_info.setdefault("micro_batch_size", self.config.get("forward_micro_batch_size_per_gpu") or len(data))
        data.meta_info.setdefault("use_dynamic_bsz", self.config.get("use_dynamic_bsz", False))
        data.meta_info.setdefault("max_token_len", self.config.get("forward_max_token_len_per_gpu", 16384))
        with self.critic_model.on_device():
            values = self.critic.compute_values(data)
        return DataProto.from_dict(tensors={"values": values})

    @register(dispatch_mode=_CRITIC_MESH)
    def update_critic(self, data: DataProto) -> DataProto:
        with self.critic_model.on_device(optimizer=True):
            metrics = self.critic.update_critic(data)
        metrics["critic/lr"] = self.critic_model.step_scheduler()
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0, max_ckpt_to_keep: int | None = None) -> None:
        self.critic_model.save(local_path, global_step, max_ckpt_to_keep)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str, del_local_after_load: bool = False) -> None:
        self.critic_model.load(local_path)


__all__ = ["ActorRolloutRefWorker", "CriticWorker"]
