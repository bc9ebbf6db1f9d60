"""The Megatron-core engine: this rank's tensor/pipeline chunks of an HF model, converted on load.

Design decisions:
- Layout: the group's ranks are carved into megatron's tensor / context / pipeline / data parallel
  groups (`init_parallel`, `verl.utils.megatron.parallel_state`); one rank per data-parallel
  replica (tensor and context rank 0 on the last pipeline stage, where losses and log-probs live)
  returns the replica's results (`is_mp_src_rank_with_outputs`).
- Weights: every rank reads the HF checkpoint and keeps its shard (`verl.models.mcore.load_hf_state_dict`),
  or, with `megatron.use_dist_checkpointing`, reads only its shards of a dist checkpoint made once
  with `python -m verl.models.mcore.converter`; the rollout engine and `hf_model` checkpoints get
  full HF-named tensors streamed one at a time (`iter_hf_params`, which the engine also
  hands the checkpoint manager, so the manager needs no model converter of its own).
- Optimizer: torch AdamW over this rank's shards with the FSDP backend's lr schedules and
  megatron's weight-decay ramp (`verl.utils.optim.MegatronParamScheduler`; why not megatron's
  optimizer: see `verl.workers.actor.megatron_actor`); `use_distributed_optimizer`
  splits the Adam state over the data-parallel replicas (ZeRO-1). Checkpoints: dist_checkpointing
  for weights and Adam moments, reshardable across layouts
  (`verl.utils.checkpoint.megatron_checkpoint_manager`).
- Offload (`megatron.param_offload` / `optimizer_offload`): parameters and Adam moments live on
  the host between uses; no-ops on a CPU device.
- Batch API (`train_batch` / `infer_batch` / `forward_backward_batch`, what upstream's `TrainingWorker`
  runs): the micro-batches go through megatron's schedule (`verl.workers.engine.megatron.batch`);
  `optimizer_step` reduces the gradients as the PPO actor does (`finalize_megatron_grads`) and clips
  them by the full model's norm.
- LoRA (`model.lora.rank > 0`, see `verl.models.mcore.lora`): adapters on the trained model's
  linear layers, the rest frozen but a critic's value head; `disable_adapter` gives the base model
  (the reference policy) and the rollout receives the merged weights.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from verl.single_controller.base.worker import dist_timeout_s
from verl.utils import device as dev
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.optim import local_optimizer
from verl.workers.config import CriticModelConfig, HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
from verl.workers.config.engine import freeze_moe_router
from verl.workers.engine.base import BaseEngine, EngineRegistry
from verl.workers.engine.utils import cast_floating, plain_section

__all__ = [
    "MegatronEngine",
    "MegatronEngineWithLMHead",
    "MegatronEngineWithValueHead",
    "megatron_optim_settings",
    "setup_parallel",
]


def setup_parallel(megatron_cfg) -> None:
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


def _mtp_section(model_config, hf_config, trained_policy: bool):
    """`model.mtp` when this model is built with its multi-token-prediction layers (`mtp.enable` on the
    trained policy, as upstream: the reference and value models never use them), else None."""
    from verl.models.mcore.mtp import mtp_num_layers

    mtp = getattr(model_config, "mtp", None)
    if not (trained_policy and mtp is not None and mtp.enable):
        return None
    if not mtp_num_layers(hf_config):
        raise ValueError(
            f"actor_rollout_ref.model.mtp.enable=true, but the model at {model_config.path} has no multi-token-"
            "prediction layers (its config has no num_nextn_predict_layers > 0); use a model with MTP layers "
            "(MiMo) or set mtp.enable=false"
        )
    if hf_config.model_type != "qwen2":
        raise NotImplementedError(
            f"actor_rollout_ref.model.mtp.enable=true on a {hf_config.model_type} model: the megatron backend builds "
            "the MTP layers of Qwen2-architecture models in MiMo's layout (model.mtp_layers.*) only; set "
            "mtp.enable=false (its MTP weights are then ignored, as HF's model ignores them)"
        )
    return mtp


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


class MegatronEngine(BaseEngine):
    """This rank's megatron chunks (`chunks`) of the HF model at `model_config.path`, with AdamW over
    its shards, the lr schedule and the checkpoint manager when built with an `optimizer_config`."""

    value_head = False
    """A [1, hidden] score head instead of the LM head (critic, reward model)."""

    def __init__(
        self,
        model_config,
        engine_config,
        optimizer_config=None,
        checkpoint_config=None,
        tokenizer=None,
        sequence_classifier: bool = False,
        load_weight: bool = True,
    ):
        """`sequence_classifier` (value head only): the head comes from a sequence-classification
        checkpoint (a reward model, whose head has no bias: it gets a zero one) instead of a
        token-classification one. `load_weight=False` (the role's upstream key): no weights are
        read; the model keeps megatron's initialisation, drawn from `megatron.seed` (see
        `_build_chunks`)."""
        from verl.models.mcore import (
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
            model_dir_with_config,
        )

        for_training = optimizer_config is not None
        value_head = self.value_head
        meg = omega_conf_to_dataclass(engine_config, McoreEngineConfig)
        if not sequence_classifier:  # a reward model's section has no workers-layer class: read as it is
            model_config = omega_conf_to_dataclass(model_config, CriticModelConfig if value_head else HFModelConfig)
        trust = model_config.trust_remote_code
        overrides = plain_section(model_config.override_config)
        # a value model's saved config says one output, as the FSDP critic's does
        config_overrides = {"num_labels": 1, **(overrides or {})} if value_head else overrides
        # the policy's model.hf_config_path: its config.json over the weights of path
        model_dir = model_dir_with_config(model_config.path, getattr(model_config, "hf_config_path", None))
        self.hf_config = load_model_config(model_dir, trust, config_overrides)
        mtp = _mtp_section(model_config, self.hf_config, for_training and not value_head)
        # fp32 parameters, the forward autocast to a 16-bit dtype (see verl.models.mcore.config)
        param_dtype, compute_dtype = megatron_dtypes(meg.dtype, for_training)
        build_config = self.hf_config
        if value_head and getattr(self.hf_config, "num_nextn_predict_layers", 0):
            # a value model never builds multi-token-prediction layers (see _mtp_section), and HF's token
            # classifier ignores them: a DeepSeek-V3 checkpoint's (refused for the policy) is no obstacle
            build_config = copy.deepcopy(self.hf_config)
            build_config.num_nextn_predict_layers = 0
        tf_config = hf_to_mcore_config(build_config, dict(meg), param_dtype, compute_dtype)
        if mtp is not None:  # build the MTP layers (verl.models.mcore.mtp)
            tf_config.mtp_num_layers = self.hf_config.num_nextn_predict_layers
        for key, value in meg.override_transformer_config.items():
            if not hasattr(tf_config, key):
                raise ValueError(
                    f"megatron.override_transformer_config.{key}: megatron's TransformerConfig has no field {key!r}"
                )
            setattr(tf_config, key, value)
        self.chunks = self._build_chunks(tf_config, meg.seed, random_init=not load_weight)
        set_compute_dtype(self.chunks, compute_dtype)
        # load_weight=false (upstream's key): megatron's seeded initialisation stays, nothing is read
        if load_weight and meg.use_dist_checkpointing:
            if sequence_classifier:
                raise ValueError(
                    "reward_model.megatron.use_dist_checkpointing=true: a reward model's score head comes from its HF "
                    "checkpoint; set it to false"
                )
            self._load_dist_checkpoint(meg)
        elif load_weight:
            if sequence_classifier:
                loader = load_sequence_classifier
            else:
                loader = load_valuehead_model if value_head else load_causal_lm
            hf_model = loader(model_dir, trust_remote_code=trust, override_config=overrides)
            state = {k: v for k, v in hf_model.state_dict().items()}
            if sequence_classifier and "score.bias" not in state:
                state["score.bias"] = torch.zeros(1, dtype=state["score.weight"].dtype)
            if getattr(self.hf_config, "tie_word_embeddings", False):
                state.pop("lm_head.weight", None)
            load_hf_state_dict(self.chunks, state, self.hf_config, value_head=value_head)
            if mtp is not None:
                from verl.models.mcore.mtp_weights import load_mtp_state_dict

                load_mtp_state_dict(self.chunks, model_dir, state, self.hf_config)
            del hf_model, state
        if for_training and freeze_moe_router(meg.override_mcore_model_config):
            self._freeze_routers(model_config.path)
        if mtp is not None:
            from verl.models.mcore.mtp import configure_mtp

            configure_mtp(self.chunks, mtp.enable_train, mtp.mtp_loss_scaling_factor, mtp.detach_encoder)
        # LoRA (model.lora.rank > 0) on a trained model: the policy's frozen base is the reference; a
        # critic's value head trains whole beside the adapters. A reward model's section (read as it
        # is) may have no lora; the typed model configs always do
        lora = plain_section(getattr(model_config, "lora", None))
        self.lora = for_training and bool(lora) and int(lora["rank"]) > 0
        self.lora_config = lora if self.lora else None
        if self.lora:
            from verl.models.mcore.lora import apply_lora

            key = "critic.model.lora" if value_head else "actor_rollout_ref.model.lora"
            apply_lora(self.chunks, lora, seed=meg.seed, value_head=value_head, key=key)
        for chunk in self.chunks:
            chunk.to(dev.get_device())
            if not for_training:
                chunk.requires_grad_(False)
        self.optimizer = None
        self.param_offload = meg.param_offload
        self.optimizer_offload = meg.optimizer_offload and for_training
        self._offload(optimizer=False)
        if for_training:
            self._build_optimizer(meg, optimizer_config, checkpoint_config, tokenizer)

    def _build_optimizer(self, meg: McoreEngineConfig, optimizer_config, checkpoint_config, tokenizer) -> None:
        from verl.models.mcore.moe import optimizer_state_shard_group
        from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager
        from verl.utils.optim import MegatronParamScheduler, build_optimizer

        # use_distributed_optimizer: Adam state split over the replicas of this rank's parameters
        # (ZeRO-1; the data-parallel ranks, fewer under expert parallelism)
        shard_over = optimizer_state_shard_group() if meg.use_distributed_optimizer else None
        optim = megatron_optim_settings(optimizer_config)
        self.optimizer_config = (
            optimizer_config
            if isinstance(optimizer_config, McoreOptimizerConfig)
            else omega_conf_to_dataclass(optimizer_config, McoreOptimizerConfig)
        )
        self.optimizer = build_optimizer(
            [p for p in self.parameters() if p.requires_grad], optim, shard_state_over=shard_over
        )
        # lr and weight-decay schedule; its settings travel in checkpoints (use_checkpoint_opt_param_scheduler)
        self.lr_scheduler = MegatronParamScheduler(
            self.optimizer, optim, use_checkpoint_settings=optim["use_checkpoint_opt_param_scheduler"]
        )
        self.checkpoint_manager = MegatronCheckpointManager(
            self.chunks,
            self.optimizer,
            self.lr_scheduler,
            tokenizer,
            checkpoint_config,
            hf_config=self.hf_config,
            hf_weights=self.iter_hf_params,
            lora_config=self.lora_config,
        )

    def _build_chunks(self, tf_config, seed: int, random_init: bool) -> list:
        """This rank's chunks. With `random_init` their initial weights are the model: megatron draws
        each full weight on the host (`use_cpu_initialization`) and keeps this rank's shard, so the
        build runs from `seed` on every rank (data-parallel replicas, and the reference next to the
        actor, start from the same weights), without disturbing the process's random stream."""
        from verl.models.mcore import build_model_chunks

        if not random_init:
            return build_model_chunks(self.hf_config, tf_config, value_head=self.value_head)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            chunks = build_model_chunks(self.hf_config, tf_config, value_head=self.value_head)
            head = chunks[-1].output_layer if self.value_head and hasattr(chunks[-1], "output_layer") else None
            if head is not None:  # megatron's output-layer initialisation, which our [1, hidden] head skips
                with torch.no_grad():
                    head.weight.normal_(0.0, tf_config.init_method_std)
                    head.bias.zero_()
        return chunks

    def _freeze_routers(self, model_path) -> None:
        """`override_mcore_model_config.moe_config.freeze_moe_router` (`verl.models.mcore.moe.freeze_routers`),
        refused on a dense model, where it would change nothing."""
        from verl.models.mcore.moe import freeze_routers

        if not self.chunks[0].config.num_moe_experts:
            raise ValueError(
                "megatron.override_mcore_model_config.moe_config.freeze_moe_router=true, but the model at "
                f"{model_path} is dense (no mixture-of-experts router to freeze); remove the option"
            )
        freeze_routers(self.chunks)  # a pipeline stage of dense layers only holds none

    def _load_dist_checkpoint(self, meg: McoreEngineConfig) -> None:
        """Weights from `megatron.dist_checkpointing_path` instead of the HF checkpoint (each rank reads
        its shards only). A value head starts as HF initialises a token-classification head: normal
        with the config's initializer_range, zero bias, the same on every rank."""
        from verl.utils.checkpoint.megatron_checkpoint_manager import load_dist_checkpoint_weights

        path = meg.dist_checkpointing_path
        if not path:
            raise ValueError(
                "megatron.use_dist_checkpointing=true needs megatron.dist_checkpointing_path (a dist checkpoint made "
                "with `python -m verl.models.mcore.converter`)"
            )
        load_dist_checkpoint_weights(
            self.chunks, path, value_head=self.value_head, prefix=meg.dist_checkpointing_prefix
        )
        head = self.chunks[-1].output_layer if self.value_head and hasattr(self.chunks[-1], "output_layer") else None
        if head is not None:
            generator = torch.Generator().manual_seed(meg.seed)
            std = float(getattr(self.hf_config, "initializer_range", 0.02))
            with torch.no_grad():
                head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * std)
                head.bias.zero_()

    @classmethod
    def init_parallel(cls, engine_config) -> int:
        from megatron.core import parallel_state as mpu

        setup_parallel(plain_section(engine_config))
        return mpu.get_data_parallel_world_size()

    @staticmethod
    def is_mp_src_rank_with_outputs() -> bool:
        from megatron.core import parallel_state as mpu

        return (
            mpu.get_tensor_model_parallel_rank() == 0
            and mpu.get_context_parallel_rank() == 0
            and mpu.is_pipeline_last_stage(ignore_virtual=True)
        )

    @staticmethod
    def data_parallel_rank() -> int:
        from megatron.core import parallel_state as mpu

        return mpu.get_data_parallel_rank()

    def parameters(self):
        return [p for chunk in self.chunks for p in chunk.parameters()]

    def _switch_mode(self, training: bool) -> None:
        for chunk in self.chunks:
            chunk.train(training)

    def _offload(self, optimizer: bool) -> None:
        from verl.utils.fsdp_utils import offload_fsdp_model_to_cpu, offload_fsdp_optimizer

        if self.param_offload:
            for chunk in self.chunks:
                offload_fsdp_model_to_cpu(chunk)
        if optimizer and self.optimizer_offload and self.optimizer is not None:
            offload_fsdp_optimizer(local_optimizer(self.optimizer))

    @contextlib.contextmanager
    def on_device(self, optimizer: bool = False):
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

    def _placed_state(self) -> tuple[list, object]:
        return list(self.chunks), None if self.optimizer is None else local_optimizer(self.optimizer)

    # ------------------------------------------------------------ the batch API (EngineBatchAPI)
    def get_data_parallel_group(self):
        from megatron.core import parallel_state as mpu

        return mpu.get_data_parallel_group()

    def _token_budget(self, max_tokens: int) -> int:
        from verl.workers.actor.megatron_actor import per_rank_token_budget

        return per_rank_token_budget(max_tokens)  # a context-parallel rank holds 1/cp of each row

    def _forward_backward_micro_batches(self, micro_batches: list, loss_function, forward_only: bool):
        """The micro-batches through megatron's schedule (`verl.workers.engine.megatron.batch`)."""
        from verl.workers.engine.megatron.batch import forward_backward_micro_batches

        return forward_backward_micro_batches(self, micro_batches, loss_function, forward_only)

    def optimizer_step(self) -> float:
        """Reduce the gradients over the replicas (and tied / sequence-parallel copies), clip them to
        `clip_grad` by the full model's norm and step (skipped when the norm is not finite)."""
        from verl.workers.actor.megatron_actor import clip_grads_megatron, finalize_megatron_grads
        from verl.workers.dp_training import step_if_finite

        self._require_optimizer("optimizer_step")
        finalize_megatron_grads(self.chunks)
        grad_norm = float(clip_grads_megatron(self.chunks, self.optimizer_config.clip_grad))
        step_if_finite(self.optimizer, grad_norm)
        return grad_norm

    def disable_adapter(self):
        if not self.lora:
            return contextlib.nullcontext()
        from verl.models.mcore.lora import adapters_disabled

        return adapters_disabled(self.chunks)

    def iter_hf_params(self, dtype: torch.dtype | None = None):
        """A collective over the tensor and pipeline groups; `dtype` casts each tensor once gathered."""
        from verl.models.mcore import mcore_to_hf_named_tensors

        params = mcore_to_hf_named_tensors(self.chunks, self.hf_config, value_head=self.value_head)
        return params if dtype is None else cast_floating(params, dtype)


@EngineRegistry.register(model_type="language_model", backend="megatron")
class MegatronEngineWithLMHead(MegatronEngine):
    """A causal LM (actor, reference policy) on megatron-core."""

    value_head = False


@EngineRegistry.register(model_type="value_model", backend="megatron")
class MegatronEngineWithValueHead(MegatronEngine):
    """A value model (critic; with `sequence_classifier`, a reward model) on megatron-core."""

    value_head = True
