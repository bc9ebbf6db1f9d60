"""Typed schema of `ppo_trainer.yaml`: one dataclass per section, one documented field per key.

Design decisions:
- The YAML file holds the defaults (it is what users read and what Hydra composes); the
  dataclasses here hold the *contract*: each key's type, its documentation, its valid choices and
  whether this implementation honours it. Keeping defaults out of the dataclasses means there is
  one source for each fact; a test checks that YAML and schema list exactly the same keys.
- Field metadata is plain data (`doc`, `choices`, `status`, ...) so the validator
  (`validate.py`) and the reference-docs generator (`docgen.py`) read the same table.
- Key names follow upstream verl so its users' scripts run unchanged. Upstream keys we have not
  implemented are either accepted and documented as having no effect (when ignoring them cannot
  change results, e.g. a memory-saving knob of an engine we do not run), or rejected with a
  config error as soon as they leave their neutral value (when ignoring them would silently
  train something else, e.g. LoRA).
- A dataclass marked `OPEN_KEYS = True` also accepts keys it does not list (passed through to a
  third-party API such as `ray.init`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Field status values (see `field_status`).
SUPPORTED = "supported"
IGNORED = "ignored"  # accepted for compatibility with upstream configs; has no effect here
UNSUPPORTED = "unsupported"  # rejected unless it holds its neutral value
DEPRECATED = "deprecated"  # still honoured, with a warning naming the replacement

_NO_NEUTRAL = object()


# Option tables. Each is the one place a reader finds every valid name for a config choice.
# The advantage-estimator names follow upstream's `AdvantageEstimator`; the group-based ones need
# several samples per prompt (rollout.n >= 2) because their baseline is the group's statistics.
def adv_estimator_choices() -> tuple[str, ...]:
    """`algorithm.adv_estimator` names: core_algos' table (user-registered estimators included)."""
    from verl.trainer.ppo.core_algos import ADV_ESTIMATORS

    return tuple(ADV_ESTIMATORS)


def policy_loss_choices() -> tuple[str, ...]:
    """`actor.policy_loss.loss_mode` names: core_algos' table, plus upstream's hyphenated spellings."""
    from verl.trainer.ppo.core_algos import POLICY_LOSSES

    return tuple(POLICY_LOSSES) + tuple(n.replace("_", "-") for n in POLICY_LOSSES if "_" in n and n != "geo_mean")


GROUP_ADV_ESTIMATORS = (
    "grpo",
    "rloo",
    "opo",
    "grpo_passk",
    "gpg",
    "reinforce_plus_plus_baseline",
    "grpo_vectorized",
    "rloo_vectorized",
)
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# "+" suffix: straight-through variant (value from the named estimator, gradient of k2).
KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full", "k1+", "low_var_kl+", "k3+")
ROLLOUT_NAMES = ("hf", "vllm", "sglang")
ROLLOUT_MODES = ("sync", "async")
STRATEGIES = ("fsdp", "fsdp2", "megatron")
LOGGERS = ("console", "file", "mlflow", "tensorboard", "wandb")
RESUME_MODES = ("auto", "disable", "resume_path")


def tool_format_choices() -> tuple[str, ...]:
    """`rollout.multi_turn.format` names: the agent loop's tool-parser table."""
    from verl.experimental.agent_loop.tool_parser import TOOL_PARSERS

    return tuple(TOOL_PARSERS)


def device_choices() -> tuple[str, ...]:
    """Valid `trainer.device` values, owned by verl.utils.device (imported lazily: it imports torch)."""
    from verl.utils.device import _VALID

    return tuple(_VALID)


TRUNCATIONS = ("error", "left", "right", "middle")
LR_SCHEDULES = ("constant", "cosine")
KL_CTRL_TYPES = ("fixed", "adaptive")
REWARD_MANAGERS = ("naive", "batch", "dapo", "prime")
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")
ROLLOUT_DTYPES = ("auto", "bfloat16", "float16", "float32", "bf16", "fp16", "fp32")
MODEL_DTYPES = ("fp32", "bf16", "fp16", "float32", "bfloat16", "float16")
MEGATRON_DTYPES = ("auto", *MODEL_DTYPES)
PF_PPO_METHODS = ("pow", "max_min", "max_random")
REWARD_ON_ERROR = ("raise", "zero")


def doc(
    text: str,
    *,
    choices: tuple | Callable[[], tuple] | None = None,
    status: str = SUPPORTED,
    neutral: Any = _NO_NEUTRAL,
    replacement: str | None = None,
):
    """Declare one config key: its documentation and how the validator treats it.

    choices: valid values (each element is checked when the value is a list), or a function
        returning them (for tables owned by a module too heavy to import here).
    status: SUPPORTED, IGNORED, UNSUPPORTED (needs `neutral`) or DEPRECATED (needs `replacement`).
    neutral: for UNSUPPORTED keys, the only value accepted (the one that switches the feature off).
    """
    if status == UNSUPPORTED and neutral is _NO_NEUTRAL:
        raise TypeError("an unsupported key needs the neutral value it must keep")
    if status == DEPRECATED and not replacement:
        raise TypeError("a deprecated key needs the name of its replacement")
    meta = {"doc": text, "choices": choices, "status": status, "neutral": neutral, "replacement": replacement}
    return dataclasses.field(metadata=meta)


# --------------------------------------------------------------------------------------- data


@dataclass
class ClassRefConfig:
    """A user class loaded from a Python file: `path` to the file, `name` of the class."""

    path: str | None = doc("Python file holding the class; null uses the built-in implementation.")
    name: str | None = doc("Name of the class inside `path`.")


@dataclass
class SamplerConfig:
    """A custom (e.g. curriculum) sampler over the training set."""

    class_path: str | None = doc("Python file or module holding the sampler class; null uses the default sampler.")
    class_name: str | None = doc("Name of the sampler class.")


@dataclass
class DataConfig:
    """Datasets (parquet files with upstream's schema) and batch sizes counted in prompts."""

    tokenizer: str | None = doc("Tokenizer name or path; null uses the policy model's tokenizer.")
    use_shm: bool = doc("Copy data files to shared memory before loading.", status=IGNORED)
    train_files: str | list[str] = doc("Training parquet file(s); local paths (`~` expanded).")
    val_files: str | list[str] = doc("Validation parquet file(s).")
    train_max_samples: int = doc("Use at most this many training rows (-1: all).")
    val_max_samples: int = doc("Use at most this many validation rows (-1: all).")
    prompt_key: str = doc("Column holding the chat-format prompt (list of {role, content}).")
    reward_fn_key: str = doc("Column that selects the rule-based reward function (upstream: data_source).")
    max_prompt_length: int = doc("Prompts are left-padded to this many tokens; longer ones follow `truncation`.")
    max_response_length: int = doc("Maximum number of generated tokens per response.")
    train_batch_size: int = doc("Prompts per training step (each sampled `rollout.n` times).")
    val_batch_size: int | None = doc(
        "Prompts per validation batch; null validates the whole set in one batch.",
        status=DEPRECATED,
        replacement="leave it null: validation runs the whole set at once",
    )
    gen_batch_size: int = doc("Prompts generated per round when `algorithm.filter_groups` refills a batch (DAPO).")
    return_raw_input_ids: bool = doc("Also return prompt ids without the chat template (for a reward model).")
    return_raw_chat: bool = doc("Also return the prompt messages before templating (`raw_prompt`).")
    return_full_prompt: bool = doc("Also return the templated prompt text.")
    shuffle: bool = doc("Shuffle the training set each epoch.")
    seed: int | None = doc("Seed of the training-set shuffle; null means 1.")
    dataloader_num_workers: int = doc("DataLoader worker processes (0 loads in the driver).")
    validation_shuffle: bool = doc("Shuffle the validation set.")
    filter_overlong_prompts: bool = doc("Drop prompts longer than `max_prompt_length` when loading.")
    filter_overlong_prompts_workers: int = doc("Processes used to filter overlong prompts.")
    truncation: str = doc("What to do with prompts over `max_prompt_length`.", choices=TRUNCATIONS)
    image_key: str = doc("Column with images (multi-modal data only).", status=IGNORED)
    video_key: str = doc("Column with videos (multi-modal data only).", status=IGNORED)
    trust_remote_code: bool = doc("Allow the tokenizer's own Python code to run.")
    custom_cls: ClassRefConfig = doc("Custom dataset class replacing the built-in RLHF dataset.")
    return_multi_modal_inputs: bool = doc("Return multi-modal inputs with each sample.", status=IGNORED)
    sampler: SamplerConfig = doc("Custom sampler of the training set.")
    datagen: ClassRefConfig = doc("Dynamic data generator.", status=IGNORED)
    apply_chat_template_kwargs: dict = doc("Extra keyword arguments for `tokenizer.apply_chat_template`.")


# ------------------------------------------------------------------------------ model, actor


@dataclass
class FSDPConfig:
    """FSDP sharding and offload of one model (optimizer keys have no effect for forward-only models)."""

    wrap_policy: dict = doc("Auto-wrap policy, e.g. {min_num_params: 0} or {transformer_layer_cls_to_wrap: [...]}.")
    param_offload: bool = doc("Keep parameters on CPU between uses (saves device memory).")
    optimizer_offload: bool = doc("Keep optimizer state on CPU between updates.")
    offload_policy: bool = doc("FSDP2 CPUOffloadPolicy during training (params, grads and optimizer on CPU).")
    reshard_after_forward: bool | int = doc(
        "FSDP2: free gathered parameters after forward (True, False or a group size)."
    )
    fsdp_size: int = doc(
        "Ranks per FSDP shard group (-1: all ranks, i.e. plain FSDP; a model under 16M parameters is then "
        "replicated instead: as plain per-rank replicas with one gradient all-reduce per step when FSDP2 would "
        "not cast or offload it, else as with 1). 1 replicates the model on every rank under FSDP2 (HSDP)."
    )
    forward_prefetch: bool = doc("Prefetch the next layer's all-gather during forward.")
    model_dtype: str = doc("Dtype the trained (master) weights are kept in.", choices=MODEL_DTYPES)
    mixed_precision: dict | None = doc(
        "{param_dtype, reduce_dtype, buffer_dtype}; null: bf16 compute on GPU, fp32 on CPU."
    )


@dataclass
class MegatronConfig:
    """Megatron-core parallelism of one model (read only when its `strategy` is megatron; docs/megatron.md)."""

    param_offload: bool = doc("Keep parameters on the host between uses (saves device memory; no-op on CPU).")
    grad_offload: bool = doc("Keep gradients on the host between updates.", status=IGNORED)
    optimizer_offload: bool = doc("Keep the Adam moments on the host between updates (no-op on CPU).")
    tensor_model_parallel_size: int = doc("Ranks one layer's weights are split over (attention heads, MLP, vocab).")
    expert_model_parallel_size: int = doc("Expert parallelism (mixture-of-experts).", status=UNSUPPORTED, neutral=1)
    expert_tensor_parallel_size: int | None = doc(
        "Tensor parallelism inside experts.", status=UNSUPPORTED, neutral=None
    )
    pipeline_model_parallel_size: int = doc("Pipeline stages the layers are split into.")
    virtual_pipeline_model_parallel_size: int | None = doc(
        "Interleaved pipeline chunks (virtual stages) per pipeline stage; needs pipeline_model_parallel_size >= 2 "
        "and at least that many micro-batches per rank. null: no interleaving."
    )
    context_parallel_size: int = doc(
        "Ranks one sequence is split over (each holds 2 of its 2 x cp load-balanced chunks; keys and values "
        "are all-gathered in attention). Must divide the world size together with the tensor and pipeline sizes."
    )
    sequence_parallel: bool = doc(
        "Split activations outside attention/MLP along the sequence over the tensor-parallel ranks (memory only, "
        "same results); needs tensor_model_parallel_size > 1 (ignored otherwise). Runs without TransformerEngine or "
        "apex."
    )
    use_distributed_optimizer: bool = doc(
        "Split the Adam state over data-parallel ranks by whole parameters (ZeRO stage 1; memory only, same results)."
    )
    use_dist_checkpointing: bool = doc(
        "Start from a Megatron dist checkpoint (made once with `python -m verl.models.mcore.converter`) instead of "
        "the HF weights: each rank reads only its shards. Not for the reward model."
    )
    dist_checkpointing_path: str | None = doc(
        "That checkpoint's directory (or a verl megatron checkpoint's actor/critic directory)."
    )
    dist_checkpointing_prefix: str = doc("Key prefix inside that checkpoint.")
    seed: int = doc("Seed of Megatron's model-parallel random streams.")
    override_ddp_config: dict = doc("Megatron DistributedDataParallelConfig fields.", status=IGNORED)
    override_transformer_config: dict = doc(
        "TransformerConfig fields set on top of those derived from the HF config (e.g. recompute_granularity)."
    )
    override_mcore_model_config: dict = doc("GPTModel constructor overrides.", status=IGNORED)
    use_mbridge: bool = doc("Convert weights with the mbridge package.", status=UNSUPPORTED, neutral=False)
    forward_only: bool = doc("Build the model for inference only.", status=IGNORED)
    dtype: str = doc(
        "Compute dtype of the Megatron model (mixed precision: parameters, gradients and Adam state stay fp32, "
        "the forward runs under autocast in this dtype; fp16 only for frozen models). auto: bfloat16 on GPU "
        "(upstream's default), float32 on CPU.",
        choices=MEGATRON_DTYPES,
    )


@dataclass
class ModelConfig:
    """The policy model (shared by actor, rollout and reference)."""

    path: str = doc("HF-format model directory (or hub id); `${verl_asset:NAME}` names a bundled model.")
    tokenizer_path: str | None = doc("Tokenizer directory when it differs from `path`; null uses `path`.")
    custom_chat_template: str | None = doc("Jinja chat template replacing the tokenizer's own.")
    use_shm: bool = doc("Copy the model to shared memory before loading.", status=IGNORED)
    external_lib: str | None = doc("Python module imported before loading the model (registers custom models).")
    override_config: dict = doc("Values overriding the model's HF config (e.g. {attention_dropout: 0.0}).")
    enable_gradient_checkpointing: bool = doc("Recompute activations in backward (saves memory, costs ~30% time).")
    enable_activation_offload: bool = doc("Offload activations to CPU during training.", status=IGNORED)
    use_remove_padding: bool = doc("Pack sequences without padding (varlen attention); a speed knob.")
    lora_rank: int = doc(
        "LoRA rank r of the actor (peft): > 0 trains only low-rank adapters (the reference policy is the "
        "base model with adapters off); 0 trains all weights."
    )
    lora_alpha: int = doc("LoRA alpha: the adapter's update is scaled by lora_alpha / lora_rank.")
    target_modules: str | list[str] = doc(
        "Layers that get adapters: `all-linear` (every linear layer but the output head) or a list of "
        "module names, e.g. [q_proj,k_proj,v_proj,o_proj]."
    )
    exclude_modules: str | list[str] | None = doc("Layers (names or a regex) that get no adapter; null: none.")
    use_liger: bool = doc("Use Liger kernels (GPU only; a speed knob).", status=IGNORED)
    use_fused_kernels: bool = doc("Fused log-prob/entropy kernels (a speed knob).", status=IGNORED)
    fused_kernel_options: dict = doc("Options of the fused kernels, e.g. {impl_backend: torch}.", status=IGNORED)
    trust_remote_code: bool = doc("Allow the model repository's own Python code to run.")


@dataclass
class OptimConfig:
    """AdamW optimizer and learning-rate schedule of one trained model."""

    lr: float = doc("Peak learning rate.")
    lr_warmup_steps: int = doc("Linear warm-up steps; negative defers to `lr_warmup_steps_ratio`.")
    lr_warmup_steps_ratio: float = doc("Warm-up length as a fraction of the total training steps.")
    min_lr_ratio: float | None = doc("Cosine schedule floor as a fraction of `lr` (null: 0).")
    num_cycles: float = doc("Number of cosine half-waves over training (0.5: one decay to the floor).")
    warmup_style: str = doc("Schedule after warm-up.", choices=LR_SCHEDULES)
    lr_scheduler_type: str | None = doc(
        "Newer upstream name for `warmup_style`; wins when set.", choices=(None, *LR_SCHEDULES)
    )
    total_training_steps: int = doc("Schedule length; -1 is filled in by the trainer from the run length.")
    weight_decay: float = doc("AdamW decoupled weight decay.")
    betas: list[float] = doc("AdamW (beta1, beta2).")


@dataclass
class CheckpointConfig:
    """What a checkpoint holds."""

    save_contents: list[str] = doc("Parts written at each save.", choices=CHECKPOINT_CONTENTS)
    load_contents: list[str] = doc("Parts read when resuming.", choices=CHECKPOINT_CONTENTS)
    async_save: bool = doc("Write checkpoints in the background.", status=UNSUPPORTED, neutral=False)


@dataclass
class PolicyLossConfig:
    """Policy-gradient loss variant and its parameters."""

    loss_mode: str = doc("Policy loss: vanilla PPO clip or a variant.", choices=policy_loss_choices)
    clip_cov_ratio: float = doc("clip-cov: fraction of tokens whose gradient is clipped.")
    clip_cov_lb: float = doc("clip-cov: lower bound of the covariance window.")
    clip_cov_ub: float = doc("clip-cov: upper bound of the covariance window.")
    kl_cov_ratio: float = doc("kl-cov: fraction of tokens given a KL penalty.")
    ppo_kl_coef: float = doc("kl-cov: coefficient of that KL penalty.")


@dataclass
class ActorConfig:
    """Policy training: PPO mini-batches, clipping, KL loss, optimizer, sharding."""

    strategy: str = doc(
        "Training backend: fsdp and fsdp2 both mean FSDP2; megatron is Megatron-core (tensor/pipeline parallel).",
        choices=STRATEGIES,
    )
    ppo_mini_batch_size: int = doc("Prompts per optimizer step (times rollout.n sequences, split over ranks).")
    ppo_micro_batch_size: int | None = doc(
        "Global micro-batch (sequences).", status=DEPRECATED, replacement="use ppo_micro_batch_size_per_gpu"
    )
    ppo_micro_batch_size_per_gpu: int | None = doc(
        "Sequences per forward/backward on one rank (gradient accumulation)."
    )
    use_dynamic_bsz: bool = doc("Pack micro-batches by token count instead of a fixed size.")
    ppo_max_token_len_per_gpu: int = doc("Token budget of one packed micro-batch (with use_dynamic_bsz).")
    grad_clip: float = doc("Clip the global gradient norm to this value.")
    clip_ratio: float = doc("PPO clip range epsilon (used where the low/high values are null).")
    clip_ratio_low: float | None = doc("Lower clip epsilon: ratio >= 1 - clip_ratio_low.")
    clip_ratio_high: float | None = doc("Upper clip epsilon: ratio <= 1 + clip_ratio_high (DAPO clip-higher).")
    clip_ratio_c: float = doc("Dual-clip PPO bound for negative advantages (> 1).")
    tis_imp_ratio_cap: float = doc(
        "Truncated importance sampling against the rollout engine's log-probs: each token's loss is weighted by "
        "min(pi_old / pi_rollout, cap). -1 (or any value <= 0) turns it off; needs rollout.calculate_log_probs=true."
    )
    policy_loss: PolicyLossConfig = doc("Policy loss variant.")
    loss_agg_mode: str = doc("How token losses are averaged into the batch loss.", choices=LOSS_AGG_MODES)
    entropy_coeff: float = doc("Weight of the entropy bonus (0 disables it).")
    use_kl_loss: bool = doc("Add a KL(policy || reference) term to the loss (GRPO-style); needs the reference model.")
    use_torch_compile: bool = doc("torch.compile the log-prob/entropy helpers (needs a C++ compiler on CPU).")
    kl_loss_coef: float = doc("Weight of the KL loss.")
    kl_loss_type: str = doc("KL estimator of the KL loss.", choices=KL_PENALTIES)
    ppo_epochs: int = doc("Passes over each batch.")
    shuffle: bool = doc("Shuffle mini-batches between PPO epochs.")
    ulysses_sequence_parallel_size: int = doc("Ulysses sequence-parallel group size.", status=UNSUPPORTED, neutral=1)
    entropy_from_logits_with_chunking: bool = doc("Compute entropy in chunks to save memory.", status=IGNORED)
    entropy_checkpointing: bool = doc("Recompute entropy in backward to save memory.", status=IGNORED)
    recompute_log_prob: bool = doc(
        "Always run the separate old-log-prob forward. Off: a strictly on-policy step (ppo_epochs=1, "
        "ppo_mini_batch_size=data.train_batch_size, no in-reward KL, no rollout log-probs) reuses the "
        "update's own detached log-probs instead (identical gradient, one forward pass fewer)."
    )
    skip_zero_advantage_step: bool = doc(
        "Skip the optimizer step of a mini-batch whose advantages are all zero on every rank and that has no "
        "KL or entropy term (its gradient is zero, but AdamW's momentum would still move the weights)."
    )
    skip_zero_advantage_rows: bool = doc(
        "Leave rows whose advantages are all zero out of the update's forward and backward passes when their loss "
        "is exactly zero: policy loss vanilla, gspo or gpg, no KL loss, no entropy bonus. The loss is still "
        "normalised over the whole mini-batch, so the gradient is unchanged (to float rounding); GRPO groups whose "
        "samples all score the same are such rows. actor/zero_adv_rows_skipped reports the fraction; "
        "actor/pg_clipfrac, actor/ppo_kl and the on-policy actor/entropy then cover the trained rows."
    )
    share_prompt_forward: bool = doc(
        "Forward each distinct prompt of a micro-batch once (GRPO repeats every prompt rollout.n times) and run "
        "the responses on its KV cache expanded to the group's rows; also for old and reference log-probs. Same "
        "log-probs and gradients as one forward per sample, to float rounding; about 1.5-2.8x faster updates on "
        "the bundled task. Taken when at most half a micro-batch's prompts are distinct (on any rank); not with "
        "use_remove_padding or gradient checkpointing, where the per-sample forward runs."
    )
    checkpoint: CheckpointConfig = doc("Checkpoint contents.")
    optim: OptimConfig = doc("Optimizer and schedule.")
    fsdp_config: FSDPConfig = doc("Sharding and offload.")
    megatron: MegatronConfig = doc("Megatron-core parallelism (used when strategy=megatron).")


@dataclass
class RefConfig:
    """Reference policy (frozen copy of the initial policy) for the KL terms."""

    strategy: str = doc("Backend of the reference model.", choices=STRATEGIES)
    use_torch_compile: bool = doc("torch.compile the log-prob helpers.")
    log_prob_micro_batch_size: int | None = doc(
        "Global micro-batch.", status=DEPRECATED, replacement="use log_prob_micro_batch_size_per_gpu"
    )
    log_prob_micro_batch_size_per_gpu: int | None = doc("Sequences per forward pass on one rank.")
    log_prob_use_dynamic_bsz: bool = doc("Pack forward micro-batches by token count.")
    log_prob_max_token_len_per_gpu: int = doc("Token budget of one packed forward micro-batch.")
    ulysses_sequence_parallel_size: int = doc("Sequence-parallel group size.", status=UNSUPPORTED, neutral=1)
    entropy_from_logits_with_chunking: bool = doc("Compute entropy in chunks.", status=IGNORED)
    entropy_checkpointing: bool = doc("Recompute entropy in backward.", status=IGNORED)
    fsdp_config: FSDPConfig = doc("Sharding and offload.")
    megatron: MegatronConfig = doc("Megatron-core parallelism (used when strategy=megatron).")


@dataclass
class SamplingConfig:
    """Sampling parameters of validation generation."""

    top_k: int = doc("Keep the k most likely tokens (-1 or 0: off).")
    top_p: float = doc("Nucleus sampling mass.")
    temperature: float = doc("Sampling temperature (0 with do_sample=False: greedy).")
    n: int = doc("Samples per validation prompt.")
    do_sample: bool = doc("Sample (True) or decode greedily (False).")


@dataclass
class MultiTurnConfig:
    """The model calls tools and continues after their answers (docs/multi_turn.md)."""

    enable: bool = doc("Run agent loops (tool calling) instead of one generation per prompt.")
    max_assistant_turns: int | None = doc("Model turns per conversation at most; null: only the token budget limits.")
    max_user_turns: int | None = doc("Tool-response turns per conversation at most; null: no limit.")
    tool_config_path: str | None = doc(
        "Tool config YAML (upstream's format: tools: [{class_name, config, tool_schema}])."
    )
    interaction_config_path: str | None = doc("YAML describing a simulated user.", status=UNSUPPORTED, neutral=None)
    max_parallel_calls: int = doc("Tool calls run per model turn (concurrently); further calls get an error message.")
    max_tool_response_length: int = doc("Characters of a tool's answer kept in the conversation.")
    tool_response_truncate_side: str = doc(
        "Which part of a long tool answer is kept: left (the beginning), right (the end), middle (both ends).",
        choices=("left", "right", "middle"),
    )
    use_inference_chat_template: bool = doc(
        "Train on the inference-time rendering: always the case here (training uses the rollout's exact ids).",
        status=IGNORED,
    )
    tokenization_sanity_check_mode: str = doc(
        "Compare each finished conversation with the chat template's rendering of its messages "
        "(agent_loop/tokenization_mismatch): strict, ignore_strippable (ignore whitespace) or disable.",
        choices=("strict", "ignore_strippable", "disable"),
    )
    format: str = doc("Tool-call format of the model's chat template.", choices=tool_format_choices)


@dataclass
class RolloutConfig:
    """Response generation: engine, sampling, batch sizes of the old-log-prob pass."""

    name: str = doc("Generation engine: hf (built in, CPU and GPU), vllm or sglang.", choices=ROLLOUT_NAMES)
    mode: str = doc(
        "sync: batch generation (async, upstream's server-based agent loop, is not implemented: a config error; "
        "generation running ahead of training is async_training.*).",
        choices=ROLLOUT_MODES,
    )
    temperature: float = doc("Sampling temperature of training rollouts.")
    top_k: int = doc("Keep the k most likely tokens (-1 or 0: off).")
    top_p: float = doc("Nucleus sampling mass.")
    use_fire_sampling: bool = doc("FIRE sampling (higher first-token temperature).", status=UNSUPPORTED, neutral=False)
    prompt_length: int = doc("Prompt tokens the engine accepts (follows data.max_prompt_length).")
    response_length: int = doc("Tokens generated at most (follows data.max_response_length).")
    dtype: str = doc("Engine dtype; auto: bfloat16 on GPU, float32 on CPU.", choices=ROLLOUT_DTYPES)
    gpu_memory_utilization: float = doc(
        "Fraction of device memory the engine's weights + KV cache (+ working memory) may use; the built-in "
        "engine generates batches whose KV cache does not fit in chunks of rows."
    )
    ignore_eos: bool = doc("Keep generating past the end-of-sequence token.")
    enforce_eager: bool = doc(
        "vLLM/SGLang: disable CUDA graphs. Not read by the built-in hf engine, whose graphs are on by default "
        "(its switch is engine_kwargs.hf.enforce_eager): this key's upstream default, true, is vLLM's."
    )
    free_cache_engine: bool = doc("Free the KV cache between rollouts (hybrid engine sleep/wake).")
    load_format: str = doc("vLLM weight-loading format (dummy_dtensor: weights come from the trainer).")
    layered_summon: bool = doc("Gather FSDP weights layer by layer when syncing to the engine.", status=IGNORED)
    tensor_model_parallel_size: int = doc("Tensor-parallel size of the engine (divides the worker count).")
    max_num_batched_tokens: int = doc(
        "vLLM/SGLang scheduler token budget; hf: prompt tokens per prefill forward (whole prompts, at least one)."
    )
    max_model_len: int | None = doc("Engine context length; null: prompt_length + response_length.")
    max_num_seqs: int = doc("Concurrent sequences (hf: rows per generation chunk).")
    log_prob_micro_batch_size: int | None = doc(
        "Global micro-batch.", status=DEPRECATED, replacement="use log_prob_micro_batch_size_per_gpu"
    )
    log_prob_micro_batch_size_per_gpu: int | None = doc("Sequences per forward pass on one rank (old log-probs).")
    log_prob_use_dynamic_bsz: bool = doc("Pack forward micro-batches by token count.")
    log_prob_max_token_len_per_gpu: int = doc("Token budget of one packed forward micro-batch.")
    disable_log_stats: bool = doc("vLLM: silence engine statistics.")
    enable_chunked_prefill: bool = doc("vLLM: chunked prefill.")
    do_sample: bool = doc("Sample (True) or decode greedily (False) during training rollouts.")
    n: int = doc("Responses sampled per prompt (>= 2 for group-based advantage estimators).")
    calculate_log_probs: bool = doc(
        "Return the engine's log-probs as `rollout_log_probs`; the trainer then reports the train/rollout "
        "mismatch each step (training/rollout_probs_diff_mean, _max) and actor.tis_imp_ratio_cap can correct it."
    )
    update_weights_bucket_megabytes: int = doc("Size of the buckets weights are streamed to the engine in.")
    engine_kwargs: dict = doc(
        "Extra engine arguments per engine: {vllm: {...}, sglang: {...}, hf: {...}}; hf accepts enforce_eager."
    )
    val_kwargs: SamplingConfig = doc("Sampling for validation.")
    multi_turn: MultiTurnConfig = doc("Multi-turn tool-calling rollouts.")


@dataclass
class ActorRolloutRefConfig:
    """The hybrid engine: actor, rollout and reference colocated in one worker group."""

    hybrid_engine: bool = doc(
        "Colocate actor and rollout in one worker group, resharding weights between phases.",
        status=UNSUPPORTED,
        neutral=True,
    )
    nccl_timeout: int = doc("Seconds a collective may wait before torch.distributed fails it.")
    model: ModelConfig = doc("The policy model.")
    actor: ActorConfig = doc("Policy training.")
    ref: RefConfig = doc("Reference policy.")
    rollout: RolloutConfig = doc("Generation.")


# -------------------------------------------------------------------------------------- critic


@dataclass
class CriticModelConfig:
    """The value model (a language model with a scalar head)."""

    path: str = doc("HF-format model directory; defaults to the policy model.")
    tokenizer_path: str | None = doc("Tokenizer directory; defaults to the policy model.")
    override_config: dict = doc("Values overriding the model's HF config.")
    external_lib: str | None = doc("Python module imported before loading the model.")
    trust_remote_code: bool = doc("Allow the model repository's own Python code to run.")
    use_shm: bool = doc("Copy the model to shared memory before loading.", status=IGNORED)
    enable_gradient_checkpointing: bool = doc("Recompute activations in backward.")
    enable_activation_offload: bool = doc("Offload activations to CPU.", status=IGNORED)
    use_remove_padding: bool = doc("Pack sequences without padding.")
    fsdp_config: FSDPConfig = doc("Sharding and offload.")
    lora_rank: int = doc("LoRA rank of the critic; 0 trains all weights.", status=UNSUPPORTED, neutral=0)
    lora_alpha: int = doc("LoRA alpha.")
    target_modules: str | list[str] = doc("Modules LoRA adapts.")


@dataclass
class CriticConfig:
    """Value function for GAE: model, optimizer, PPO value loss."""

    enable: bool | None = doc("Train a critic; null: only when algorithm.adv_estimator=gae.")
    rollout_n: int = doc("Samples per prompt (follows actor_rollout_ref.rollout.n).")
    strategy: str = doc("Training backend.", choices=STRATEGIES)
    optim: OptimConfig = doc("Optimizer and schedule.")
    model: CriticModelConfig = doc("Value model.")
    ppo_mini_batch_size: int = doc("Prompts per optimizer step (follows the actor's).")
    ppo_micro_batch_size: int | None = doc(
        "Global micro-batch.", status=DEPRECATED, replacement="use ppo_micro_batch_size_per_gpu"
    )
    ppo_micro_batch_size_per_gpu: int | None = doc("Sequences per forward/backward on one rank.")
    forward_micro_batch_size: int | None = doc(
        "Global forward micro-batch.", status=DEPRECATED, replacement="use forward_micro_batch_size_per_gpu"
    )
    forward_micro_batch_size_per_gpu: int | None = doc("Sequences per value forward pass on one rank.")
    use_dynamic_bsz: bool = doc("Pack micro-batches by token count.")
    ppo_max_token_len_per_gpu: int = doc("Token budget of one packed training micro-batch.")
    forward_max_token_len_per_gpu: int = doc("Token budget of one packed forward micro-batch.")
    ulysses_sequence_parallel_size: int = doc("Sequence-parallel group size.", status=UNSUPPORTED, neutral=1)
    ppo_epochs: int = doc("Passes over each batch.")
    shuffle: bool = doc("Shuffle mini-batches between epochs.")
    grad_clip: float = doc("Clip the global gradient norm to this value.")
    cliprange_value: float = doc("Clip range of the value update around the old values.")
    loss_agg_mode: str = doc("How token losses are averaged.", choices=LOSS_AGG_MODES)
    checkpoint: CheckpointConfig = doc("Checkpoint contents.")
    megatron: MegatronConfig = doc("Megatron-core parallelism (used when strategy=megatron).")


# -------------------------------------------------------------------------------- reward model


@dataclass
class RewardModelModelConfig:
    """A learned reward model (sequence classifier)."""

    input_tokenizer: str | None = doc(
        "Policy tokenizer, to decode responses and re-render them with the reward model's chat template when "
        "the two tokenizers differ (vocabulary or template); null, or the same tokenizer: the policy's ids are used."
    )
    path: str | None = doc("HF-format reward-model directory.")
    external_lib: str | None = doc("Python module imported before loading the model.")
    trust_remote_code: bool = doc("Allow the model repository's own Python code to run.")
    use_shm: bool = doc("Copy the model to shared memory before loading.", status=IGNORED)
    use_remove_padding: bool = doc(
        "Pack sequences without padding (a speed knob; the reward model runs padded rows).", status=IGNORED
    )
    use_fused_kernels: bool = doc("Fused kernels.", status=IGNORED)
    fsdp_config: FSDPConfig = doc("Sharding and offload.")


@dataclass
class OverlongBufferConfig:
    """DAPO soft overlong punishment: a linear penalty over the last `len` tokens of the budget."""

    enable: bool = doc("Penalise responses that run into the buffer.")
    len: int = doc("Buffer length in tokens at the end of max_response_length.")
    penalty_factor: float = doc("Penalty at the very end of the budget.")
    log: bool = doc("Log the penalty as a metric.")


@dataclass
class SandboxFusionConfig:
    """Remote code-execution sandbox for code rewards (not available: no network)."""

    url: str | None = doc("Sandbox endpoint.", status=UNSUPPORTED, neutral=None)
    max_concurrent: int = doc("Concurrent sandbox requests.")
    memory_limit_mb: int = doc("Memory limit per execution.")


@dataclass
class RewardModelConfig:
    """Reward computation: the reward manager, and optionally a learned reward model."""

    enable: bool = doc("Score responses with a learned reward model (otherwise rule-based rewards only).")
    strategy: str = doc("Backend of the reward model.", choices=STRATEGIES)
    model: RewardModelModelConfig = doc("The reward model.")
    micro_batch_size: int | None = doc(
        "Global micro-batch.", status=DEPRECATED, replacement="use micro_batch_size_per_gpu"
    )
    micro_batch_size_per_gpu: int | None = doc("Sequences per reward-model forward pass on one rank.")
    max_length: int | None = doc(
        "Maximum sequence length fed to the reward model: a longer row keeps its last max_length tokens (the "
        "response's end survives, the prompt's start goes); null: no limit."
    )
    ulysses_sequence_parallel_size: int = doc("Sequence-parallel group size.", status=UNSUPPORTED, neutral=1)
    use_dynamic_bsz: bool = doc(
        "Pack micro-batches by token count (a speed knob; the reward model runs micro_batch_size_per_gpu rows).",
        status=IGNORED,
    )
    forward_max_token_len_per_gpu: int = doc("Token budget of one packed forward micro-batch.", status=IGNORED)
    megatron: MegatronConfig = doc(
        "Megatron-core parallelism of the reward model (used when strategy=megatron; it shares the actor's "
        "worker processes, so a megatron actor or critic there must use the same layout)."
    )
    reward_manager: str = doc("Turns scores into token-level rewards.", choices=REWARD_MANAGERS)
    launch_reward_fn_async: bool = doc("Compute rule rewards in a background task during the log-prob pass.")
    reward_kwargs: dict = doc("Extra keyword arguments of the reward manager.")
    overlong_buffer: OverlongBufferConfig = doc("DAPO overlong penalty (used by reward_manager=dapo).")
    sandbox_fusion: SandboxFusionConfig = doc("Code-execution sandbox.")


@dataclass
class CustomRewardFunctionConfig:
    """A user reward function `fn(data_source, solution_str, ground_truth, extra_info) -> float | dict`."""

    path: str | None = doc(
        "Python file defining the function; null uses verl.utils.reward_score.default_compute_score. The file "
        "is imported and run in the trainer's processes with your permissions: point it only at code you trust."
    )
    name: str = doc("Function name inside `path`.")
    reward_kwargs: dict = doc("Keyword arguments bound to the function at every call (e.g. {format_score: 0.1}).")
    on_error: str = doc(
        "A reward function that raises, or returns NaN, infinity or a non-number (custom or built-in): raise stops "
        "the run showing the failing sample; zero scores that sample 0 and counts it in reward/num_errors.",
        choices=REWARD_ON_ERROR,
    )


# ----------------------------------------------------------------------------------- algorithm


@dataclass
class KLControlConfig:
    """Controller of the in-reward KL coefficient."""

    type: str = doc("fixed: constant coefficient; adaptive: steer towards `target_kl`.", choices=KL_CTRL_TYPES)
    kl_coef: float = doc("(Initial) KL coefficient.")
    horizon: int = doc("Adaptive controller horizon in samples.")
    target_kl: float = doc("Adaptive controller target KL.")


@dataclass
class PFPPOConfig:
    """Policy-filtration PPO: resample the batch by reward weight."""

    reweight_method: str = doc("Weighting of samples.", choices=PF_PPO_METHODS)
    weight_pow: float = doc("Exponent of the `pow` method.")


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop groups whose samples all score the same and generate more."""

    enable: bool = doc("Drop zero-variance groups and refill the batch.")
    metric: str | None = doc("Per-sample metric whose spread decides (e.g. acc, score, seq_reward).")
    max_num_gen_batches: int = doc("Generation rounds per step before giving up (<= 0: unlimited).")


@dataclass
class AlgorithmConfig:
    """Advantage estimation and the KL penalty in the reward."""

    gamma: float = doc("Discount factor.")
    lam: float = doc("GAE lambda.")
    adv_estimator: str = doc("Advantage estimator.", choices=adv_estimator_choices)
    norm_adv_by_std_in_grpo: bool = doc("GRPO: divide by the group's std (False: Dr. GRPO).")
    use_kl_in_reward: bool = doc("Subtract a KL(policy || reference) penalty from the reward; needs the reference.")
    kl_penalty: str = doc("KL estimator of the in-reward penalty.", choices=KL_PENALTIES)
    kl_ctrl: KLControlConfig = doc("KL coefficient controller.")
    use_pf_ppo: bool = doc("Policy-filtration PPO.", status=UNSUPPORTED, neutral=False)
    pf_ppo: PFPPOConfig = doc("PF-PPO parameters.")
    filter_groups: FilterGroupsConfig = doc("DAPO dynamic sampling.")


# ------------------------------------------------------------------------------------- trainer


@dataclass
class TrainerConfig:
    """The driver loop: length, resources, validation, checkpoints, logging."""

    balance_batch: bool = doc("Reorder each batch so every rank gets a similar number of tokens.")
    total_epochs: int = doc("Passes over the training set (the run stops at whichever limit comes first).")
    total_training_steps: int | None = doc("Stop after this many steps; null: total_epochs x batches per epoch.")
    project_name: str = doc("Tracker project (also names the run directory).")
    experiment_name: str = doc("Tracker run name (also names the run directory).")
    logger: list[str] | str = doc("Metric trackers.", choices=LOGGERS)
    log_val_generations: int = doc("Validation samples (prompt, response, score) logged per validation.")
    rollout_data_dir: str | None = doc("Dump each step's rollouts as JSONL here (null: no dump).")
    validation_data_dir: str | None = doc("Dump validation generations as JSONL here (null: no dump).")
    nnodes: int = doc(
        "Ray nodes to spread the workers over, each a distinct node (ranks fill nodes in IP order); "
        "a missing node is an error at start-up."
    )
    n_gpus_per_node: int = doc("Workers per node: GPUs on CUDA, worker processes on CPU.")
    save_freq: int = doc("Checkpoint every this many steps and at the end (-1: never).")
    esi_redundant_time: int = doc("Elastic-instance expiry margin (cloud specific).", status=IGNORED)
    resume_mode: str = doc(
        "auto: latest checkpoint in default_local_dir; resume_path: resume_from_path.", choices=RESUME_MODES
    )
    resume_from_path: str | None = doc("Checkpoint directory (global_step_N) for resume_mode=resume_path.")
    val_before_train: bool = doc("Validate once before the first step.")
    val_only: bool = doc("Validate and exit without training.")
    test_freq: int = doc("Validate every this many steps and at the end (-1: never).")
    critic_warmup: int = doc("Steps that train only the critic before the actor starts.")
    default_hdfs_dir: str | None = doc(
        "Also copy checkpoints to this HDFS directory.", status=UNSUPPORTED, neutral=None
    )
    del_local_ckpt_after_load: bool = doc("Delete the local checkpoint after resuming from it.")
    default_local_dir: str = doc("Checkpoint directory.")
    max_actor_ckpt_to_keep: int | None = doc("Keep only the newest N actor checkpoints (null: all).")
    max_critic_ckpt_to_keep: int | None = doc("Keep only the newest N critic checkpoints (null: all).")
    ray_wait_register_center_timeout: int = doc("Seconds to wait for the worker group to register.")
    device: str = doc("auto: CUDA when torch sees a GPU, else CPU.", choices=device_choices)
    use_legacy_worker_impl: str = doc("Upstream worker-implementation switch.", status=IGNORED)
    run_dir: str = doc(
        "Run directory: resolved config.yaml, metrics.jsonl, training-curve PNG, tensorboard/wandb files."
    )
    rpc_timeout_s: float = doc(
        "Deadline of one blocking worker call; a hang becomes an error naming role, rank, method."
    )
    progress_bar: bool = doc(
        "Show progress bars: the driver's bar over training steps and the workers' model-loading bars."
    )
    max_consecutive_nonfinite_steps: int | None = doc(
        "Stop the run after this many steps in a row whose loss or gradient was NaN or infinite (each such update "
        "is skipped and counted in actor/skipped_nonfinite_grad); null never stops."
    )


# --------------------------------------------------------------------------------------- ray


@dataclass
class RayInitConfig:
    """Arguments of `ray.init` (any other `ray.init` keyword is accepted and passed through)."""

    OPEN_KEYS = True

    num_cpus: int | None = doc("CPUs Ray may schedule on; null: all (may hang under SLURM-like limits).")


@dataclass
class RayKwargsConfig:
    """Ray start-up."""

    ray_init: RayInitConfig = doc("Keyword arguments of ray.init.")
    timeline_json_file: str | None = doc("Write a Ray timeline (chrome://tracing JSON) here at the end.")


@dataclass
class LegacyRayInitConfig:
    """Older upstream spelling of `ray_kwargs` (`ray_init.num_cpus`); non-null values win."""

    OPEN_KEYS = True

    num_cpus: int | None = doc("CPUs Ray may schedule on (overrides ray_kwargs.ray_init.num_cpus when set).")
    timeline_json_file: str | None = doc("Ray timeline output (overrides ray_kwargs.timeline_json_file when set).")


# ------------------------------------------------------------------------------ async training

OFF_POLICY_CORRECTIONS = ("decoupled", "tis", "none")
STALE_SAMPLE_POLICIES = ("regenerate", "drop")


@dataclass
class AsyncTrainingConfig:
    """Generation running ahead of training in a separate rollout pool (see docs/async.md)."""

    staleness_threshold: float = doc(
        "How many batches generation may run ahead of training: 0 is the synchronous colocated step; 1 is "
        "one-step-off (batch t+1 is generated while batch t trains); s > 0 moves generation to its own pool "
        "(`rollout.*`) and no trained sample is more than ceil(s) weight versions old. A fraction runs part of a "
        "batch ahead: with 0.5, half of the next batch's groups are generated with the older weights (upstream's "
        "fully-async meaning: up to (1 + s) batches generated per weight version)."
    )
    off_policy_correction: str = doc(
        "decoupled: PPO ratio clipped against the recomputed (proximal) log-probs, each token weighted by "
        "min(pi_prox/pi_behav, actor.tis_imp_ratio_cap) (2 when unset); tis: no proximal pass, the PPO ratio is "
        "taken against the behaviour (rollout) log-probs; none: proximal only, behaviour ignored.",
        choices=OFF_POLICY_CORRECTIONS,
    )
    stale_sample_policy: str = doc(
        "What happens to a group older than staleness_threshold when it reaches training: regenerate it with "
        "current weights (no prompt lost) or drop it.",
        choices=STALE_SAMPLE_POLICIES,
    )
    weight_sync_timeout_s: float = doc(
        "Deadline of each trainer -> rollout weight transfer (and of forming its process group); on expiry the "
        "error names the side that did not arrive."
    )
    trigger_parameter_sync_step: int = doc(
        "Push the trainer's weights to the rollout pool every N updates (1: after every update). Fewer syncs, "
        "but the pool's weights lag up to N-1 more versions behind, so generation runs ahead only while the "
        "staleness bound still holds (between s-N+1 and s batches); N <= floor(staleness_threshold) + 1."
    )
    partial_rollout: bool = doc(
        "Weights arriving while a generation is in flight are loaded between two decode steps and the unfinished "
        "samples go on with them (re-prefilling prompt + partial response), instead of finishing with the old "
        "weights. A sample's weight_version is its oldest token's version (staleness), weight_version_max its "
        "newest; rollout log-probs are those of the version that sampled each token. Built-in engine and vLLM "
        "(rollout.name=hf or vllm), multi-turn agent loops included."
    )
    partial_rollout_check_steps: int = doc(
        "With partial_rollout: decode steps (vLLM: engine steps) between two checks for newer weights (each a "
        "store round trip)."
    )


@dataclass
class RolloutPoolConfig:
    """The separate rollout pool of asynchronous training (upstream's top-level `rollout` section)."""

    nnodes: int = doc("Nodes of the rollout pool.")
    n_gpus_per_node: int = doc("Rollout workers per node: GPUs on CUDA, worker processes on CPU.")


# ----------------------------------------------------------------------------------------- root


@dataclass
class PPOConfig:
    """The whole PPO/GRPO run (`python -m verl.trainer.main_ppo key=value ...`)."""

    data: DataConfig = doc("Datasets and batch sizes.")
    actor_rollout_ref: ActorRolloutRefConfig = doc("Policy: model, training, generation, reference.")
    critic: CriticConfig = doc("Value function (PPO with GAE).")
    reward_model: RewardModelConfig = doc("Rewards.")
    custom_reward_function: CustomRewardFunctionConfig = doc("User reward function.")
    algorithm: AlgorithmConfig = doc("Advantage estimation and KL.")
    trainer: TrainerConfig = doc("Driver loop.")
    ray_kwargs: RayKwargsConfig = doc("Ray start-up.")
    ray_init: LegacyRayInitConfig = doc("Legacy spelling of ray_kwargs.ray_init.")
    async_training: AsyncTrainingConfig = doc("Generation running ahead of training.")
    rollout: RolloutPoolConfig = doc("The separate rollout pool used when async_training.staleness_threshold > 0.")


def field_meta(f: dataclasses.Field) -> dict:
    """The `doc(...)` metadata of a schema field, with `choices` evaluated to a tuple (or None)."""
    meta = dict(f.metadata)
    if callable(meta["choices"]):
        meta["choices"] = meta["choices"]()
    return meta


def is_open(cls: type) -> bool:
    """Whether a section accepts keys beyond its declared fields."""
    return bool(getattr(cls, "OPEN_KEYS", False))
