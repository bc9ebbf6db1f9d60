"""`verl.workers.config.reward`: the typed `reward` section (upstream v0.9's reward/reward.yaml): `RewardConfig` and its parts.

Upstream builds the section as `verl.workers.config.RewardConfig`, its manager as
`verl.workers.config.reward.RewardManagerConfig`, its model as (v0.9's) `verl.workers.config.RewardModelConfig`
and the model's engine as `verl.workers.config.RolloutConfig`; those names are the YAML's `_target_`s and
are this module's classes, the last two accepted as aliases (`TARGET_ALIASES`): in this code base
`verl.workers.config.RewardModelConfig` is the older `reward_model` section (which still holds this
project's own reward-model keys), and the section is read by the driver, after the older spellings were
merged into it (verl/trainer/config/reward_migration.py), through those older sections' classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from verl.base_config import BaseConfig
from verl.workers.config._fields import _SPEED, IGNORED, REWARD_MANAGER_SOURCES, UNSUPPORTED, doc
from verl.workers.config.reward_model import SandboxFusionConfig

__all__ = [
    "ModuleConfig",
    "RewardConfig",
    "RewardManagerConfig",
    "RewardCustomFunctionConfig",
    "RewardDisaggregationConfig",
    "RewardModelSectionConfig",
    "RewardRolloutConfig",
    "RewardManagerConfig",
]


def reward_manager_choices() -> tuple[str, ...]:
    """Registered reward managers (user registrations included)."""
    from verl.workers.reward_manager import REWARD_MANAGER_REGISTRY

    return tuple(REWARD_MANAGER_REGISTRY)


@dataclass
class ModuleConfig(BaseConfig):
    """A reward-manager class in a Python file (with source=importlib)."""

    path: str | None = doc("Python file defining the class.", default=None)
    name: str = doc("Class name inside `path`.", default="custom_reward_manager")


_ENGINE = "Passed to the engine serving a generative reward model, as actor_rollout_ref.rollout's key of that name."
_NOT_SERVED = "Not implemented for the reward model's serving engine"


@dataclass
class RewardCustomFunctionConfig(BaseConfig):
    """A user reward function (older spelling: custom_reward_function)."""

    path: str | None = doc(
        "Python file defining the function; null: verl.utils.reward_score picks the scorer by data_source. "
        "The file runs in the trainer's processes with your permissions.",
        default=None,
    )
    name: str = doc("Function name inside `path`.", default="compute_score")


@dataclass
class RewardManagerConfig(BaseConfig):
    """Which reward manager turns scores into token-level rewards (older spellings: reward_model.reward_manager,
    reward_manager.*, reward_model.reward_loop_*)."""

    source: str = doc(
        "register: the registered manager `name`; importlib: the class module.name of the file module.path.",
        choices=REWARD_MANAGER_SOURCES,
        default="register",
    )
    name: str = doc("Registered reward manager.", choices=reward_manager_choices, default="naive")
    module: ModuleConfig = doc("The class for source=importlib.", default_factory=ModuleConfig)


@dataclass
class RewardDisaggregationConfig(BaseConfig):
    """Prefill/decode disaggregation of the reward model's engine (not implemented here)."""

    enabled: bool = doc(f"{_NOT_SERVED}.", status=UNSUPPORTED, neutral=False, default=False)
    prefill_replicas: int = doc(f"{_NOT_SERVED} (disaggregation).", status=IGNORED, default=1)
    decode_replicas: int = doc(f"{_NOT_SERVED} (disaggregation).", status=IGNORED, default=1)
    decode_tensor_model_parallel_size: int | None = doc(
        f"{_NOT_SERVED} (disaggregation).", status=IGNORED, default=None
    )
    transfer_backend: str = doc(f"{_NOT_SERVED} (disaggregation).", status=IGNORED, default="nixl")
    bootstrap_port: int | None = doc(f"{_NOT_SERVED} (disaggregation).", status=IGNORED, default=None)
    ib_device: str | None = doc(f"{_NOT_SERVED} (disaggregation).", status=IGNORED, default=None)


@dataclass
class RewardRolloutConfig(BaseConfig):
    """The engine serving a generative reward model (reward_model.enable with custom_reward_function.path);
    older spelling: reward_model.rollout.*."""

    TARGET_ALIASES: ClassVar[tuple[str, ...]] = ("verl.workers.config.RolloutConfig",)

    name: str | None = doc(
        "Engine: hf (built in), vllm or sglang. Required with a generative reward model.", unset_ok=True, default=None
    )
    dtype: str = doc(_ENGINE, default="bfloat16")
    gpu_memory_utilization: float = doc(_ENGINE, default=0.5)
    enforce_eager: bool = doc(_ENGINE, default=True)
    cudagraph_capture_sizes: list[int] | None = doc(_ENGINE, default=None)
    free_cache_engine: bool = doc(
        "Not read: the reward model's engines stay loaded for the run.", status=IGNORED, default=True
    )
    data_parallel_size: int = doc("Data-parallel ranks inside one engine; must be 1.", default=1)
    expert_parallel_size: int = doc("Expert-parallel ranks inside one engine; must be 1.", default=1)
    tensor_model_parallel_size: int = doc(
        "Devices per replica (the built-in engine needs 1); replicas = the workers served on / this.", default=2
    )
    pipeline_model_parallel_size: int = doc(_ENGINE, default=1)
    max_num_batched_tokens: int = doc(_ENGINE, default=8192)
    max_model_len: int | None = doc(_ENGINE, default=None)
    max_num_seqs: int = doc(_ENGINE, default=1024)
    load_format: str = doc(_ENGINE, default="auto")
    layered_summon: bool = doc(f"LoRA weight sync of the actor's engine. {_SPEED}.", status=IGNORED, default=False)
    scheduling_policy: str = doc(_ENGINE, default="fcfs")
    full_determinism: bool = doc(f"{_NOT_SERVED}.", status=UNSUPPORTED, neutral=False, default=False)
    seed: int = doc(f"{_NOT_SERVED}: the engine's own seed.", status=UNSUPPORTED, neutral=42, default=42)
    multi_stage_wake_up: bool = doc(_ENGINE, default=False)
    engine_kwargs: dict = doc(_ENGINE, default_factory=dict)
    limit_images: int | None = doc("Not read: the servers take text and token ids only.", status=IGNORED, default=None)
    enable_chunked_prefill: bool = doc(_ENGINE, default=True)
    enable_prefix_caching: bool = doc(_ENGINE, default=True)
    disable_log_stats: bool = doc(_ENGINE, default=True)
    skip_tokenizer_init: bool = doc("Not read: the servers always load the tokenizer.", status=IGNORED, default=False)
    ignore_eos: bool = doc(f"{_ENGINE} Each judge request may name its own.", default=False)
    temperature: float = doc(f"{_ENGINE} Each judge request may name its own.", default=1.0)
    top_k: int = doc(f"{_ENGINE} Each judge request may name its own.", default=-1)
    top_p: float = doc(f"{_ENGINE} Each judge request may name its own.", default=1)
    do_sample: bool = doc(f"{_ENGINE} Each judge request may name its own.", default=True)
    n: int = doc(f"{_ENGINE} Each judge request may name its own.", default=1)
    prompt_length: int = doc("Not read: a request may span the model's context.", status=IGNORED, default=2048)
    response_length: int = doc("Not read: each request names its own max_new_tokens.", status=IGNORED, default=2048)
    quantization: str | None = doc(_ENGINE, default=None)
    quantization_config_file: str | None = doc(_ENGINE, default=None)
    mtp: dict | None = doc(_ENGINE, default=None)
    disaggregation: RewardDisaggregationConfig = doc(
        "Prefill/decode disaggregation.", default_factory=RewardDisaggregationConfig
    )


@dataclass
class RewardModelSectionConfig(BaseConfig):
    """A learned reward model (older spellings: reward_model.enable, .model.path, .rollout, ...)."""

    TARGET_ALIASES: ClassVar[tuple[str, ...]] = ("verl.workers.config.RewardModelConfig",)

    enable: bool = doc("Score responses with a learned reward model.", default=False)
    enable_resource_pool: bool = doc(
        "Run the reward model in its own pool of n_gpus_per_node x nnodes workers.", default=False
    )
    n_gpus_per_node: int = doc("Workers per node of that pool (with enable_resource_pool).", default=8)
    nnodes: int = doc("Nodes of that pool (with enable_resource_pool).", default=0)
    model_path: str | None = doc("HF-format reward-model directory.", default=None)
    rollout: RewardRolloutConfig = doc("Engine of a generative reward model.", default_factory=RewardRolloutConfig)


@dataclass
class RewardConfig(BaseConfig):
    """Where rewards come from (upstream v0.9's `reward` section)."""

    num_workers: int = doc(
        "Reward-loop worker processes scoring a batch (reward_manager remote: its Ray actors).", default=8
    )
    custom_reward_function: RewardCustomFunctionConfig = doc(
        "User reward function.", default_factory=RewardCustomFunctionConfig
    )
    reward_manager: RewardManagerConfig = doc("Rule-based reward manager.", default_factory=RewardManagerConfig)
    reward_model: RewardModelSectionConfig = doc("Learned reward model.", default_factory=RewardModelSectionConfig)
    sandbox_fusion: SandboxFusionConfig = doc("Code-execution sandbox.", default_factory=SandboxFusionConfig)
    reward_kwargs: dict = doc(
        "Keyword arguments of the reward manager (e.g. DAPO's overlong_buffer_cfg, max_resp_len); added with "
        "+reward.reward_kwargs.<key>=... (older spelling: reward_model.reward_kwargs).",
        optional=True,
        default_factory=dict,
    )
