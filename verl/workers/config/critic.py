"""Typed critic config, with upstream verl's names and defaults: `CriticConfig` (the keys every engine
reads), `FSDPCriticConfig` (critic/dp_critic.yaml's `_target_`) and `McoreCriticConfig`
(critic/megatron_critic.yaml's), and the value model's `CriticModelConfig`.

`CriticModelConfig` holds the value model's keys of every engine (upstream splits them: a Megatron
critic's model is its `BaseModelConfig`, an FSDP critic's is `FSDPCriticModelCfg`). `FSDPCriticModelCfg`
is upstream's name for an FSDP critic's model, so an upstream config whose `critic.model._target_` names
it builds; it adds no keys, since `CriticModelConfig` already holds the FSDP ones.

As for the actor, the schema declares `critic` by the base class and the YAML's `_target_` picks the
engine's subclass, whose extra keys (an FSDP critic's `grad_clip`, a Megatron critic's `megatron`)
the section is checked against and built with. Each field carries its runtime default (the YAML holds
the same value) and the `doc(...)` metadata the validator and docgen read.
"""

from __future__ import annotations

import collections.abc
import dataclasses
from dataclasses import dataclass

from verl.base_config import BaseConfig
from verl.utils.profiler.config import ProfilerConfig
from verl.workers.config._fields import (
    DEPRECATED,
    IGNORED,
    LOSS_AGG_MODES,
    STRATEGIES,
    STRATEGIES_NOT_IN_THIS_BUILD,
    UNSUPPORTED,
    doc,
)
from verl.workers.config.checkpoint import CheckpointConfig, McoreCheckpointConfig
from verl.workers.config.engine import FSDPEngineConfig, McoreEngineConfig
from verl.workers.config.model import MegatronCriticLoRAConfig, MtpConfig, TiledMLPConfig
from verl.workers.config.optimizer import FSDPOptimizerConfig, McoreOptimizerConfig, OptimizerConfig

__all__ = [
    "CriticConfig",
    "CriticModelConfig",
    "CriticMtpConfig",
    "FSDPCriticConfig",
    "FSDPCriticModelCfg",
    "McoreCriticConfig",
    "merge_legacy_fsdp_config",
]

_NO_LOGITS = "a value model computes no log-probs or entropy, so there is nothing to fuse"


@dataclass
class CriticMtpConfig(MtpConfig):
    """`critic.model.mtp` (upstream v0.9 composes the critic's model from the policy's model group): a value
    model has no token predictions, so its multi-token-prediction layers are never built."""

    enable: bool = doc(
        "Multi-token-prediction layers on the value model, which predicts values, not tokens.",
        status=UNSUPPORTED,
        neutral=False,
        default=False,
    )
    enable_train: bool = doc(
        "Train multi-token-prediction layers of the value model.", status=UNSUPPORTED, neutral=False, default=False
    )
    detach_encoder: bool = doc(
        "Read only with mtp.enable_train, which a critic refuses.", status=IGNORED, default=False
    )
    mtp_loss_scaling_factor: float = doc(
        "Read only with mtp.enable_train, which a critic refuses.", status=IGNORED, default=0.1
    )
    speculative_num_steps: int = doc(
        "Speculative steps; used only by enable_rollout, which is not implemented.", status=IGNORED, default=3
    )
    speculative_eagle_topk: int = doc(
        "EAGLE top-k; used only by enable_rollout, which is not implemented.", status=IGNORED, default=1
    )


@dataclass
class CriticModelConfig(BaseConfig):
    """The value model (a language model with a scalar head)."""

    path: str = doc("HF-format model directory.", default="~/models/deepseek-llm-7b-chat")
    hf_config_path: str | None = doc(
        "Directory (or hub id) whose config.json replaces `path`'s when the value model is built (the weights "
        "stay `path`'s); null: `path`'s own.",
        default=None,
    )
    tokenizer_path: str | None = doc("Tokenizer directory when it differs from `path`; null uses `path`.", default=None)
    use_shm: bool = doc("Copy the model to shared memory before loading.", status=IGNORED, default=False)
    trust_remote_code: bool = doc("Allow the model repository's own Python code to run.", default=False)
    custom_chat_template: str | None = doc(
        "Jinja chat template set on the critic's tokenizer, as upstream; the critic values the token ids the "
        "rollout produced and applies no chat template itself.",
        default=None,
    )
    external_lib: str | None = doc("Python module imported before loading the model.", default=None)
    override_config: dict = doc("Values overriding the model's HF config.", default_factory=lambda: {})
    enable_gradient_checkpointing: bool = doc("Recompute activations in backward.", default=True)
    enable_activation_offload: bool = doc(
        "Keep the activations each layer saves for the backward in host memory (FSDP critic; as the actor's "
        "model.enable_activation_offload).",
        default=False,
    )
    use_remove_padding: bool = doc(
        "Pack sequences without padding (FSDP critic; the values are those of the padded forward).", default=True
    )
    lora_rank: int = doc(
        "LoRA rank r of the critic (peft): > 0 trains low-rank adapters on the target layers and the value "
        "head whole (the base weights stay frozen); 0 trains all weights.",
        default=0,
    )
    lora_alpha: int = doc(
        "LoRA alpha: the adapters' update is scaled by lora_alpha / lora_rank (with lora_rank > 0).",
        default=16,
    )
    target_modules: str | list[str] = doc(
        "Layers that get adapters (with lora_rank > 0): `all-linear` (every linear layer but the value head) or a "
        "list of module names, e.g. [q_proj,k_proj,v_proj,o_proj].",
        default="all-linear",
    )
    exclude_modules: list[str] | None = doc(
        "Layers that get no adapter (with lora_rank > 0), a list of module names (the value head is always left "
        "out); null: none.",
        default=None,
    )
    lora_adapter_path: str | None = doc(
        "A trained LoRA adapter for the value model to start from; the critic's adapters start fresh here.",
        status=UNSUPPORTED,
        neutral=None,
        default=None,
    )
    use_liger: bool = doc("Use Liger kernels (GPU only; a speed knob).", status=IGNORED, default=False)
    use_fused_kernels: bool = doc(f"Fused log-prob/entropy kernels: {_NO_LOGITS}.", status=IGNORED, default=False)
    fused_kernel_options: dict = doc(
        f"Options of the fused kernels: {_NO_LOGITS}.",
        status=IGNORED,
        default_factory=lambda: {"impl_backend": "torch"},
    )
    tiled_mlp: TiledMLPConfig = doc("Tiled MLP.", default_factory=TiledMLPConfig)
    mtp: CriticMtpConfig = doc("Multi-token prediction (none on a value model).", default_factory=CriticMtpConfig)
    lora: MegatronCriticLoRAConfig = doc(
        "LoRA of a Megatron critic (an FSDP critic's is lora_rank).", default_factory=MegatronCriticLoRAConfig
    )
    fsdp_config: FSDPEngineConfig = doc(
        "Upstream's spelling of critic.fsdp before v0.9 (FSDP composition): a key set here to a value other than "
        "its default is merged into critic.fsdp; the same key set in both to different values is an error.",
        status=DEPRECATED,
        replacement="set critic.fsdp.<key>",
        optional=True,
        default_factory=FSDPEngineConfig,
    )

    def __post_init__(self):
        if self.lora_rank < 0:
            raise ValueError(
                f"critic.model.lora_rank={self.lora_rank} must be 0 (train all weights) or a positive LoRA rank"
            )
        if self.lora_rank == 0:
            return
        if self.lora_alpha <= 0:
            raise ValueError(
                f"critic.model.lora_alpha={self.lora_alpha} must be positive: the adapters' update is scaled by "
                "lora_alpha / lora_rank (16 or 2 x lora_rank are usual)"
            )
        if not self.target_modules:
            raise ValueError(
                "critic.model.target_modules is empty, so LoRA would adapt nothing; use all-linear or a list of "
                "linear layer names"
            )


@dataclass
class FSDPCriticModelCfg(CriticModelConfig):
    """The value model of a critic trained with FSDP2 (upstream's name; the keys of `CriticModelConfig`)."""


@dataclass
class CriticConfig(BaseConfig):
    """Value function for GAE: model, optimizer, PPO value loss."""

    rollout_n: int = doc("Samples per prompt (follows actor_rollout_ref.rollout.n, which it must equal).", default=1)
    strategy: str = doc(
        "Training backend.", choices=STRATEGIES, hardware_values=STRATEGIES_NOT_IN_THIS_BUILD, default="fsdp"
    )
    enable: bool | None = doc("Train a critic; null: only when algorithm.adv_estimator=gae.", default=None)
    optim: OptimizerConfig = doc("Optimizer and schedule.", default_factory=OptimizerConfig)
    model: CriticModelConfig = doc("Value model.", default_factory=CriticModelConfig)
    ppo_mini_batch_size: int = doc("Prompts per optimizer step (follows the actor's).", default=256)
    ppo_micro_batch_size: int | None = doc(
        "Global micro-batch.", status=DEPRECATED, replacement="use ppo_micro_batch_size_per_gpu", default=None
    )
    ppo_micro_batch_size_per_gpu: int | None = doc("Sequences per forward/backward on one rank.", default=None)
    use_dynamic_bsz: bool = doc("Pack micro-batches by token count.", default=False)
    ppo_max_token_len_per_gpu: int = doc("Token budget of one packed training micro-batch.", default=32768)
    forward_max_token_len_per_gpu: int = doc("Token budget of one packed forward micro-batch.", default=32768)
    ppo_epochs: int = doc("Passes over each batch.", default=1)
    shuffle: bool = doc("Shuffle mini-batches between epochs.", default=False)
    data_loader_seed: int | None = doc("Seed of that shuffle (null: 0).", default=42)
    cliprange_value: float = doc("Clip range of the value update around the old values.", default=0.5)
    loss_agg_mode: str = doc("How token losses are averaged.", choices=LOSS_AGG_MODES, default="token-mean")
    loss_scale_factor: float | None = doc(
        "The constant length L of loss_agg_mode=seq-mean-token-sum-norm (follows the actor's); null: the padded "
        "response length.",
        default=None,
    )
    checkpoint: CheckpointConfig = doc("Checkpoint contents.", default_factory=CheckpointConfig)
    profiler: ProfilerConfig = doc("Profiling of the critic's passes.", default_factory=ProfilerConfig)

    def __post_init__(self):
        if self.loss_scale_factor is not None and not self.loss_scale_factor > 0:
            raise ValueError(
                f"critic.loss_scale_factor={self.loss_scale_factor} must be > 0 (the constant length that "
                "seq-mean-token-sum-norm divides by), or null for the padded response length"
            )


@dataclass
class FSDPCriticConfig(CriticConfig):
    """A critic trained with FSDP2 (critic/dp_critic.yaml)."""

    optim: FSDPOptimizerConfig = doc("Optimizer and schedule.", default_factory=FSDPOptimizerConfig)

    forward_micro_batch_size: int | None = doc(
        "Global forward micro-batch.",
        status=DEPRECATED,
        replacement="use forward_micro_batch_size_per_gpu",
        default=None,
    )
    forward_micro_batch_size_per_gpu: int | None = doc(
        "Sequences per value forward pass on one rank (follows ppo_micro_batch_size_per_gpu).",
        default=None,
    )
    ulysses_sequence_parallel_size: int = doc(
        "Ulysses sequence-parallel group size (needs model.use_remove_padding; see docs/sequence_parallel.md).",
        default=1,
    )
    grad_clip: float = doc("FSDP: clip the global gradient norm to this value (see optim.clip_grad).", default=1.0)
    fsdp: FSDPEngineConfig = doc("FSDP engine of the value model.", default_factory=FSDPEngineConfig)

    def __post_init__(self):
        super().__post_init__()
        # the older spelling (critic.model.fsdp_config): its set keys join critic.fsdp, then both name one section
        adopt = merge_legacy_fsdp_config(self.model.fsdp_config, self.fsdp)
        if adopt:
            object.__setattr__(self, "fsdp", dataclasses.replace(self.fsdp, **adopt))
        object.__setattr__(self.model, "fsdp_config", self.fsdp)


@dataclass
class McoreCriticConfig(CriticConfig):
    """A critic trained with Megatron-core (critic/megatron_critic.yaml)."""

    optim: McoreOptimizerConfig = doc("Optimizer and schedule.", default_factory=McoreOptimizerConfig)

    strategy: str = doc(
        "Training backend.", choices=STRATEGIES, hardware_values=STRATEGIES_NOT_IN_THIS_BUILD, default="megatron"
    )
    megatron: McoreEngineConfig = doc(
        "Megatron-core parallelism (strategy megatron).", default_factory=McoreEngineConfig
    )
    nccl_timeout: int = doc("Megatron: seconds a collective may wait.", default=600)
    load_weight: bool = doc(
        "Megatron: start from the weights at model.path (or megatron.dist_checkpointing_path); false: megatron's "
        "random initialisation, seeded by megatron.seed, the value head normal with std init_method_std "
        "(upstream's key until v0.9, kept here).",
        default=True,
    )
    checkpoint: McoreCheckpointConfig = doc("Checkpoint contents.", default_factory=McoreCheckpointConfig)


def _plain(value):
    """A config value as plain data for comparison (sections as dicts without `_target_`)."""
    if isinstance(value, collections.abc.Mapping):
        return {k: _plain(v) for k, v in value.items() if k != "_target_"}
    if isinstance(value, list | tuple) or type(value).__name__ == "ListConfig":
        return [_plain(v) for v in value]
    return value


def merge_legacy_fsdp_config(legacy, current, default=None) -> dict:
    """The keys an FSDP critic's `fsdp` section (`current`, upstream v0.9's spelling) takes from its older
    `model.fsdp_config` (`legacy`): {key: legacy value} for each key set there (differing from `default`,
    FSDPEngineConfig's) while `fsdp` keeps its default. A key set in both to different values is a
    ValueError naming both; a legacy key at its default leaves `fsdp`'s value alone. Works on the typed
    sections and on the raw mappings (a whole sub-section such as wrap_policy counts as one key)."""
    default = FSDPEngineConfig() if default is None else default
    adopt, conflicts = {}, []
    for key in legacy or {}:
        if key == "_target_" or key not in default:
            continue  # an unknown key is the schema check's to report
        value, base = _plain(legacy[key]), _plain(default[key])
        new = _plain(current[key]) if key in current else base
        if value in (base, new):
            continue
        if new == base:
            adopt[key] = legacy[key]
        else:
            conflicts.append(f"critic.model.fsdp_config.{key}={value!r} and critic.fsdp.{key}={new!r}")
    if conflicts:
        raise ValueError(
            f"critic.model.fsdp_config is upstream's older spelling of critic.fsdp, and they disagree: "
            f"{'; '.join(conflicts)}; set only critic.fsdp.<key> (or both to the same value)"
        )
    return adopt
