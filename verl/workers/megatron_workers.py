"""The Ray-facing workers on the Megatron-core backend (`strategy=megatron`).

They are the FSDP workers (`verl.workers.fsdp_workers`) with megatron models behind the FSDP
workers' backend hooks and the data RPCs dispatched over the megatron mesh: same RPCs, roles,
returned keys and RPC bodies, so the trainer does not know which backend it drives. The training
logic is `MegatronPPOActor` / `MegatronPPOCritic`; this module builds the megatron model from the
HF checkpoint and wires it to devices, optimizer, checkpoints and the rollout engine.

Design decisions:
- Layout: the worker group's ranks are carved into megatron's tensor / context / pipeline / data
  parallel groups (`verl.utils.megatron.parallel_state`). Data-carrying RPCs use the mesh-aware
  dispatch (`make_nd_compute_dataproto_dispatch_fn`): every rank of one data-parallel replica
  receives the same chunk, and only one rank per replica (tensor and context rank 0 on the last
  pipeline stage, where the loss and the log-probs live) is collected.
- Rollout (hybrid engine): the generation engine is the same one the FSDP workers use, holding
  full HF weights. Only the collecting rank of each data-parallel replica builds one and
  generates; the other ranks of the replica take part in the weight gather (a collective over
  the tensor and pipeline groups) and return nothing. Generation is thus data-parallel over
  replicas, not tensor-parallel; a tensor-parallel engine (vLLM/SGLang with
  `rollout.tensor_model_parallel_size`) is the route for models that do not fit one device.
- Weights: every rank reads the HF checkpoint at start-up and keeps its shard
  (`verl.models.mcore.load_hf_state_dict`), or, with `megatron.use_dist_checkpointing`, reads only
  its shards of a dist checkpoint made once with `python -m verl.models.mcore.converter`; the
  rollout engine and `hf_model` checkpoints get full HF-named tensors streamed one at a time
  (`mcore_to_hf_named_tensors`).
- Optimizer: torch AdamW over this rank's shards with the FSDP backend's lr schedules (why not
  megatron's optimizer: see `verl.workers.actor.megatron_actor`). Checkpoints: dist_checkpointing
  for weights and Adam moments, reshardable across layouts
  (`verl.utils.checkpoint.megatron_checkpoint_manager`).
- Offload (`megatron.param_offload` / `optimizer_offload`): parameters and Adam moments live on
  the host between the RPCs that use them; no-ops on a CPU device.
- `megatron.sequence_parallel` changes memory, not results (tested); it runs on CPU and GPU
  without TransformerEngine or apex (`verl.models.mcore.config.RMSNorm`).
"""

from __future__ import annotations

import contextlib

import torch
from omegaconf import DictConfig

from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.single_controller.base.worker import dist_timeout_s
from verl.utils import device as dev
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.optim import local_optimizer
from verl.workers import fsdp_workers
from verl.workers.config import McoreEngineConfig, McoreOptimizerConfig
from verl.workers.fsdp_workers import _cast_floating, _plain

_ACTOR_MESH = make_nd_compute_dataproto_dispatch_fn("actor")
_CRITIC_MESH = make_nd_compute_dataproto_dispatch_fn("critic")
_REWARD_MESH = make_nd_compute_dataproto_dispatch_fn("reward")


def _setup_parallel(megatron_cfg) -> None:
    """Megatron's process groups from a role's `megatron` section (built as `McoreEngineConfig`: keys
    it leaves out take the class's defaults, no parallelism and seed 42)."""
    from verl.utils.megatron.parallel_state import initialize_model_parallel

    meg = (
        megatron_cfg
        if isinstance(megatron_cfg, McoreEngineConfig)
        else omega_conf_to_dataclass(megatron_cfg, McoreEngineConfig)
    )
    initialize_model_parallel(
        timeout_s=dist_timeout_s(),  # the deadline this process's group was created with
        tensor_model_parallel_size=meg.tensor_model_parallel_size,
        pipeline_model_parallel_size=meg.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=meg.virtual_pipeline_model_parallel_size,
        context_parallel_size=meg.context_parallel_size,
        seed=meg.seed,
        expert_model_parallel_size=meg.expert_model_parallel_size,
        expert_tensor_parallel_size=meg.expert_tensor_parallel_size,
    )


def _register_mesh(worker: Worker, mesh: str) -> None:
    """This rank's data-parallel replica, and whether it is the replica's collecting rank."""
    from megatron.core import parallel_state as mpu

    collect = (
        mpu.get_tensor_model_parallel_rank() == 0
        and mpu.get_context_parallel_rank() == 0
        and mpu.is_pipeline_last_stage(ignore_virtual=True)
    )
    worker._register_dispatch_collect_info(mesh, mpu.get_data_parallel_rank(), collect)
    return collect


class _MegatronModel:
    """This rank's megatron chunks of the HF model at `model_cfg.path` (weights converted on load)."""

    def __init__(
        self,
        model_cfg: DictConfig,
        megatron_cfg,
        for_training: bool,
        value_head: bool = False,
        sequence_classifier: bool = False,
    ):
        """value_head: a [1, hidden] score head instead of the LM head, from a token-classification
        checkpoint (critic), or with `sequence_classifier` from a sequence-classification one (reward
        model, whose head has no bias: it gets a zero one)."""
        from verl.models.mcore import (
            build_model_chunks,
            hf_to_mcore_config,
            load_hf_state_dict,
            megatron_dtypes,
            set_compute_dtype,
        )
        from verl.utils.model import (
            load_causal_lm,
            load_model_config,
            load_sequence_classifier,
            load_valuehead_model,
        )

        meg = _plain(megatron_cfg)
        trust = model_cfg.get("trust_remote_code", False)
        overrides = _plain(model_cfg.get("override_config"))
        # a value model's saved config says one output, as the FSDP critic's does
        config_overrides = {"num_labels": 1, **(overrides or {})} if value_head else overrides
        self.hf_config = load_model_config(model_cfg.path, trust, config_overrides)
        self.value_head = value_head
        # fp32 parameters, the forward autocast to a 16-bit dtype (see verl.models.mcore.config)
        param_dtype, compute_dtype = megatron_dtypes(meg.get("dtype", "auto"), for_training)
        tf_config = hf_to_mcore_config(self.hf_config, meg, param_dtype, compute_dtype)
        for key, value in (meg.get("override_transformer_config") or {}).items():
            if not hasattr(tf_config, key):
                raise ValueError(
                    f"megatron.override_transformer_config.{key}: megatron's TransformerConfig has no field {key!r}"
                )
            setattr(tf_config, key, value)
        self.chunks = build_model_chunks(self.hf_config, tf_config, value_head=value_head)
        set_compute_dtype(self.chunks, compute_dtype)
        if meg.get("use_dist_checkpointing"):
            if sequence_classifier:
                raise ValueError(
                    "reward_model.megatron.use_dist_checkpointing=true: a reward model's score head comes from its HF "
                    "checkpoint; set it to false"
                )
            self._load_dist_checkpoint(meg, int(meg.get("seed", 42)))
        else:
            if sequence_classifier:
                loader = load_sequence_classifier
            else:
                loader = load_valuehead_model if value_head else load_causal_lm
            hf_model = loader(model_cfg.path, trust_remote_code=trust, override_config=overrides)
            state = {k: v for k, v in hf_model.state_dict().items()}
            if sequence_classifier and "score.bias" not in state:
                state["score.bias"] = torch.zeros(1, dtype=state["score.weight"].dtype)
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

    def _load_dist_checkpoint(self, meg: dict, seed: int) -> None:
        """Weights from `megatron.dist_checkpointing_path` instead of the HF checkpoint (each rank reads
        its shards only). A value head starts as HF initialises a token-classification head: normal
        with the config's initializer_range, zero bias, the same on every rank."""
        from verl.utils.checkpoint.megatron_checkpoint_manager import load_dist_checkpoint_weights

        path = meg.get("dist_checkpointing_path")
        if not path:
            raise ValueError(
                "megatron.use_dist_checkpointing=true needs megatron.dist_checkpointing_path (a dist checkpoint made "
                "with `python -m verl.models.mcore.converter`)"
            )
        load_dist_checkpoint_weights(
            self.chunks, path, value_head=self.value_head, prefix=meg.get("dist_checkpointing_prefix") or ""
        )
        head = self.chunks[-1].output_layer if self.value_head and hasattr(self.chunks[-1], "output_layer") else None
        if head is not None:
            generator = torch.Generator().manual_seed(seed)
            std = float(getattr(self.hf_config, "initializer_range", 0.02))
            with torch.no_grad():
                head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * std)
                head.bias.zero_()

    def parameters(self):
        return [p for chunk in self.chunks for p in chunk.parameters()]

    def _offload(self, optimizer: bool) -> None:
        from verl.utils.fsdp_utils import offload_fsdp_model_to_cpu, offload_fsdp_optimizer

        if self.param_offload:
            for chunk in self.chunks:
                offload_fsdp_model_to_cpu(chunk)
        if optimizer and self.optimizer_offload and self.optimizer is not None:
            offload_fsdp_optimizer(local_optimizer(self.optimizer))

    @contextlib.contextmanager
    def on_device(self, optimizer: bool = False):
        """Parameters (and Adam moments) on the device for the block; back on the host when offloaded."""
        from verl.utils.fsdp_utils import load_fsdp_model_to_device, load_fsdp_optimizer

        if self.param_offload:
            for chunk in self.chunks:
                load_fsdp_model_to_device(chunk)
        if optimizer and self.optimizer_offload and self.optimizer is not None:
            load_fsdp_optimizer(local_optimizer(self.optimizer))
        try:
            yield
        finally:
            self._offload(optimizer)

    def adapters_disabled(self):
        """No LoRA on this backend: the model always computes as itself."""
        return contextlib.nullcontext()

    def hf_params(self, dtype: torch.dtype | None = None):
        """`(hf_name, full_tensor)` pairs, streamed; a collective over the tensor and pipeline groups.
        `dtype` casts floating-point tensors once gathered."""
        from verl.models.mcore import mcore_to_hf_named_tensors

        params = mcore_to_hf_named_tensors(self.chunks, self.hf_config, value_head=self.value_head)
        return params if dtype is None else _cast_floating(params, dtype)


def megatron_optim_settings(optim_cfg) -> dict:
    """Upstream's Megatron optimizer section (optim/megatron.yaml, built as `McoreOptimizerConfig`) in
    the spelling `build_lr_scheduler` reads: `lr_decay_style` is the schedule (lr_scheduler_type), and
    the absolute floor `min_lr` of the cosine decay is `min_lr_ratio = min_lr / lr` (lr > 0 is the
    class's own check). Keys the section leaves out take the class's (upstream's) defaults."""
    if not isinstance(optim_cfg, McoreOptimizerConfig):
        optim_cfg = omega_conf_to_dataclass(optim_cfg, McoreOptimizerConfig)
    settings = {name: optim_cfg[name] for name in optim_cfg if name != "_target_"}
    settings["lr_scheduler_type"] = optim_cfg.lr_decay_style
    settings["min_lr_ratio"] = optim_cfg.min_lr / optim_cfg.lr
    return settings


class _OptimizedMegatronModel(_MegatronModel):
    """A megatron model with AdamW over its shards, the lr schedule and the checkpoint manager."""

    def __init__(self, model_cfg, megatron_cfg, optim_cfg, checkpoint_cfg, tokenizer, value_head: bool = False):
        super().__init__(model_cfg, megatron_cfg, for_training=True, value_head=value_head)

        from verl.models.mcore.moe import optimizer_state_shard_group
        from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager
        from verl.utils.optim import build_lr_scheduler, build_optimizer

        # use_distributed_optimizer: Adam state split over the replicas of this rank's parameters
        # (ZeRO-1; the data-parallel ranks, fewer under expert parallelism)
        split = _plain(megatron_cfg).get("use_distributed_optimizer")
        shard_over = optimizer_state_shard_group() if split else None
        optim = megatron_optim_settings(optim_cfg)
        self.optimizer = build_optimizer(
            [p for p in self.parameters() if p.requires_grad], optim, shard_state_over=shard_over
        )
        self.lr_scheduler = build_lr_scheduler(self.optimizer, optim)
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


def _on_mesh(rpc, mesh):
    """The FSDP worker's RPC `rpc` (its body), registered with the megatron mesh dispatch `mesh`."""
    return register(dispatch_mode=mesh)(rpc.__wrapped__)


class ActorRolloutRefWorker(fsdp_workers.ActorRolloutRefWorker):
    """Actor (megatron training), rollout (generation engine) and reference policy, in any combination.

    The FSDP worker's RPC bodies, with megatron models behind its hooks and the data RPCs
    dispatched over the megatron mesh."""

    def __init__(
        self, config: DictConfig, role: str, project_name: str | None = None, experiment_name: str | None = None
    ):
        if role == "rollout":
            raise ValueError(
                "the megatron workers do not serve a rollout-only pool: a rollout pool only generates, so use "
                "verl.workers.fsdp_workers.ActorRolloutRefWorker for it (main_ppo does, for any actor strategy)"
            )
        super().__init__(config, role, project_name, experiment_name)

    def _data_parallel_size(self) -> int:
        _setup_parallel(_plain(self.config.actor.megatron))
        self.is_collect = _register_mesh(self, "actor")
        from megatron.core import parallel_state as mpu

        return mpu.get_data_parallel_world_size()

    def _build_actor(self):
        from verl.workers.actor.megatron_actor import MegatronPPOActor

        cfg = self.config
        model = _OptimizedMegatronModel(
            cfg.model, cfg.actor.megatron, cfg.actor.optim, cfg.actor.get("checkpoint"), self.tokenizer
        )
        return model, MegatronPPOActor(cfg.actor, model.chunks, model.hf_config, model.optimizer)

    def _build_ref(self):
        from verl.workers.actor.megatron_actor import MegatronPPOActor

        cfg = self.config
        model = _MegatronModel(cfg.model, (cfg.get("ref") or {}).get("megatron") or cfg.actor.megatron, False)
        return model, MegatronPPOActor(cfg.actor, model.chunks, model.hf_config)

    def _builds_engine(self) -> bool:
        return self.is_collect

    generate_sequences = _on_mesh(fsdp_workers.ActorRolloutRefWorker.generate_sequences, _ACTOR_MESH)
    compute_log_prob = _on_mesh(fsdp_workers.ActorRolloutRefWorker.compute_log_prob, _ACTOR_MESH)
    compute_ref_log_prob = _on_mesh(fsdp_workers.ActorRolloutRefWorker.compute_ref_log_prob, _ACTOR_MESH)
    update_actor = _on_mesh(fsdp_workers.ActorRolloutRefWorker.update_actor, _ACTOR_MESH)


class CriticWorker(fsdp_workers.CriticWorker):
    """The value model on megatron: the LM body with a [1, hidden] head, trained with the clipped value loss."""

    def _data_parallel_size(self) -> int:
        _setup_parallel(_plain(self.config.megatron))
        _register_mesh(self, "critic")
        from megatron.core import parallel_state as mpu

        return mpu.get_data_parallel_world_size()

    def _build_critic(self):
        from verl.workers.critic.megatron_critic import MegatronPPOCritic

        cfg = self.config
        model = _OptimizedMegatronModel(
            cfg.model, cfg.megatron, cfg.optim, cfg.get("checkpoint"), self.tokenizer, value_head=True
        )
        return model, MegatronPPOCritic(cfg, model.chunks, model.optimizer, hf_config=model.hf_config)

    compute_values = _on_mesh(fsdp_workers.CriticWorker.compute_values, _CRITIC_MESH)
    update_critic = _on_mesh(fsdp_workers.CriticWorker.update_critic, _CRITIC_MESH)


def _pooled_columns(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id) -> torch.Tensor:
    """[B] column of each row's pooled token after `left_align`: the token HF's
    `*ForSequenceClassification` pools (the rightmost one that is not the pad token), or the last
    real token when the config has no pad token (HF then only scores unpadded single rows)."""
    columns = torch.arange(input_ids.shape[1], device=input_ids.device)
    if pad_token_id is None:
        keep = attention_mask.bool()
    else:
        keep = input_ids != pad_token_id
    last = (columns * keep.long()).argmax(dim=1)
    first = attention_mask.long().argmax(dim=1)
    return (last - first).clamp(min=0)


class RewardModelWorker(fsdp_workers.RewardModelWorker):
    """The learned reward model on megatron (`reward_model.strategy=megatron`), tensor/pipeline parallel.

    An HF `*ForSequenceClassification` checkpoint becomes a GPTModel whose output layer is its
    [1, hidden] `score` head (the critic's value head, with a zero bias), so the model gives a score
    at every token; each row's score is the one at the token HF's classifier pools. Inputs, the
    re-tokenisation with the reward model's own tokenizer and the placement of the score on the
    last response token are the FSDP worker's."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        _setup_parallel(_plain(self.config.megatron))
        _register_mesh(self, "reward")
        self.reward_model = _MegatronModel(
            self.config.model, self.config.megatron, for_training=False, value_head=True, sequence_classifier=True
        )
        self._load_tokenizers()

    @torch.no_grad()
    def _sequence_scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        from tensordict import TensorDict

        from verl.workers.actor.megatron_actor import broadcast_from_last_stage, run_megatron_schedule

        model = self.reward_model
        rows = len(input_ids)
        batch = TensorDict(
            {
                "input_ids": input_ids,
                "attention_mask": attention_mask,
                "position_ids": (attention_mask.long().cumsum(-1) - 1).clamp(min=0),
                "responses": input_ids[:, -1:],  # the schedule's row layout wants one; nothing reads it
                "pooled": _pooled_columns(input_ids, attention_mask, model.hf_config.get_text_config().pad_token_id),
            },
            batch_size=[rows],
        )
        micro = int(self.config.get("micro_batch_size_per_gpu") or rows)

        def score_fn(micro_batch, output):
            scores = micro_batch["_aligned"].full(output[..., 0]).gather(1, micro_batch["pooled"][:, None]).squeeze(1)
            return output.new_zeros(()), {"scores": scores}

        for chunk in model.chunks:
            chunk.eval()
        with model.on_device():
            results = run_megatron_schedule(model.chunks, list(batch.split(micro)), score_fn, forward_only=True)
        results = broadcast_from_last_stage(results)
        return torch.cat([r["scores"] for r in results]).float().cpu()

    compute_rm_score = _on_mesh(fsdp_workers.RewardModelWorker.compute_rm_score, _REWARD_MESH)


__all__ = ["ActorRolloutRefWorker", "CriticWorker", "RewardModelWorker"]
