"""The FSDP2 engine: an HF model sharded over the group's ranks (or replicated when small).

Design decisions:
- Only rank 0 reads the checkpoint; the other ranks build on the meta device and receive its
  weights by broadcast once wrapped (`verl.utils.fsdp_utils.load_full_state_from_rank0`).
- A small model (under `REPLICATE_BELOW_PARAMS`) with `fsdp_size=-1` is replicated instead of
  sharded, and, when FSDP2 would not change how it computes (no CPU offload, no mixed-precision
  cast), trained as plain replicas without FSDP at all (`trains_as_plain_replicas`).
- LoRA (`model.lora_rank > 0` or `model.lora_adapter_path`, see `verl.utils.lora`): the trained
  model is wrapped with peft before sharding and only the adapters train; `disable_adapter` gives
  the base model (the reference policy), and the rollout receives the merged weights.
- Vision-language models (`verl.utils.vision.is_vision_language_config`) load with
  `AutoModelForImageTextToText` (`verl.utils.model.load_causal_lm`); FSDP2 wraps each vision block and
  each decoder layer (the model's `_no_split_modules`). `freeze_vision_tower` (the actor's key, as
  upstream) takes the vision tower (`model.visual`) out of training before sharding: it gets no
  gradient and no optimizer state, and its weights stay bit-equal through updates.
- The batch API (`verl.workers.engine.batch_api`) on a vision-language model: each micro-batch's packed
  row gets its rows' images (the batch's per-row `multi_modal_inputs`, in row order) and M-RoPE positions
  [C, 1, T]; the input-only vision markers are kept out of the log-probs as the PPO actor keeps them
  (`verl.utils.vision.mask_input_only_logits`), so both give the same log-probs. Ulysses (sp > 1) is
  refused for such a model, as the PPO actor refuses it.
- Offload (`param_offload` / `optimizer_offload`): parameters and Adam moments live on the host
  between the RPCs that use them (`on_device`); no-ops on a CPU device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.distributed as dist

from verl.utils import device as dev
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import CriticModelConfig, FSDPEngineConfig, HFModelConfig
from verl.workers.engine.base import BaseEngine, EngineRegistry
from verl.workers.engine.utils import cast_floating, plain_section

__all__ = [
    "REPLICATE_BELOW_PARAMS",
    "FSDPEngine",
    "FSDPEngineWithLMHead",
    "FSDPEngineWithValueHead",
    "freeze_vision",
    "fsdp_engine_config",
    "trains_as_plain_replicas",
    "vision_tower",
    "without_engine_ulysses",
]

# Below this many parameters `fsdp_size=-1` replicates the model (fsdp_size=1) instead of sharding
# it: the whole training state (weights, gradients, AdamW moments: 16 bytes per fp32 parameter) is
# then at most 256 MiB per rank, and every per-layer all-gather and reduce-scatter is saved (on the
# CPU example's 1M-parameter model sharding cost more time than the model's own matmuls).
REPLICATE_BELOW_PARAMS = 16_000_000


# Ulysses sequence parallelism of the engines' batch forward, set once per process by `init_parallel`
# (like megatron's parallel state): sp, this rank's group of sp consecutive ranks, and its
# data-parallel group (the ranks at the same place in every sequence-parallel group).
_ULYSSES: dict = {"sp": 1, "sp_group": None, "dp_group": None}


def _ulysses_groups(sp: int) -> dict:
    if sp == 1:
        return {"sp_group": None, "dp_group": None}
    from verl.utils.process_groups import consecutive_rank_group

    key = "engine_config.ulysses_sequence_parallel_size"
    sp_group, sp_rank = consecutive_rank_group(sp, key)
    world = dist.get_world_size()
    dp_group = None
    for place in range(sp):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(place, world, sp)))
        if place == sp_rank:
            dp_group = group
    return {"sp_group": sp_group, "dp_group": dp_group}


def without_engine_ulysses(section) -> FSDPEngineConfig:
    """`section` as an `FSDPEngineConfig` with `ulysses_sequence_parallel_size` 1, for callers that
    split sequences themselves (the PPO role workers' actors and critics, the SFT trainers): the
    engine's own split (its batch API's, `FSDPEngine._setup_ulysses`) must not run as well."""
    config = fsdp_engine_config(section)
    if config.ulysses_sequence_parallel_size == 1:
        return config
    return dataclasses.replace(config, ulysses_sequence_parallel_size=1)


def fsdp_engine_config(section) -> FSDPEngineConfig:
    """A role's `fsdp_config` section as the typed `FSDPEngineConfig`, built once where the model is.

    Keys the section leaves out take the class's (upstream's) defaults, e.g. `dtype=bfloat16`; None (a
    role without the section) is all defaults. An already-built config is returned as is.
    """
    if isinstance(section, FSDPEngineConfig):
        return section
    return omega_conf_to_dataclass(section if section is not None else {}, FSDPEngineConfig)


def _replicates(fsdp: FSDPEngineConfig, module) -> bool:
    """Whether the FSDP config `fsdp` leaves the layout to us (fsdp_size=-1) and `module` is small."""
    return fsdp.fsdp_size == -1 and sum(p.numel() for p in module.parameters()) < REPLICATE_BELOW_PARAMS


def _auto_replicate(fsdp: FSDPEngineConfig, module) -> FSDPEngineConfig:
    """`fsdp` with fsdp_size=1 when it asks for -1 (all ranks) and `module` is small; else as given."""
    return dataclasses.replace(fsdp, fsdp_size=1) if _replicates(fsdp, module) else fsdp


def trains_as_plain_replicas(fsdp_cfg, module) -> bool:
    """Whether `module` is replicated without FSDP (`verl.workers.dp_training.replicate_over_ranks`).

    That is the case `_auto_replicate` replicates (`_replicates`: fsdp_size=-1 and a small model),
    as long as FSDP2 would not change how it computes: no FSDP CPU offload and no mixed-precision
    cast (the parameter dtype of `fsdp_config.mixed_precision` or `fsdp_config.dtype` is the
    model's own). A replicated model under FSDP2 still pays its per-layer hooks, per-layer
    all-reduces and DTensor dispatch on every op: on the CPU example (1M parameters, 2 gloo ranks,
    96 rows per rank) an update took 170 ms under FSDP2 and 125-133 ms as plain replicas.
    """
    from verl.utils.fsdp_utils import get_mixed_precision_policy

    fsdp = fsdp_engine_config(fsdp_cfg)
    if not _replicates(fsdp, module) or fsdp.offload_policy:
        return False
    param_dtype = get_mixed_precision_policy(fsdp.mixed_precision, fsdp.dtype).param_dtype
    return param_dtype is None or all(p.dtype == param_dtype for p in module.parameters())


class FSDPEngine(BaseEngine):
    """An HF model on this rank's device, wrapped with FSDP2 over all ranks of the group (a small
    model in its own dtype: plain replicas instead), with AdamW, the lr schedule and the checkpoint
    manager when built with an `optimizer_config`. `module` is the wrapped model."""

    sp = 1  # Ulysses sequence-parallel size of the batch forward (`_setup_ulysses`)

    value_head = False
    """Whether the model is a value model (an LM body with a one-output token head) instead of an LM."""

    def __init__(
        self,
        model_config,
        engine_config,
        optimizer_config=None,
        checkpoint_config=None,
        tokenizer=None,
        freeze_vision_tower: bool = False,
    ):
        """`freeze_vision_tower`: keep a vision-language model's vision tower out of training (see the
        module docstring); an error for a model without one."""
        from verl.utils.fsdp_utils import apply_fsdp2, load_full_state_from_rank0, to_torch_dtype
        from verl.utils.lora import apply_lora, lora_enabled
        from verl.utils.model import (
            enable_gradient_checkpointing,
            load_causal_lm,
            load_valuehead_model,
            model_dir_with_config,
        )

        for_training = optimizer_config is not None
        fsdp = fsdp_engine_config(engine_config)
        model_config = omega_conf_to_dataclass(model_config, CriticModelConfig if self.value_head else HFModelConfig)
        if fsdp.full_determinism:  # before anything random (a value head's initialisation)
            dev.enable_full_determinism(fsdp.seed)
        # Only rank 0 reads the checkpoint; the other ranks start on the meta device and get its
        # weights by broadcast once wrapped (`load_full_state_from_rank0`).
        from_rank0 = dist.is_initialized() and dist.get_world_size() > 1
        on_meta = from_rank0 and dist.get_rank() > 0
        loader = load_valuehead_model if self.value_head else load_causal_lm
        self.module = loader(
            # the policy's model.hf_config_path: its config.json over the weights of path
            model_dir_with_config(model_config.path, getattr(model_config, "hf_config_path", None)),
            # fsdp_config.model_dtype: the dtype the weights (and so the optimizer's master copy) are held
            # in; mixed_precision / dtype only set what the forward computes in
            torch_dtype=to_torch_dtype(fsdp.model_dtype),
            trust_remote_code=model_config.trust_remote_code,
            override_config=plain_section(model_config.override_config),
            meta_device=on_meta,
        )
        self.sp = self._setup_ulysses(fsdp)
        if for_training and model_config.enable_gradient_checkpointing:
            enable_gradient_checkpointing(self.module)
        if not for_training:
            self.module.requires_grad_(False)
        elif freeze_vision_tower:
            freeze_vision(self.module)
        self.lora = for_training and lora_enabled(model_config)
        if self.lora:
            # with model.lora_adapter_path the adapters start from its weights (a meta-device rank
            # checks their shapes only and receives them with rank 0's broadcast below); a value
            # model's head trains whole beside its adapters
            self.module = apply_lora(
                self.module, model_config, read_adapter_weights=not on_meta, value_head=self.value_head
            )
        full_state = self.module.state_dict() if from_rank0 and not on_meta else None
        if trains_as_plain_replicas(fsdp, self.module):
            from verl.workers.dp_training import replicate_over_ranks

            self.module = replicate_over_ranks(self.module if on_meta else self.module.to(dev.get_device()))
            device = dev.get_device()
        else:
            sharding = _auto_replicate(fsdp, self.module)
            self.module = apply_fsdp2(self.module, sharding)
            # FSDP2's CPU offload keeps the shards on the host
            device = "cpu" if sharding.offload_policy else dev.get_device()
        if from_rank0:
            load_full_state_from_rank0(self.module, full_state, device)
            del full_state
        self.optimizer = None
        self.param_offload = fsdp.param_offload
        self.optimizer_offload = fsdp.optimizer_offload and for_training
        self._offload(optimizer=False)
        if for_training:
            self._build_optimizer(
                optimizer_config, checkpoint_config, _export_processing_class(model_config, tokenizer)
            )

    def _setup_ulysses(self, fsdp) -> int:
        """sp from `ulysses_sequence_parallel_size`: its groups (`init_parallel`, when the caller has not
        formed them), the model checked for it (sdpa attention, heads divisible by sp, text only) and
        the attention patch installed. The PPO role workers split sequences in their actors instead."""
        sp = int(fsdp.ulysses_sequence_parallel_size or 1)
        if sp == 1:
            return 1
        from verl.utils import ulysses
        from verl.utils.vision import is_vision_language_config

        key = "engine_config.ulysses_sequence_parallel_size"
        config = self.module.config
        if is_vision_language_config(config):
            raise NotImplementedError(
                f"{key}={sp} with a vision-language model: the Ulysses sequence-parallel forward does not split "
                "image features across ranks (the PPO actor refuses it too); use 1 (use_dynamic_bsz bounds each "
                "micro-batch's tokens instead)"
            )
        ulysses.check_attention(config, sp, key)
        ulysses.check_heads_divisible(config, sp)
        if _ULYSSES["sp"] != sp:
            type(self).init_parallel(fsdp)
        ulysses.patch_sdpa_attention()
        return sp

    def _build_optimizer(self, optimizer_config, checkpoint_config, tokenizer) -> None:
        from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
        from verl.utils.optim import build_lr_scheduler, build_optimizer

        self.optimizer_config = optimizer_config
        # with LoRA only the adapters require gradients: AdamW state for them alone
        self.optimizer = build_optimizer([p for p in self.module.parameters() if p.requires_grad], optimizer_config)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, optimizer_config)
        self.checkpoint_manager = FSDPCheckpointManager(
            model=self.module,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            processing_class=tokenizer,
            checkpoint_config=checkpoint_config,
        )

    @classmethod
    def init_parallel(cls, engine_config) -> int:
        """FSDP shards the model over every rank; with `ulysses_sequence_parallel_size` sp > 1 each
        block of sp consecutive ranks is one sequence-parallel group holding the same rows (see
        `_ULYSSES`), so world / sp ranks hold different data. Returns that number."""
        sp = int(fsdp_engine_config(engine_config).ulysses_sequence_parallel_size or 1)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if sp != _ULYSSES["sp"]:
            _ULYSSES.update(sp=sp, **_ulysses_groups(sp))
        return world // sp

    @staticmethod
    def data_parallel_rank() -> int:
        return (dist.get_rank() if dist.is_initialized() else 0) // _ULYSSES["sp"]

    @staticmethod
    def is_mp_src_rank_with_outputs() -> bool:
        """The first rank of each sequence-parallel group reports its rows (every rank without one)."""
        return (dist.get_rank() if dist.is_initialized() else 0) % _ULYSSES["sp"] == 0

    def get_data_parallel_group(self):
        """The ranks holding different rows: with Ulysses, those at the same place in their groups."""
        return _ULYSSES["dp_group"] if self.sp > 1 else None

    def _token_budget(self, max_tokens: int) -> int:
        return max_tokens * self.sp  # a sequence-parallel rank holds 1/sp of each micro-batch's tokens

    def _switch_mode(self, training: bool) -> None:
        self.module.train(training)

    def _offload(self, optimizer: bool) -> None:
        from verl.utils.fsdp_utils import offload_fsdp_model_to_cpu, offload_fsdp_optimizer

        if self.param_offload:
            offload_fsdp_model_to_cpu(self.module)
        if optimizer and self.optimizer_offload and self.optimizer is not None:
            offload_fsdp_optimizer(self.optimizer)

    @contextlib.contextmanager
    def on_device(self, optimizer: bool = False):
        from verl.utils.fsdp_utils import load_fsdp_model_to_device, load_fsdp_optimizer

        if self.param_offload:
            load_fsdp_model_to_device(self.module)
        if optimizer and self.optimizer_offload and self.optimizer is not None:
            load_fsdp_optimizer(self.optimizer)
        try:
            yield
        finally:
            self._offload(optimizer)

    def _placed_state(self) -> tuple[list, object]:
        return [self.module], self.optimizer

    def _micro_batch_images(self, micro_batch) -> dict[str, torch.Tensor]:
        """The images of the micro-batch's rows, in order (`rows_multi_modal_kwargs`, the PPO actor's
        checks); a vision-language model's FSDP2 ranks first agree whether they have any."""
        from torch.distributed.fsdp import FSDPModule

        from verl.utils.vision import is_vision_language_config
        from verl.workers.dp_training import rows_multi_modal_kwargs
        from verl.workers.engine.batch_api import multi_modal_rows

        rows = multi_modal_rows(micro_batch)
        positions = micro_batch["position_ids"]
        vision_language = is_vision_language_config(self.hf_config)
        if positions.dim() == 3 and not vision_language:
            raise ValueError(
                f"position_ids of {positions.dim()} dims (M-RoPE) for {type(self.module).__name__}, which is not "
                "a vision-language model; give a text model position ids [B, j]"
            )
        if rows is None:
            return {}
        world = dist.get_world_size() if dist.is_initialized() else 1
        collective = self.get_data_parallel_group() if isinstance(self.module, FSDPModule) and world > 1 else False
        return rows_multi_modal_kwargs(rows, positions, dev.get_device(), self.module, vision_language, collective)

    @functools.cached_property
    def _unsampled_ids(self) -> list[int]:
        """A vision-language model's input-only vision markers (`verl.utils.vision.input_only_token_ids`,
        kept out of its log-probs as the PPO actor keeps them); [] for a text model."""
        from verl.utils.vision import input_only_token_ids

        return input_only_token_ids(self.hf_config)

    def _packed_forward(
        self,
        input_ids,
        position_ids,
        temperature: float,
        calculate_entropy: bool,
        use_fused_kernels: bool,
        multi_modal_inputs: dict | None = None,
    ) -> dict[str, torch.Tensor]:
        from verl.utils.remove_padding import packed_model_inputs
        from verl.utils.torch_functional import entropy_from_logits_with_chunking, logprobs_from_logits
        from verl.utils.vision import mask_input_only_logits

        if self.sp > 1:  # a vision-language model is refused with sp > 1 (`_setup_ulysses`)
            return self._ulysses_packed_forward(input_ids, position_ids, temperature, calculate_entropy)
        inputs = {**packed_model_inputs(self.module, input_ids, position_ids), **(multi_modal_inputs or {})}
        if self.value_head:
            return {"values": self.module(**inputs, use_cache=False).logits[0, :, 0]}
        labels = torch.roll(input_ids, shifts=-1, dims=-1)  # position t predicts token t + 1
        if use_fused_kernels:
            from verl.utils.experimental.torch_functional import fused_lm_head
            from verl.utils.hf_forward import hf_model

            masked = self._unsampled_ids or None
            with fused_lm_head(
                hf_model(self.module), labels, temperature, with_entropy_grad=calculate_entropy, masked_ids=masked
            ):
                fused = self.module(**inputs, use_cache=False).logits[0]
            out = {"log_probs": fused[:, 0]}
            if calculate_entropy:
                out["entropy"] = fused[:, 1]
            return out
        logits = self.module(**inputs, use_cache=False).logits[0]
        logits = mask_input_only_logits(logits, self._unsampled_ids, temperature)
        if temperature != 1.0:
            logits = logits / temperature
        out = {"log_probs": logprobs_from_logits(logits, labels[0])}
        if calculate_entropy:
            out["entropy"] = entropy_from_logits_with_chunking(logits)
        return out

    def _ulysses_packed_forward(self, input_ids, position_ids, temperature: float, calculate_entropy: bool):
        """`_packed_forward` with the packed row split over the sequence-parallel group (attention
        trades the split for a head split, `verl.utils.ulysses`): each rank runs T/sp tokens and the
        per-token outputs are gathered whole. The gradients are scaled by sp, as the PPO actor's,
        since FSDP averages them over all dp x sp ranks. The log-probs come from the logits (the
        fused head's values are the same), so `use_fused_kernels` changes nothing here."""
        from verl.utils import ulysses
        from verl.utils.torch_functional import entropy_from_logits_with_chunking

        group = _ULYSSES["sp_group"]
        if self.value_head:
            output, pad = ulysses.forward_slice(self.module, input_ids, position_ids, group)
            return {"values": ulysses.gather_and_unpad(output.logits[0, :, 0], 0, pad, group, self.sp)}
        stats = {"entropy": entropy_from_logits_with_chunking} if calculate_entropy else {}
        log_probs, values = ulysses.packed_forward(
            self.module, input_ids, position_ids, group, temperature, stats, grad_scale=self.sp
        )
        return {"log_probs": log_probs, **values}

    @property
    def hf_config(self):
        return getattr(self.module, "config", None)

    def iter_hf_params(self, dtype: torch.dtype | None = None):
        """With LoRA, the merged weights `W + scaling * B @ A` under plain HF names. `dtype` casts
        each shard before its all-gather, or, with LoRA, each merged weight (the merge itself runs
        in at least float32)."""
        from verl.utils.fsdp_utils import iter_full_params

        if not self.lora:
            return iter_full_params(self.module, dtype=dtype)
        from verl.utils.lora import lora_scalings, merge_lora_state

        merged = merge_lora_state(iter_full_params(self.module), lora_scalings(self.module))
        return merged if dtype is None else cast_floating(merged, dtype)

    def disable_adapter(self):
        return self.module.disable_adapter() if self.lora else contextlib.nullcontext()


# a processor's own files beside the tokenizer's (transformers 4 and 5 layouts)
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "chat_template.json",
    "chat_template.jinja",
)


class _TokenizerWithProcessorFiles:
    """The `processing_class` a vision-language model's checkpoint saves to `huggingface/`: the tokenizer
    (saved as for a text model), then the model directory's processor files copied byte for byte.
    Copied, not re-saved through the processor class: the image-only processor this machine may load
    (`verl.utils.vision`) would write its own class name, which other machines' transformers do not know."""

    def __init__(self, tokenizer, source_dir: str):
        self.tokenizer = tokenizer
        self.source_dir = source_dir

    def save_pretrained(self, directory: str) -> None:
        import os
        import shutil

        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(directory)
        for name in PROCESSOR_FILES:
            source = os.path.join(self.source_dir, name)
            if os.path.isfile(source):
                shutil.copyfile(source, os.path.join(directory, name))


def _export_processing_class(model_config, tokenizer):
    """What a checkpoint's `huggingface/` folder saves beside the config: the tokenizer, and for a
    vision-language model also its processor files (`_TokenizerWithProcessorFiles`), so the exported
    directory loads with `verl.utils.hf_processor` as the original does."""
    from verl.utils.model import load_model_config, model_dir_with_config
    from verl.utils.vision import is_vision_language_config

    path = getattr(model_config, "path", None)
    if path is None:
        return tokenizer
    directory = model_dir_with_config(path, getattr(model_config, "hf_config_path", None))
    if not is_vision_language_config(load_model_config(directory, model_config.trust_remote_code)):
        return tokenizer
    return _TokenizerWithProcessorFiles(tokenizer, getattr(model_config, "tokenizer_path", None) or directory)


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The vision tower of an HF vision-language model (`model.visual` in transformers 5's Qwen2-VL family,
    `visual` in older layouts), or None for a model without one."""
    inner = getattr(model, "model", None)
    tower = getattr(inner, "visual", None) if inner is not None else None
    tower = tower if tower is not None else getattr(model, "visual", None)
    return tower if isinstance(tower, torch.nn.Module) else None


def freeze_vision(model: torch.nn.Module) -> None:
    """Stop the vision tower of `model` from training (`requires_grad=False` on its parameters)."""
    tower = vision_tower(model)
    if tower is None:
        raise ValueError(
            f"actor.freeze_vision_tower=true, but {type(model).__name__} has no vision tower (`model.visual`): it is "
            "not a vision-language model; set actor_rollout_ref.actor.freeze_vision_tower=false"
        )
    tower.requires_grad_(False)


@EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"])
class FSDPEngineWithLMHead(FSDPEngine):
    """A causal LM (actor, reference policy) on FSDP2."""

    value_head = False


@EngineRegistry.register(model_type="value_model", backend=["fsdp", "fsdp2"])
class FSDPEngineWithValueHead(FSDPEngine):
    """A value model (critic) on FSDP2: the LM body with a one-output token head."""

    value_head = True
