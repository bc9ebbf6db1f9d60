"""Typed schema of the PPO config: one dataclass per section, one documented field per key.

Design decisions:
- The YAML files (ppo_trainer.yaml and its config groups) hold the defaults, upstream's values.
  The sections the workers read at runtime are upstream's typed classes (`verl.workers.config`:
  actor, critic, rollout, model, optimizer, engine; `verl.trainer.config`: algorithm, checkpoint),
  declared once, there, with the same defaults (tests build each from the YAML and compare); this
  module composes them into the whole tree and declares the driver-side sections (data, trainer,
  reward, ray, ...), whose dataclasses hold only the *contract* (type, doc, choices, status) and no
  defaults: a test checks that the composed YAML configs and the schema list the same keys.
- The schema covers both compositions, `ppo_trainer` (FSDP) and `ppo_megatron_trainer`: a key
  that only one of them holds (`actor.fsdp_config` vs `actor.megatron`, the Megatron optimizer's
  `lr_decay_style`, ...) is `optional`, i.e. it may be absent; the validator then asks for the
  section the chosen `strategy` reads.
- Field metadata is plain data (`doc`, `choices`, `status`, ...) so the validator
  (`validate.py`) and the reference-docs generator (`docgen.py`) read the same table.
- Key names follow upstream verl so its users' scripts run unchanged. An upstream key is
  honoured (SUPPORTED), accepted without effect when it can only tune speed or memory of code
  paths this implementation does not have (IGNORED, the doc says why), or refused as soon as it
  leaves its neutral value when ignoring it would silently train something else: UNSUPPORTED
  (not implemented), PENDING (being implemented: "not implemented yet") or HARDWARE (only
  meaningful on hardware this build does not support: Ascend NPUs, TensorRT-LLM).
- A section whose YAML holds `_target_` is checked against the class it names when that is a
  subclass of the field's declared class (`section_class`): the declared class is the common base
  (e.g. an optimizer config) and each trainer's YAML names its engine's subclass, so both
  compositions share one field while each section is checked against the keys it is built with.
- A dataclass marked `OPEN_KEYS = True` also accepts keys it does not list (passed through to a
  third-party API such as `ray.init`).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

from verl.trainer.config.algorithm import (  # noqa: F401  (re-exported: the schema's section classes)
    AlgoConfig,
    FilterGroupsConfig,
    KLControlConfig,
    PFPPOConfig,
    RolloutCorrectionConfig,
)
from verl.trainer.config.config import (  # noqa: F401  (re-exported: the schema's section classes)
    CheckpointConfig,
    CustomRewardFunctionConfig,
    ModuleConfig,
    RewardManagerConfig,
    reward_manager_choices,
)
from verl.utils.config import target_class
from verl.utils.profiler.config import (  # noqa: F401  (re-exported: the schema's section classes)
    GlobalProfilerConfig,
    ProfilerConfig,
)
from verl.workers.config import (  # noqa: F401  (re-exported: the schema's section classes)
    ActorConfig,
    AgentLoopConfig,
    CheckpointEngineConfig,
    CriticConfig,
    CriticModelConfig,
    CustomAsyncServerConfig,
    FSDPActorConfig,
    FSDPCriticConfig,
    FSDPEngineConfig,
    FSDPOptimizerConfig,
    HFModelConfig,
    McoreActorConfig,
    McoreCheckpointConfig,
    McoreCriticConfig,
    McoreEngineConfig,
    McoreOptimizerConfig,
    MegatronLoRAConfig,
    MtpConfig,
    MultiTurnConfig,
    OptimizerConfig,
    PolicyLossConfig,
    PrometheusConfig,
    RefConfig,
    RolloutConfig,
    RouterReplayConfig,
    SamplingConfig,
    TiledMLPConfig,
    TraceConfig,
)
from verl.workers.config._fields import (  # noqa: F401  (re-exported: the schema's public names)
    _NO_NEUTRAL,
    _SPEED,
    CHECKPOINT_CONTENTS,
    DEPRECATED,
    ENGINE_DTYPES,
    GROUP_ADV_ESTIMATORS,
    HARDWARE,
    IGNORED,
    KL_CTRL_TYPES,
    KL_PENALTIES,
    LOGGERS,
    LOGGERS_NOT_IN_THIS_BUILD,
    LOGPROBS_MODES,
    LOSS_AGG_MODES,
    LR_SCHEDULES,
    MODEL_DTYPES,
    NPU,
    PENDING,
    PF_PPO_METHODS,
    RESUME_MODES,
    REWARD_MANAGER_SOURCES,
    REWARD_MANAGERS,
    REWARD_ON_ERROR,
    ROLLOUT_DTYPES,
    ROLLOUT_MODES,
    ROLLOUT_NAMES,
    STRATEGIES,
    SUPPORTED,
    TRTLLM,
    TRUNCATIONS,
    UNSUPPORTED,
    adv_estimator_choices,
    device_choices,
    doc,
    policy_loss_choices,
)
from verl.workers.config.reward import (  # noqa: F401  (re-exported: the schema's section classes)
    RewardConfig,
    RewardModelSectionConfig,
    RewardRolloutConfig,
)
from verl.workers.config.reward_model import (  # noqa: F401  (re-exported: the schema's section classes)
    OverlongBufferConfig,
    RewardModelConfig,
    RewardModelFSDPConfig,
    RewardModelModelConfig,
    RewardModelRolloutConfig,
    SandboxFusionConfig,
)

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
class ContinuousTokenConfig:
    """Upstream's Continuous Token: multi-turn rollouts keep the generated token stream instead of re-rendering
    earlier assistant turns from their text."""

    enable: bool = doc(
        "Keep the runtime token stream across turns. Not implemented here (the agent loop re-tokenizes each turn "
        "as upstream does by default).",
        status=UNSUPPORTED,
        neutral=False,
    )
    model_family: str = doc(
        "Chat-template family of the token stream (auto, qwen, qwen3, glm47, ...); only read with enable=true, "
        "which is refused.",
        status=IGNORED,
    )


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
    tool_config_path: str | None = doc(
        "Tool config the dataset reads tool schemas from (follows rollout.multi_turn.tool_config_path, which the "
        "agent loop reads; both name the same file)."
    )
    gen_batch_size: int | None = doc(
        "Prompts drawn from the dataloader at a time, e.g. per round when `algorithm.filter_groups` refills a batch "
        "(DAPO); null: train_batch_size."
    )
    function_tool_path: str | None = doc(
        "Python file of upstream's `@function_tool` functions, offered to the agent loop as tools (follows "
        "rollout.multi_turn.function_tool_path). Not implemented here: declare tools in "
        "rollout.multi_turn.tool_config_path.",
        status=UNSUPPORTED,
        neutral=None,
    )
    audio_key: str = doc(
        "Column with each row's audio clips; a row with audio is refused (no audio support here), before the run "
        "starts for the data files."
    )
    continuous_token: ContinuousTokenConfig = doc("Upstream's Continuous Token multi-turn token stream.")
    mm_processor_kwargs: dict = doc(
        "Extra keyword arguments of the multi-modal processor (upstream passes them to the processor and the "
        "rollout backends). Not implemented here: the dataset and the rollout would have to agree on them.",
        status=UNSUPPORTED,
        neutral={},
    )
    return_raw_input_ids: bool = doc(
        "Also return prompt ids without the chat template (for a reward model). Upstream's dataset no longer reads "
        "it either: a reward model with a tokenizer of its own re-renders the prompt messages (`raw_prompt`) instead.",
        status=IGNORED,
    )
    return_raw_chat: bool = doc("Also return the prompt messages before templating (`raw_prompt`).")
    return_full_prompt: bool = doc("Also return the templated prompt text.")
    shuffle: bool = doc("Shuffle the training set each epoch.")
    seed: int | None = doc("Seed of the training-set shuffle; null means 1.")
    dataloader_num_workers: int = doc("DataLoader worker processes (0 loads in the driver).")
    image_patch_size: int = doc(
        "Vision patch size in pixels: dict images are resized to multiples of twice it (one merged patch) "
        "(multi-modal data only)."
    )
    validation_shuffle: bool = doc("Shuffle the validation set.")
    filter_overlong_prompts: bool = doc("Drop prompts longer than `max_prompt_length` when loading.")
    filter_overlong_prompts_workers: int = doc(
        f"Processes used to filter overlong prompts. {_SPEED} (the filter here tokenises every prompt in one "
        "batched call of the fast tokenizer, in one process).",
        status=IGNORED,
    )
    truncation: str = doc("What to do with prompts over `max_prompt_length`.", choices=TRUNCATIONS)
    image_key: str = doc(
        "Column with each row's list of images (PIL images or {bytes, path} dicts), one per `<image>` in the "
        "prompt (multi-modal data only)."
    )
    video_key: str = doc("Column with videos; a row with videos is refused (no video support here).")
    trust_remote_code: bool = doc("Allow the tokenizer's own Python code to run.")
    custom_cls: ClassRefConfig = doc("Custom dataset class replacing the built-in RLHF dataset.")
    return_multi_modal_inputs: bool = doc(
        "Return the processor's `pixel_values`/`image_grid_thw` with each sample (`multi_modal_inputs`)."
    )
    sampler: SamplerConfig = doc("Custom sampler of the training set.")
    datagen: ClassRefConfig = doc("Dynamic data generator.", status=IGNORED)
    apply_chat_template_kwargs: dict = doc("Extra keyword arguments for `tokenizer.apply_chat_template`.")


# ------------------------------------------------------------------------------------ engines


# ------------------------------------------------------------------------------ model, actor


@dataclass
class ActorRolloutRefConfig:
    """The hybrid engine: actor, rollout and reference colocated in one worker group."""

    hybrid_engine: bool = doc(
        "Colocate actor and rollout in one worker group, resharding weights between phases.",
        status=UNSUPPORTED,
        neutral=True,
    )
    nccl_timeout: int = doc("Seconds a collective may wait before torch.distributed fails it.")
    model: HFModelConfig = doc("The policy model.")
    actor: ActorConfig = doc("Policy training.")
    ref: RefConfig = doc("Reference policy.")
    rollout: RolloutConfig = doc("Generation.")


# -------------------------------------------------------------------------------------- critic


# -------------------------------------------------------------------------------- reward model


# ----------------------------------------------------------------------------------- algorithm


# ------------------------------------------------------------------------------------- trainer

MODEL_ENGINES = ("dp", "megatron")
# upstream's `model_engine` options whose engines are not in this build: refused by name
MODEL_ENGINES_NOT_IN_THIS_BUILD = {
    "veomni": "upstream's VeOmni engine",
    "torchtitan": "upstream's TorchTitan engine",
    "mindspeed": "upstream's MindSpeed engine (Ascend NPUs)",
    "mlite": "upstream's Megatron-lite engine (an out-of-tree plugin)",
}


TRAINER_MODES = ("sync", "colocate_async", "separate_async")
MAX_OFF_POLICY_STRATEGIES = ("drop", "wait")
_ASYNC_MODE_ONLY = (
    "Only read by trainer.v1.trainer_mode colocate_async / separate_async, which are refused here (sync trainer "
    "steps are on-policy)."
)


@dataclass
class WarmupConfig:
    """Settings of one of upstream's asynchronous v1 trainer modes."""

    OPEN_KEYS = True

    num_warmup_batches: int = doc(f"Batches generated before the first step. {_ASYNC_MODE_ONLY}", status=IGNORED)


@dataclass
class SeparateAsyncConfig(WarmupConfig):
    """Upstream's separate_async mode: trainer and rollout on separate devices."""

    parameter_sync_step: int = doc(f"Updates between two weight syncs. {_ASYNC_MODE_ONLY}", status=IGNORED)


@dataclass
class CustomSamplerConfig:
    """Upstream's custom replay-buffer sampler: not implemented here (no replay buffer: a step trains on the
    groups it generated)."""

    path: str | None = doc("Python file holding the sampler class.", status=UNSUPPORTED, neutral=None)
    name: str | None = doc("Name of the sampler class.", status=UNSUPPORTED, neutral=None)


@dataclass
class ReplaySamplerConfig:
    """Upstream's v1 replay-buffer sampler."""

    max_off_policy_threshold: int = doc(
        f"Most model versions one trajectory may span. {_ASYNC_MODE_ONLY}", status=IGNORED
    )
    max_off_policy_strategy: str = doc(
        f"drop or wait for trajectories past the threshold. {_ASYNC_MODE_ONLY}",
        status=IGNORED,
        choices=MAX_OFF_POLICY_STRATEGIES,
    )
    sync_refill_failed_groups: bool = doc(
        "Replace a prompt group that produced no trajectory (every sample failed) with a new prompt. Not "
        "implemented here: a step trains the groups its own prompts produced.",
        status=UNSUPPORTED,
        neutral=False,
    )
    custom_sampler: CustomSamplerConfig = doc("A user class choosing which buffered trajectories a step trains on.")
    sampler_kwargs: dict = doc("Keyword arguments of the custom sampler.", status=UNSUPPORTED, neutral={})


@dataclass
class TrainerV1Config:
    """Upstream's v1 trainer: its mode and replay-buffer sampler."""

    trainer_mode: str = doc(
        "sync: the colocated synchronous step (this build's trainer). colocate_async and separate_async (upstream's "
        "asynchronous v1 modes with partial rollouts) are refused: use async_training.* here, or upstream's "
        "fully_async / one_step_off entry points (docs/async.md).",
        choices=TRAINER_MODES,
        status=UNSUPPORTED,
        neutral="sync",
    )
    sync: dict = doc("Settings of the sync mode (upstream defines none).")
    colocate_async: WarmupConfig = doc("Upstream's colocate_async mode.")
    separate_async: SeparateAsyncConfig = doc("Upstream's separate_async mode.")
    sampler: ReplaySamplerConfig = doc("Upstream's replay-buffer sampler.")


@dataclass
class TrainerConfig:
    """The driver loop: length, resources, validation, checkpoints, logging."""

    balance_batch: bool = doc("Reorder each batch so every rank gets a similar number of tokens.")
    total_epochs: int = doc("Passes over the training set (the run stops at whichever limit comes first).")
    total_training_steps: int | None = doc("Stop after this many steps; null: total_epochs x batches per epoch.")
    project_name: str = doc("Tracker project (also names the run directory).")
    experiment_name: str = doc("Tracker run name (also names the run directory).")
    logger: list[str] | str = doc(
        "Metric trackers (`tracking` is upstream's older name of wandb).",
        choices=LOGGERS,
        hardware_values=LOGGERS_NOT_IN_THIS_BUILD,
    )
    log_val_generations: int = doc(
        "Validation samples (input, output, score) logged to the trackers at each validation: the same ones "
        "every time (sorted by input, shuffled with seed 42, the first N). file: `<run_dir>/val_generations.jsonl`; "
        "wandb: table `val/generations`, a row per validation; swanlab: table; clearml: table `Validation`; mlflow: "
        "artifact `val_step<step>.json`; tensorboard: text. 0: none (`validation_data_dir` keeps every sample)."
    )
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
        "Also copy each complete checkpoint step here (global_step_N/ and a tracker file): a local "
        "directory, file:// or hdfs:// (needs the `hdfs` command); copies are never pruned."
    )
    del_local_ckpt_after_load: bool = doc(
        "Upstream deletes the local copies of a checkpoint it downloaded from HDFS after loading them (never a "
        "local checkpoint); checkpoints are resumed here from `default_local_dir` only, never downloaded.",
        status=IGNORED,
    )
    default_local_dir: str = doc("Checkpoint directory.")
    max_actor_ckpt_to_keep: int | None = doc("Keep only the newest N actor checkpoints (null: all).")
    max_critic_ckpt_to_keep: int | None = doc("Keep only the newest N critic checkpoints (null: all).")
    ray_wait_register_center_timeout: int = doc(
        "Seconds the workers of each worker group may take to start; past it the run fails naming the ranks that "
        "did not."
    )
    device: str = doc(
        "cuda (upstream's default) or cpu; auto (ours): CUDA when torch sees a GPU, else CPU. A device the machine "
        "does not have fails before Ray starts, saying how to switch.",
        choices=device_choices,
        hardware_values={"npu": NPU},
    )
    use_v1: bool = doc(
        "Upstream's choice between its v1 trainer (true, its default) and its legacy one (false); both run the same "
        "synchronous PPO step, which is this build's one trainer either way."
    )
    v1: TrainerV1Config = doc("Upstream's v1 trainer modes.")
    use_legacy_worker_impl: str = doc(
        "Upstream's switch between its two worker implementations (auto, enable, disable); one implementation here.",
        status=IGNORED,
        choices=("auto", "enable", "disable"),
    )
    run_dir: str = doc(
        "Run directory: resolved config.yaml, metrics.jsonl, training-curve PNG, tensorboard/wandb files."
    )
    tensorboard_dir: str | None = doc(
        "Directory of the tensorboard event files (with trainer.logger including tensorboard); null: "
        "$TENSORBOARD_DIR, else <run_dir>/tensorboard (upstream's later releases read this key)."
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


@dataclass
class TransferQueueConfig:
    """Upstream's TransferQueue data plane between driver and workers."""

    enable: bool = doc("Move batches through TransferQueue.", status=UNSUPPORTED, neutral=False)
    metrics: dict = doc(
        "TransferQueue's metrics endpoint; only read with enable=true, which is refused.", status=IGNORED
    )
    backend: dict = doc(
        "TransferQueue's storage backend; only read with enable=true, which is refused.", status=IGNORED
    )


_DISTILLATION_ONLY = "Only read with distillation.enabled=true, which is refused."


@dataclass
class DistillationLossConfig:
    """Upstream's distillation loss (student against teacher log-probs)."""

    loss_mode: str = doc(f"KL estimator or top-k loss. {_DISTILLATION_ONLY}", status=IGNORED)
    topk: int = doc(f"Teacher top-k tokens of the top-k losses. {_DISTILLATION_ONLY}", status=IGNORED)
    use_task_rewards: bool = doc(
        f"Keep the task reward beside the distillation loss. {_DISTILLATION_ONLY}", status=IGNORED
    )
    distillation_loss_coef: float = doc(f"Weight of the distillation loss. {_DISTILLATION_ONLY}", status=IGNORED)
    loss_max_clamp: float | None = doc(f"Upper clamp of the per-token loss. {_DISTILLATION_ONLY}", status=IGNORED)
    log_prob_min_clamp: float | None = doc(f"Lower clamp of the log-probs. {_DISTILLATION_ONLY}", status=IGNORED)
    use_policy_gradient: bool = doc(f"Distil through the policy-gradient loss. {_DISTILLATION_ONLY}", status=IGNORED)
    policy_loss_mode: str = doc(f"Policy loss of the policy-gradient form. {_DISTILLATION_ONLY}", status=IGNORED)
    clip_ratio: float = doc(f"PPO clip of the policy-gradient form. {_DISTILLATION_ONLY}", status=IGNORED)
    clip_ratio_low: float = doc(f"Lower PPO clip. {_DISTILLATION_ONLY}", status=IGNORED)
    clip_ratio_high: float = doc(f"Upper PPO clip. {_DISTILLATION_ONLY}", status=IGNORED)


@dataclass
class DistillationConfig:
    """Upstream's on-policy distillation: the student's rollouts scored token by token by teacher models."""

    enabled: bool = doc(
        "Train the actor toward teacher models' log-probs on its own rollouts. Not implemented here.",
        status=UNSUPPORTED,
        neutral=False,
    )
    distillation_loss: DistillationLossConfig = doc("The distillation loss.")
    n_gpus_per_node: int = doc(f"GPUs per node of the teachers' pool. {_DISTILLATION_ONLY}", status=IGNORED)
    nnodes: int = doc(f"Nodes of the teachers' pool. {_DISTILLATION_ONLY}", status=IGNORED)
    teacher_models: dict = doc(
        f"Teacher models by name (model_path, key, num_replicas, inference engine settings). {_DISTILLATION_ONLY}",
        status=IGNORED,
    )
    teacher_key: str = doc(f"Column that picks a row's teacher by its `key`. {_DISTILLATION_ONLY}", status=IGNORED)


SKIP_ACTIONS = ("cache", "repeat")


@dataclass
class RolloutSkipConfig:
    """Replay dumped training rollouts at chosen steps instead of generating (validation always generates)."""

    enable: bool = doc("Turn the skip on.")
    dump_dir: str = doc(
        "Dump directory; a run's dumps are `<dump_dir>/<experiment>_<project>/GBS<gbs>_N<n>_in<prompt "
        "length>_out<response length>/<step>/` (gbs: data.gen_batch_size, else train_batch_size)."
    )
    steps: list[int] = doc("The training steps (global_steps, from 1) that replay; other steps generate.")
    action: str = doc(
        "cache: a listed step replays its own dump, or generates and dumps it when missing; repeat: it replays its "
        "own dump, else the newest earlier one, else the oldest later one, else generates and dumps.",
        choices=SKIP_ACTIONS,
    )


@dataclass
class RefusedSkipConfig:
    """A skip of one of upstream's trainers this build does not have."""

    enable: bool = doc(
        "Replay dumps in upstream's TransferQueue (rollout_tq) or asynchronous (async_rollout) trainer; not here: "
        "use skip.rollout.",
        status=UNSUPPORTED,
        neutral=False,
    )
    dump_dir: str = doc("Dump directory; only read with enable=true, which is refused.", status=IGNORED)
    steps: list[int] = doc("Steps that replay; only read with enable=true, which is refused.", status=IGNORED)
    action: str = doc("cache or repeat; only read with enable=true, which is refused.", status=IGNORED)


@dataclass
class SkipConfig:
    """Upstream's `skip` section."""

    rollout: RolloutSkipConfig = doc("Replay dumped rollouts (the synchronous trainer).")
    rollout_tq: RefusedSkipConfig = doc("Upstream's TransferQueue trainer's skip.")
    async_rollout: RefusedSkipConfig = doc("Upstream's asynchronous trainer's skip.")


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

    model_engine: str = doc(
        "Training backend of the actor, reference, critic and reward model: dp (FSDP) or megatron. A config-group "
        "choice (`model_engine=megatron` on the command line selects the megatron_* options of the actor, ref, "
        "critic and reward_model groups, the same composition as --config-name=ppo_megatron_trainer).",
        choices=MODEL_ENGINES,
        hardware_values=MODEL_ENGINES_NOT_IN_THIS_BUILD,
    )
    data: DataConfig = doc("Datasets and batch sizes.")
    actor_rollout_ref: ActorRolloutRefConfig = doc("Policy: model, training, generation, reference.")
    critic: CriticConfig = doc("Value function (PPO with GAE).")
    reward_manager: RewardManagerConfig = doc("Rule-based reward manager.")
    reward_model: RewardModelConfig = doc("Rewards.")
    custom_reward_function: CustomRewardFunctionConfig = doc("User reward function.")
    sandbox_fusion: SandboxFusionConfig = doc(
        "Upstream v0.9's legacy spelling of reward.sandbox_fusion (null: not given; migrated onto it)."
    )
    reward: RewardConfig = doc("Where rewards come from (upstream v0.9; the older reward keys are migrated onto it).")
    algorithm: AlgoConfig = doc("Advantage estimation and KL.")
    trainer: TrainerConfig = doc("Driver loop.")
    global_profiler: GlobalProfilerConfig = doc("Profiling.")
    transfer_queue: TransferQueueConfig = doc("Upstream's TransferQueue.")
    distillation: DistillationConfig = doc("Upstream's on-policy distillation.")
    skip: SkipConfig = doc("Replay dumped rollouts instead of generating.")
    ray_kwargs: RayKwargsConfig = doc("Ray start-up.")
    ray_init: LegacyRayInitConfig = doc("Legacy spelling of ray_kwargs.ray_init.")
    async_training: AsyncTrainingConfig = doc("Ours. Generation running ahead of training.")
    rollout: RolloutPoolConfig = doc(
        "Ours. The separate rollout pool used when async_training.staleness_threshold > 0."
    )


def field_meta(f: dataclasses.Field) -> dict:
    """The `doc(...)` metadata of a schema field, with `choices` evaluated to a tuple (or None).

    A field declared without `doc` (a user's subclass named by a section's `_target_`, as verl-recipe's
    `SPPOActorConfig(FSDPActorConfig)` adds `sppo_eta`) is a supported key of any value, optional when
    the dataclass gives it a default."""
    if "status" not in f.metadata:
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        return dict(doc("declared by the section's own class", optional=has_default).metadata)
    meta = dict(f.metadata)
    if callable(meta["choices"]):
        meta["choices"] = meta["choices"]()
    return meta


def is_open(cls: type) -> bool:
    """Whether a section accepts keys beyond its declared fields."""
    return bool(getattr(cls, "OPEN_KEYS", False))


def config_fields(cls: type) -> tuple[dataclasses.Field, ...]:
    """The config keys a section class declares: its dataclass fields less `_target_`, which names the
    class to build (BaseConfig's field) rather than a setting."""
    return tuple(f for f in dataclasses.fields(cls) if f.name != "_target_")


def section_class(declared: type, value: object, path: str = "") -> type:
    """The class that describes one config section: the subclass of `declared` its `_target_` names, else `declared`.

    The schema declares a field by its base class (`OptimizerConfig`, ...); each trainer's YAML names
    the concrete class (e.g. an FSDP vs a Megatron optimizer), whose extra keys and checks then
    apply. The choice is `verl.utils.config.target_class`'s, the same one `omega_conf_to_dataclass`
    makes. Raises ValueError (ConfigError) when `_target_` names no importable subclass of `declared`.
    """
    return target_class(declared, value, path)


SECTION_SUBCLASSES: dict[type, tuple[type, ...]] = {
    OptimizerConfig: (FSDPOptimizerConfig, McoreOptimizerConfig),
    ActorConfig: (FSDPActorConfig, McoreActorConfig),
    CriticConfig: (FSDPCriticConfig, McoreCriticConfig),
    CheckpointConfig: (CheckpointConfig, McoreCheckpointConfig),
}
"""Declared section class -> the subclasses a YAML `_target_` may name. Only for the docs and for
did-you-mean hints: their own keys are listed under the declared section (`section_fields`); which
class checks a section is still its `_target_`'s (`section_class`)."""


def section_fields(cls: type) -> tuple[tuple[dataclasses.Field, type, object], ...]:
    """(field, owner, type) for the keys of `cls`, then the keys its `SECTION_SUBCLASSES` add.

    The owner is `cls` for its own keys and for a key every listed subclass declares (an optimizer's
    `optimizer`); otherwise it is the one subclass that declares the key: such a key belongs to the
    composition whose `_target_` names that subclass (an FSDP optimizer's `optimizer_impl`, a
    Megatron one's `lr_decay_style`), so it is never required of the section as a whole.
    """
    hints = typing.get_type_hints(cls)
    out = [(f, cls, hints[f.name]) for f in config_fields(cls)]
    seen = {f.name for f, _, _ in out}
    subs = SECTION_SUBCLASSES.get(cls, ())
    for sub in subs:
        sub_hints = typing.get_type_hints(sub)
        for f in config_fields(sub):
            if f.name not in seen:
                seen.add(f.name)
                shared = all(f.name in {g.name for g in config_fields(other)} for other in subs)
                out.append((f, cls if shared else sub, sub_hints[f.name]))
    return tuple(out)


TYPED_SECTIONS: dict[str, type] = {
    "algorithm": AlgoConfig,
    "actor_rollout_ref.actor.checkpoint": CheckpointConfig,
    "critic.checkpoint": CheckpointConfig,
    "actor_rollout_ref.actor.policy_loss": PolicyLossConfig,
    "actor_rollout_ref.actor.optim": OptimizerConfig,
    "critic.optim": OptimizerConfig,
    "reward_model.sandbox_fusion": SandboxFusionConfig,
    "sandbox_fusion": SandboxFusionConfig,
    "reward": RewardConfig,
    "reward_manager": RewardManagerConfig,
    "custom_reward_function": CustomRewardFunctionConfig,
    # sections holding the ones above come after them (see validate._check_typed_sections)
    "reward_model": RewardModelConfig,
    "actor_rollout_ref.rollout.multi_turn": MultiTurnConfig,
    "actor_rollout_ref.rollout.checkpoint_engine": CheckpointEngineConfig,
    "actor_rollout_ref.model": HFModelConfig,
    "actor_rollout_ref.actor": ActorConfig,
    "actor_rollout_ref.rollout": RolloutConfig,
    "critic": CriticConfig,
}
"""Dotted key -> the runtime section class whose `__post_init__` checks it (validate.py builds each)."""
