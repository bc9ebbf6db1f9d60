"""Typed reward-model config, with upstream verl's names and defaults: `RewardModelConfig` (the
`reward_model` section, reward_model/*.yaml) and `SandboxFusionConfig` (its `sandbox_fusion` section).

Each field carries its runtime default (the YAML holds the same value) and the `doc(...)` metadata the
validator and docgen read; the driver (`verl.trainer.ppo.reward`) and the reward-model workers
(`verl.workers.reward_model_worker.RewardModelWorker`) each build the section once (`omega_conf_to_dataclass`)
and read it by attribute.

Where this differs from upstream's classes, deliberately:
- upstream's `RewardModelConfig` types `model` as `HFModelConfig` and `rollout` as `RolloutConfig` (its
  reward loop serves every reward model through a rollout engine). Here a discriminative reward model is a
  sequence classifier whose forward runs in FSDP/Megatron workers, so `model` is `RewardModelModelConfig`
  (path, tokenizer handling, sharding), and `rollout` (`RewardModelRolloutConfig`) is read only for a
  generative reward model served to the custom reward function (verl/experimental/reward_loop/reward_model.py);
- the section also holds the keys of upstream's reward_model.yaml that its class leaves to the YAML
  (strategy, micro-batch sizes, max_length, ...) and two of ours: `reward_kwargs` (options of the reward
  manager) and `overlong_buffer` (DAPO's overlong penalty);
- upstream warns that `reward_model.reward_manager` is deprecated in favour of `reward_manager.name`;
  here `reward_manager.name` follows it through the YAML (`${oc.select:reward_model.reward_manager,naive}`),
  so the key stays a plain, supported spelling and no warning is logged.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl.base_config import BaseConfig
from verl.utils.profiler.config import ProfilerConfig
from verl.workers.config._fields import (
    _SPEED,
    DEPRECATED,
    ENGINE_DTYPES,
    IGNORED,
    MODEL_DTYPES,
    REWARD_MANAGERS,
    STRATEGIES,
    STRATEGIES_NOT_IN_THIS_BUILD,
    UNSUPPORTED,
    doc,
)
from verl.workers.config.engine import McoreEngineConfig

__all__ = ["RewardModelConfig", "SandboxFusionConfig"]


@dataclass
class SandboxFusionConfig(BaseConfig):
    """SandboxFusion code-execution service for the built-in scorer's code data sources."""

    url: str | None = doc(
        "The service's run_code URL; null: code runs in the local sandbox. Used by the built-in scorer "
        "(not by custom_reward_function).",
        default=None,
    )
    max_concurrent: int = doc("Requests in flight at once, per scoring process.", default=64)
    memory_limit_mb: int = doc("Memory limit per execution.", default=1024)

    def __post_init__(self):
        for key in ("max_concurrent", "memory_limit_mb"):
            if getattr(self, key) < 1:
                raise ValueError(f"reward_model.sandbox_fusion.{key}={getattr(self, key)} must be a positive integer")


_WHOLE = f"{_SPEED}: the FSDP reward-model worker holds the whole model on every rank (no sharding, no offload)."
_COMPUTE_DTYPE = (
    "Not implemented: the FSDP reward model computes in bfloat16 on GPU (upstream's default), float32 on CPU."
)


@dataclass
class RewardModelFSDPConfig(BaseConfig):
    """FSDP sharding of a reward model (forward only). Upstream shards its reward model with FSDP; here
    each rank of the FSDP reward-model worker holds the whole model, so the sharding and offload keys
    would change nothing but memory; a compute dtype other than its own is refused."""

    wrap_policy: dict = doc(
        f"Auto-wrap policy, e.g. {{min_num_params: 0}}. {_WHOLE}",
        status=IGNORED,
        default_factory=lambda: {"min_num_params": 0},
    )
    param_offload: bool = doc(f"Keep parameters on CPU between uses. {_WHOLE}", status=IGNORED, default=False)
    reshard_after_forward: bool | int = doc(
        f"Free gathered parameters after forward. {_WHOLE}", status=IGNORED, default=True
    )
    fsdp_size: int = doc(f"Ranks per FSDP shard group (-1: all ranks). {_WHOLE}", status=IGNORED, default=-1)
    forward_prefetch: bool = doc(
        f"FSDP1's explicit forward prefetch (upstream passes it to FSDP1 only). {_SPEED}.",
        status=IGNORED,
        default=False,
    )
    model_dtype: str | None = doc(
        "Dtype the weights are loaded in. Upstream's reward-model worker does not read it either: the reward model "
        "is loaded in bfloat16 on GPU (float32 on CPU).",
        choices=MODEL_DTYPES,
        status=IGNORED,
        optional=True,
        default=None,
    )
    dtype: str | None = doc(
        f"Compute dtype (as the actor's fsdp_config.dtype). {_COMPUTE_DTYPE}",
        choices=ENGINE_DTYPES,
        status=UNSUPPORTED,
        neutral=None,
        optional=True,
        default=None,
    )
    mixed_precision: dict | None = doc(
        f"{{param_dtype, reduce_dtype}}. {_COMPUTE_DTYPE}",
        status=UNSUPPORTED,
        neutral=None,
        optional=True,
        default=None,
    )


@dataclass
class RewardModelModelConfig(BaseConfig):
    """A learned reward model (sequence classifier)."""

    input_tokenizer: str | None = doc(
        "Policy tokenizer, to decode responses and re-render them with the reward model's chat template when "
        "the two tokenizers differ (vocabulary or template); null, or the same tokenizer: the policy's ids are used.",
        default=None,
    )
    path: str | None = doc("HF-format reward-model directory.", default="~/models/FsfairX-LLaMA3-RM-v0.1")
    external_lib: str | None = doc("Python module imported before loading the model.", default=None)
    trust_remote_code: bool = doc("Allow the model repository's own Python code to run.", default=False)
    override_config: dict = doc(
        "Values overriding the reward model's HF config before its weights load (as the policy's "
        "model.override_config; e.g. {attention_dropout: 0.0}).",
        default_factory=dict,
    )
    use_shm: bool = doc("Copy the model to shared memory before loading.", status=IGNORED, optional=True, default=False)
    use_remove_padding: bool = doc(
        "FSDP: score packed rows without padding (each row's score at its last token, as the padded forward "
        "pools); needed by ulysses_sequence_parallel_size > 1.",
        optional=True,
        default=False,
    )
    use_fused_kernels: bool = doc("Fused kernels.", status=IGNORED, optional=True, default=False)
    fsdp_config: RewardModelFSDPConfig = doc(
        "Sharding and offload.", optional=True, default_factory=RewardModelFSDPConfig
    )


@dataclass
class RewardModelRolloutConfig(BaseConfig):
    """The engine serving a generative reward model to the reward function (upstream's reward loop:
    `reward_model.enable` with `custom_reward_function.path`, verl/experimental/reward_loop/reward_model.py).
    A discriminative reward model (no custom function) runs in reward-model workers and reads none of it."""

    name: str | None = doc(
        "Engine serving the generative reward model: hf (built in), vllm or sglang. Required when "
        "reward_model.enable is set together with custom_reward_function.path.",
        unset_ok=True,
        default=None,
    )
    dtype: str = doc("Engine dtype.", default="bfloat16")
    gpu_memory_utilization: float = doc("Device memory fraction of each replica's engine.", default=0.5)
    enforce_eager: bool = doc("No CUDA graphs (vLLM; the built-in engine's switch is engine_kwargs.hf).", default=True)
    cudagraph_capture_sizes: list[int] | None = doc("CUDA-graph batch sizes (vLLM).", default=None)
    free_cache_engine: bool = doc(
        "Free the KV cache between uses. Not read: the reward model's engines stay loaded for the run.",
        status=IGNORED,
        default=True,
    )
    data_parallel_size: int = doc(
        "Data-parallel ranks inside one engine; must be 1 (more replicas come from the workers / tp).", default=1
    )
    expert_parallel_size: int = doc("Expert-parallel ranks inside one engine; must be 1.", default=1)
    tensor_model_parallel_size: int = doc(
        "Devices per replica; replicas = the workers the model is served on (reward_model.n_gpus_per_node x "
        "nnodes with enable_resource_pool, else the trainer's) / this. The built-in engine needs 1.",
        default=2,
    )
    max_num_batched_tokens: int = doc("Prompt tokens of one prefill forward.", default=8192)
    max_model_len: int | None = doc("Context length (vLLM).", default=None)
    max_num_seqs: int = doc("Sequences generated at once.", default=1024)
    load_format: str = doc("Weight-loading format (vLLM).", default="auto")
    engine_kwargs: dict = doc("Extra engine arguments (engine_kwargs.hf / .vllm / .sglang).", default_factory=dict)
    limit_images: int | None = doc(
        "Images per prompt. Not read: the servers take text and token ids only.", status=IGNORED, default=None
    )
    enable_chunked_prefill: bool = doc("Chunked prefill (vLLM).", default=True)
    enable_prefix_caching: bool = doc("Prefix caching (vLLM).", default=True)
    disable_log_stats: bool = doc("Silence engine statistics (vLLM).", default=True)
    skip_tokenizer_init: bool = doc(
        "Start without the tokenizer. Not read: the servers always load it (they decode text).",
        status=IGNORED,
        default=False,
    )
    prompt_length: int = doc(
        "Prompt tokens of a judge request. Not read: a request may span the model's context "
        "(max_position_embeddings) and names its own max_new_tokens.",
        status=IGNORED,
        default=2048,
    )
    response_length: int = doc(
        "Tokens of a judge's answer. Not read: each request names its own max_new_tokens.",
        status=IGNORED,
        default=2048,
    )


@dataclass
class OverlongBufferConfig(BaseConfig):
    """DAPO soft overlong punishment: a linear penalty over the last `len` tokens of the budget."""

    enable: bool = doc("Penalise responses that run into the buffer.", default=False)
    len: int = doc("Buffer length in tokens at the end of max_response_length.", default=0)
    penalty_factor: float = doc("Penalty at the very end of the budget.", default=0.0)
    log: bool = doc("Log the penalty as a metric.", default=False)


@dataclass
class RewardModelConfig(BaseConfig):
    """Reward computation: the reward manager's options, and optionally a learned reward model."""

    enable: bool = doc(
        "Score responses with a learned reward model (otherwise rule-based rewards only).", default=False
    )
    enable_resource_pool: bool = doc(
        "Run the reward model in its own pool of workers (reward_model.nnodes x n_gpus_per_node), not colocated.",
        default=False,
    )
    n_gpus_per_node: int = doc("Workers per node of that pool (with enable_resource_pool).", default=0)
    nnodes: int = doc("Nodes of that pool (with enable_resource_pool).", default=0)
    strategy: str = doc(
        "Backend of the reward model.", choices=STRATEGIES, hardware_values=STRATEGIES_NOT_IN_THIS_BUILD, default="fsdp"
    )
    model: RewardModelModelConfig = doc("The reward model.", default_factory=RewardModelModelConfig)
    micro_batch_size: int | None = doc(
        "Global micro-batch.", status=DEPRECATED, replacement="use micro_batch_size_per_gpu", default=None
    )
    micro_batch_size_per_gpu: int | None = doc("Sequences per reward-model forward pass on one rank.", default=None)
    max_length: int | None = doc(
        "Maximum sequence length fed to the reward model: a longer row keeps its last max_length tokens (the "
        "response's end survives, the prompt's start goes); null: no limit.",
        default=None,
    )
    use_dynamic_bsz: bool = doc(
        "Pack micro-batches by token count (a speed knob; the reward model runs micro_batch_size_per_gpu rows).",
        status=IGNORED,
        default=False,
    )
    forward_max_token_len_per_gpu: int = doc(
        "Token budget of one packed forward micro-batch.", status=IGNORED, default=32768
    )
    reward_manager: str | None = doc(
        "Turns scores into token-level rewards (reward_manager.name follows it).",
        choices=REWARD_MANAGERS,
        default="naive",
    )
    reward_loop_source: str = doc(
        "Where the reward loop class comes from: register (the reward manager reward_manager names) or importlib "
        "(reward_loop_class_name of the file reward_loop_module_path: upstream's reward-loop interface, an "
        "`async run_single(data)` per sample, run as the driver's reward manager; not with reward_model.enable).",
        choices=("register", "importlib"),
        default="register",
    )
    reward_loop_module_path: str | None = doc(
        "Python file of the custom reward loop class (reward_loop_source=importlib).", default=None
    )
    reward_loop_class_name: str | None = doc(
        "Name of the custom reward loop class in that file (reward_loop_source=importlib).", default=None
    )
    launch_reward_fn_async: bool = doc(
        "Upstream computes rule rewards in a background Ray task during the log-prob pass; here the driver computes "
        f"them before it. {_SPEED}.",
        status=IGNORED,
        default=False,
    )
    sandbox_fusion: SandboxFusionConfig = doc("Code-execution sandbox.", default_factory=SandboxFusionConfig)
    profiler: ProfilerConfig = doc("Profiling of the reward model.", default_factory=ProfilerConfig)
    ulysses_sequence_parallel_size: int = doc(
        "Ulysses sequence-parallel group size of the FSDP reward model: > 1 splits each packed sequence across this "
        "many ranks (needs model.use_remove_padding; see docs/sequence_parallel.md).",
        optional=True,
        default=1,
    )
    megatron: McoreEngineConfig = doc(
        "Megatron-core parallelism of the reward model (strategy megatron; a layout other than the actor's runs "
        "in worker processes of its own).",
        optional=True,
        default_factory=McoreEngineConfig,
    )
    nccl_timeout: int = doc("Megatron: seconds a collective may wait.", optional=True, default=600)
    load_weight: bool = doc(
        "Megatron: start from the weights at model.path; false: megatron's random initialisation (seeded by "
        "megatron.seed), no weights read. Read with strategy=megatron only.",
        optional=True,
        default=True,
    )
    use_reward_loop: bool = doc(
        "Upstream computes rewards in its reward loop (true) or in the driver (false); the rewards are the same. "
        "Here rule rewards are computed by the driver's reward manager and a reward model runs in the actor's "
        "workers either way.",
        optional=True,
        default=True,
    )
    num_workers: int = doc(f"Reward-loop worker processes. {_SPEED}.", status=IGNORED, optional=True, default=1)
    rollout: RewardModelRolloutConfig = doc(
        "The reward model's serving engine (upstream's reward loop).",
        optional=True,
        default_factory=RewardModelRolloutConfig,
    )
    reward_kwargs: dict = doc("Ours. Extra keyword arguments of the reward manager.", default_factory=dict)
    overlong_buffer: OverlongBufferConfig = doc(
        "Ours. DAPO overlong penalty (used by reward_manager=dapo).", default_factory=OverlongBufferConfig
    )
    # upstream's rate-limited reward manager reads these from this section; its YAML does not list them
    max_concurrent: int = doc("reward_manager=rate_limited: reward calls in flight at once.", optional=True, default=1)
    max_rpm: int | None = doc(
        "reward_manager=rate_limited: requests per minute (null: unlimited).", optional=True, default=None
    )
    max_tpm: int | None = doc(
        "reward_manager=rate_limited: tokens per minute, each request counted as estimated_tokens_per_request "
        "(null: unlimited).",
        optional=True,
        default=None,
    )
    estimated_tokens_per_request: int = doc(
        "reward_manager=rate_limited: tokens one request is charged against max_tpm.", optional=True, default=2000
    )
    timeout: float = doc(
        "reward_manager=rate_limited: seconds a reward call may take; a later one scores 0 and is flagged.",
        optional=True,
        default=300.0,
    )

    def __post_init__(self):
        where = "reward_model"
        if isinstance(self.max_concurrent, bool) or not isinstance(self.max_concurrent, int) or self.max_concurrent < 1:
            raise ValueError(
                f"{where}.max_concurrent={self.max_concurrent!r} must be a positive integer (reward calls in flight)"
            )
        for key in ("max_rpm", "max_tpm"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ValueError(f"{where}.{key}={value!r} must be positive, or null for no limit")
        for key in ("timeout", "estimated_tokens_per_request"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{where}.{key}={getattr(self, key)!r} must be positive")
