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

from dataclasses import dataclass

from verl.base_config import BaseConfig
from verl.utils.profiler.config import ProfilerConfig
from verl.workers.config._fields import (
    DEPRECATED,
    IGNORED,
    LOSS_AGG_MODES,
    STRATEGIES,
    STRATEGIES_NOT_IN_THIS_BUILD,
    doc,
)
from verl.workers.config.checkpoint import CheckpointConfig
from verl.workers.config.engine import FSDPEngineConfig, McoreEngineConfig
from verl.workers.config.model import MegatronCriticLoRAConfig, TiledMLPConfig
from verl.workers.config.optimizer import FSDPOptimizerConfig, McoreOptimizerConfig, OptimizerConfig

__all__ = ["CriticConfig", "CriticModelConfig", "FSDPCriticConfig", "FSDPCriticModelCfg", "McoreCriticConfig"]


@dataclass
class CriticModelConfig(BaseConfig):
    """The value model (a language model with a scalar head)."""

    path: str = doc("HF-format model directory.", default="~/models/deepseek-llm-7b-chat")
    tokenizer_path: str | None = doc(
        "Tokenizer directory (follows the policy model).", default="~/models/deepseek-llm-7b-chat"
    )
    override_config: dict = doc("Values overriding the model's HF config.", default_factory=lambda: {})
    external_lib: str | None = doc("Python module imported before loading the model.", default=None)
    trust_remote_code: bool = doc("Allow the model repository's own Python code to run.", default=False)
    use_shm: bool = doc("Copy the model to shared memory before loading.", status=IGNORED, optional=True, default=False)
    enable_gradient_checkpointing: bool = doc("Recompute activations in backward.", optional=True, default=True)
    enable_activation_offload: bool = doc(
        "Keep the activations each layer saves for the backward in host memory (FSDP critic; as the actor's "
        "model.enable_activation_offload).",
        optional=True,
        default=False,
    )
    use_remove_padding: bool = doc("Pack sequences without padding.", optional=True, default=False)
    lora_rank: int = doc(
        "LoRA rank r of the critic (peft): > 0 trains low-rank adapters on the target layers and the value "
        "head whole (the base weights stay frozen); 0 trains all weights.",
        optional=True,
        default=0,
    )
    lora_alpha: int = doc(
        "LoRA alpha: the adapters' update is scaled by lora_alpha / lora_rank (with lora_rank > 0).",
        optional=True,
        default=16,
    )
    target_modules: str | list[str] = doc(
        "Layers that get adapters (with lora_rank > 0): `all-linear` (every linear layer but the value head) or a "
        "list of module names, e.g. [q_proj,k_proj,v_proj,o_proj].",
        optional=True,
        default="all-linear",
    )
    tiled_mlp: TiledMLPConfig = doc("Tiled MLP.", optional=True, default_factory=TiledMLPConfig)
    fsdp_config: FSDPEngineConfig = doc(
        "FSDP engine (strategy fsdp or fsdp2).", optional=True, default_factory=FSDPEngineConfig
    )
    lora: MegatronCriticLoRAConfig = doc(
        "LoRA of a Megatron critic.", optional=True, default_factory=MegatronCriticLoRAConfig
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
    checkpoint: CheckpointConfig = doc("Checkpoint contents.", default_factory=CheckpointConfig)
    profiler: ProfilerConfig = doc("Profiling of the critic's passes.", default_factory=ProfilerConfig)


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
        "random initialisation, seeded by megatron.seed, the value head normal with std init_method_std.",
        default=True,
    )
