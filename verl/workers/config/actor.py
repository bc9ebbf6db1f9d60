"""Typed config sections of the actor and the reference policy, with upstream verl's names and
defaults: `ActorConfig` (the keys every engine reads), `FSDPActorConfig` (actor/dp_actor.yaml's
`_target_`) and `McoreActorConfig` (actor/megatron_actor.yaml's), and their nested `PolicyLossConfig`
and `RouterReplayConfig` (the `profiler` section is upstream's `verl.utils.profiler.ProfilerConfig`).
`RefConfig` is ours: upstream builds the reference section as an actor config, whose keys it does
not share here (the reference only runs forward passes).

The schema declares the actor by the base class; the YAML's `_target_` picks the engine's subclass,
whose extra keys (an FSDP actor's `grad_clip` and `fsdp_config`, a Megatron one's `megatron`) the
section is checked against and built with (one resolver, `verl.utils.config.target_class`).

Each field carries its runtime default (the YAML holds the same value) and the `doc(...)` metadata
the validator and docgen read, so the section is declared once, here; `schema.py` composes it into
the actor section. Checks that concern this section alone run in `__post_init__`, when the section
is built; rules that span sections (a loss mode that needs rollout log-probs) stay in validate.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl.base_config import BaseConfig
from verl.utils.profiler.config import ProfilerConfig
from verl.utils.ulysses_keys import role_sp
from verl.workers.config._fields import (
    _SPEED,
    DEPRECATED,
    IGNORED,
    KL_PENALTIES,
    LOSS_AGG_MODES,
    STRATEGIES,
    STRATEGIES_NOT_IN_THIS_BUILD,
    UNSUPPORTED,
    doc,
    policy_loss_choices,
)
from verl.workers.config.checkpoint import CheckpointConfig
from verl.workers.config.engine import FSDPEngineConfig, McoreEngineConfig, QATEngineConfig
from verl.workers.config.optimizer import FSDPOptimizerConfig, McoreOptimizerConfig, OptimizerConfig

__all__ = [
    "ActorConfig",
    "FSDPActorConfig",
    "McoreActorConfig",
    "PolicyLossConfig",
    "RefConfig",
    "RouterReplayConfig",
]


@dataclass
class PolicyLossConfig(BaseConfig):
    """Policy-gradient loss variant and its parameters."""

    loss_mode: str = doc("Policy loss: vanilla PPO clip or a variant.", choices=policy_loss_choices, default="vanilla")
    clip_cov_ratio: float = doc("clip-cov: fraction of tokens whose gradient is clipped.", default=0.0002)
    clip_cov_lb: float = doc("clip-cov: lower bound of the covariance window.", default=1.0)
    clip_cov_ub: float = doc("clip-cov: upper bound of the covariance window.", default=5.0)
    kl_cov_ratio: float = doc("kl-cov: fraction of tokens given a KL penalty.", default=0.0002)
    ppo_kl_coef: float = doc("kl-cov: coefficient of that KL penalty.", default=0.1)
    dro_beta: float | None = doc(
        "dro: weight beta of the squared log-ratio penalty, loss = -(A log pi - beta/2 (log pi - log pi_old)^2); "
        "must be > 0 with loss_mode=dro, unread otherwise.",
        default=None,
    )
    rollout_correction: dict | None = doc(
        "Bypass mode's settings, written here by the trainer from algorithm.rollout_correction when its "
        "bypass_mode is on (set that section, not this key); read only with loss_mode bypass_mode.",
        optional=True,
        default=None,
    )

    def __post_init__(self):
        choices = policy_loss_choices()
        if self.loss_mode not in choices:
            raise ValueError(
                f"policy_loss.loss_mode={self.loss_mode!r} is not a valid choice; use one of: "
                f"{', '.join(choices)} (or register a loss with verl.algorithms.register_policy_loss)"
            )
        for key in ("clip_cov_ratio", "kl_cov_ratio"):
            value = getattr(self, key)
            if not 0.0 <= value <= 1.0:
                raise ValueError(
                    f"policy_loss.{key}={value} is outside [0, 1]: it is a fraction of the tokens; "
                    "set it between 0 and 1"
                )
        if self.rollout_correction is not None and self.loss_mode != "bypass_mode":
            raise ValueError(
                f"policy_loss.rollout_correction is set but policy_loss.loss_mode={self.loss_mode!r}: only the "
                "bypass_mode loss reads it; set algorithm.rollout_correction.bypass_mode=true instead (the trainer "
                "then fills both keys)"
            )
        if self.loss_mode == "dro" and not (self.dro_beta is not None and self.dro_beta > 0):
            raise ValueError(
                f"policy_loss.dro_beta={self.dro_beta}: loss_mode=dro needs a positive dro_beta (the weight of its "
                "squared log-ratio penalty), e.g. policy_loss.dro_beta=0.1"
            )
        if self.clip_cov_lb > self.clip_cov_ub:
            raise ValueError(
                f"policy_loss.clip_cov_lb={self.clip_cov_lb} is above clip_cov_ub={self.clip_cov_ub}: "
                "the covariance window would be empty; set clip_cov_lb <= clip_cov_ub"
            )


@dataclass
class RouterReplayConfig(BaseConfig):
    """Mixture-of-experts routing record and replay (docs/megatron.md, "Router replay"); the actor's
    section only, on strategy=megatron (validate.py refuses the rest)."""

    mode: str = doc(
        "R2: the old-log-prob pass records each token's experts and the update's forwards replay them; "
        "R3: the old-log-prob pass and the update replay the routing the rollout engine recorded "
        "(rollout.enable_rollout_routing_replay, the built-in engine).",
        choices=("disabled", "R2", "R3"),
        default="disabled",
    )
    # upstream's release declares both and reads neither: the routing travels in the batch
    record_file: str | None = doc(
        "Write recorded routing decisions to a file.", status=UNSUPPORTED, neutral=None, default=None
    )
    replay_file: str | None = doc(
        "Replay routing decisions from a file.", status=UNSUPPORTED, neutral=None, default=None
    )


@dataclass
class ActorConfig(BaseConfig):
    """Policy training: PPO mini-batches, clipping, KL loss, optimizer, engine."""

    # Assignable after construction, as upstream's: its workers rescale the batch sizes per rank in
    # place, and set `engine` / `model_config` (attributes, not keys of this section) late.
    _mutable_fields = BaseConfig._mutable_fields | {
        "ppo_mini_batch_size",
        "ppo_micro_batch_size",
        "ppo_micro_batch_size_per_gpu",
        "ppo_infer_micro_batch_size_per_gpu",
        "engine",
        "model_config",
    }

    @property
    def global_batch_info(self) -> dict:
        """Upstream's per-micro-batch counts of the whole batch (`dp_size`, `batch_num_tokens`,
        `global_batch_size`), filled in place by its engine loss (`verl.workers.utils.losses.ppo_loss`)
        and handed by the policy losses to `agg_loss`; empty: each micro-batch aggregates on its own.
        An attribute of this object, not a key of the section."""
        info = self.__dict__.get("_global_batch_info")
        if info is None:
            info = {}
            object.__setattr__(self, "_global_batch_info", info)
        return info

    rollout_n: int = doc("Responses per prompt (follows actor_rollout_ref.rollout.n, which it must equal).", default=1)
    strategy: str = doc(
        "Training backend: fsdp and fsdp2 both mean FSDP2; megatron is Megatron-core (tensor/pipeline parallel; "
        "--config-name=ppo_megatron_trainer).",
        choices=STRATEGIES,
        hardware_values=STRATEGIES_NOT_IN_THIS_BUILD,
        default="fsdp",
    )
    ppo_mini_batch_size: int = doc(
        "Prompts per optimizer step (times rollout.n sequences, split over ranks).", default=256
    )
    ppo_micro_batch_size: int | None = doc(
        "Global micro-batch (sequences).",
        status=DEPRECATED,
        replacement="use ppo_micro_batch_size_per_gpu",
        default=None,
    )
    ppo_micro_batch_size_per_gpu: int | None = doc(
        "Sequences per forward/backward on one rank (gradient accumulation); required unless use_dynamic_bsz.",
        default=None,
    )
    use_dynamic_bsz: bool = doc("Pack micro-batches by token count instead of a fixed size.", default=False)
    ppo_max_token_len_per_gpu: int = doc(
        "Token budget of one packed micro-batch (with use_dynamic_bsz).", default=16384
    )
    clip_ratio: float = doc("PPO clip range epsilon (used where the low/high values are null).", default=0.2)
    clip_ratio_low: float | None = doc("Lower clip epsilon: ratio >= 1 - clip_ratio_low.", default=0.2)
    clip_ratio_high: float | None = doc(
        "Upper clip epsilon: ratio <= 1 + clip_ratio_high (DAPO clip-higher).", default=0.2
    )
    tau_pos: float = doc("SAPO's smoothing temperature for positive advantages.", default=1.0)
    tau_neg: float = doc("SAPO's smoothing temperature for negative advantages.", default=1.05)
    freeze_vision_tower: bool = doc(
        "Freeze a vision-language model's vision tower (`model.visual`): no gradient, no optimizer state, its "
        "weights stay as loaded (FSDP; an error for a model without one).",
        default=False,
    )
    policy_loss: PolicyLossConfig = doc("Policy loss variant.", default_factory=PolicyLossConfig)
    clip_ratio_c: float = doc("Dual-clip PPO bound for negative advantages (> 1).", default=3.0)
    loss_agg_mode: str = doc(
        "How token losses are averaged into the batch loss.", choices=LOSS_AGG_MODES, default="token-mean"
    )
    loss_scale_factor: float | None = doc(
        "Divisor of seq-mean-token-sum-norm (null: the response length).", default=None
    )
    entropy_coeff: float = doc("Weight of the entropy bonus (0 disables it).", default=0)
    calculate_entropy: bool = doc(
        "Compute the policy's entropy in the update's forward (reported as a metric) even without an entropy bonus.",
        default=False,
    )
    use_kl_loss: bool = doc(
        "Add a KL(policy || reference) term to the loss (GRPO-style); needs the reference model.", default=False
    )
    use_prefix_grouper: bool = doc(
        f"Upstream's shared-prefix forward. {_SPEED}; here share_prompt_forward (on by default) does it.",
        status=IGNORED,
        default=False,
    )
    use_torch_compile: bool = doc(
        f"torch.compile the log-prob/entropy helpers. {_SPEED}: here they are chunked autograd functions that "
        "already bound memory, and are not compiled.",
        status=IGNORED,
        default=True,
    )
    kl_loss_coef: float = doc("Weight of the KL loss.", default=0.001)
    kl_loss_type: str = doc("KL estimator of the KL loss.", choices=KL_PENALTIES, default="low_var_kl")
    ppo_epochs: int = doc("Passes over each batch.", default=1)
    shuffle: bool = doc("Shuffle mini-batches between PPO epochs.", default=False)
    data_loader_seed: int | None = doc("Seed of that shuffle (null: 0).", default=42)
    checkpoint: CheckpointConfig = doc("Checkpoint contents.", default_factory=CheckpointConfig)
    optim: OptimizerConfig = doc("Optimizer and schedule.", default_factory=OptimizerConfig)
    use_fused_kernels: bool = doc(
        "Fused log-prob/entropy (follows the model's; either turns it on): see model.use_fused_kernels.",
        default=False,
    )
    profiler: ProfilerConfig = doc("Profiling of the updates.", default_factory=ProfilerConfig)
    router_replay: RouterReplayConfig = doc("Mixture-of-experts routing replay.", default_factory=RouterReplayConfig)
    qat: QATEngineConfig = doc(
        "Quantization-aware training of the policy (not in this build; see fsdp_config.qat).",
        optional=True,
        default_factory=QATEngineConfig,
    )
    tis_imp_ratio_cap: float = doc(
        "Ours. Truncated importance sampling against the rollout engine's log-probs: each token's loss is weighted "
        "by min(pi_old / pi_rollout, cap). -1 (or any value <= 0) turns it off; needs rollout.calculate_log_probs=true.",
        default=-1,
    )
    recompute_log_prob: bool = doc(
        "Ours. Always run the separate old-log-prob forward. Off: a strictly on-policy step (ppo_epochs=1, "
        "ppo_mini_batch_size=data.train_batch_size, no in-reward KL, no rollout log-probs) reuses the "
        "update's own detached log-probs instead (identical gradient, one forward pass fewer).",
        default=False,
    )
    skip_zero_advantage_step: bool = doc(
        "Ours. Skip the optimizer step of a mini-batch whose advantages are all zero on every rank and that has no "
        "KL or entropy term (its gradient is zero, but AdamW's momentum would still move the weights).",
        default=True,
    )
    skip_zero_advantage_rows: bool = doc(
        "Ours. Leave rows whose advantages are all zero out of the update's forward and backward passes when their "
        "loss is exactly zero: policy loss vanilla, gspo or gpg, no KL loss, no entropy bonus. The loss is still "
        "normalised over the whole mini-batch, so the gradient is unchanged (to float rounding); GRPO groups whose "
        "samples all score the same are such rows. actor/zero_adv_rows_skipped reports the fraction; "
        "actor/pg_clipfrac, actor/ppo_kl and the on-policy actor/entropy then cover the trained rows.",
        default=True,
    )
    share_prompt_forward: bool = doc(
        "Ours. Forward each distinct prompt of a micro-batch once (GRPO repeats every prompt rollout.n times) and "
        "run the responses on its KV cache expanded to the group's rows; also for old and reference log-probs. Same "
        "log-probs and gradients as one forward per sample, to float rounding; about 1.5-2.8x faster updates on "
        "the bundled task. Taken when at most half a micro-batch's prompts are distinct (on any rank); not with "
        "use_remove_padding or gradient checkpointing, where the per-sample forward runs.",
        default=True,
    )

    def __post_init__(self):
        for key in ("ppo_mini_batch_size", "ppo_epochs"):
            value = getattr(self, key)
            if value < 1:
                raise ValueError(f"actor.{key}={value} must be at least 1")
        if self.clip_ratio_c <= 1:
            raise ValueError(f"actor.clip_ratio_c={self.clip_ratio_c} must be > 1 (dual-clip bound; 3.0 is typical)")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(
                f"Invalid loss_agg_mode: actor.loss_agg_mode={self.loss_agg_mode!r}; use one of: "
                f"{', '.join(LOSS_AGG_MODES)}"
            )
        # Last, and not starting with "actor.": the validator reports these with the batch arithmetic
        # (validate_batches._check_micro, which names the full keys), so they are not reported twice.
        self._check_micro_batch()

    def _check_micro_batch(self) -> None:
        """Exactly one micro-batch spelling unless micro-batches are packed by tokens (upstream's rule)."""
        if self.use_dynamic_bsz:
            return
        mbs, per_gpu = self.ppo_micro_batch_size, self.ppo_micro_batch_size_per_gpu
        if mbs is not None and per_gpu is not None:
            raise ValueError(
                f"You have set both actor.ppo_micro_batch_size={mbs} and actor.ppo_micro_batch_size_per_gpu="
                f"{per_gpu}, which say the same thing two ways; keep only ppo_micro_batch_size_per_gpu "
                "(ppo_micro_batch_size is deprecated)"
            )
        if mbs is None and per_gpu is None:
            raise ValueError(
                "Please set at least one of actor.ppo_micro_batch_size_per_gpu (sequences per forward/backward "
                "on one rank) or the deprecated actor.ppo_micro_batch_size, or set actor.use_dynamic_bsz=true "
                "to pack micro-batches by token count"
            )

    def validate(self, n_gpus: int, train_batch_size: int, model_config: dict | None = None) -> None:
        """Upstream's check of this section against the run: `n_gpus` ranks and `train_batch_size`
        prompts per step (`model_config`, the model section, is read by the FSDP subclass).

        The trainer runs the full check before Ray starts (`verl.trainer.config.validate_ppo_config`);
        this is the part upstream's workers call with the run's numbers. Raises ValueError."""
        del model_config  # the FSDP actor's check reads it
        if self.use_dynamic_bsz:
            return
        if train_batch_size < self.ppo_mini_batch_size:
            raise ValueError(
                f"train_batch_size ({train_batch_size}) must be >= actor.ppo_mini_batch_size "
                f"({self.ppo_mini_batch_size}): a mini-batch is a slice of the step's batch (both count prompts); "
                f"lower actor.ppo_mini_batch_size or raise data.train_batch_size"
            )
        mbs = self.ppo_micro_batch_size
        if mbs is None:
            return
        if self.ppo_mini_batch_size % mbs:
            raise ValueError(
                f"actor.ppo_mini_batch_size ({self.ppo_mini_batch_size}) must be divisible by "
                f"actor.ppo_micro_batch_size ({mbs}), or gradient accumulation would drop or double-count sequences"
            )
        sp = self.get("ulysses_sequence_parallel_size", 1) or 1
        if mbs * sp < n_gpus:
            raise ValueError(
                f"actor.ppo_micro_batch_size ({mbs}) * ulysses_sequence_parallel_size ({sp}) must be >= n_gpus "
                f"({n_gpus}): the global micro-batch is split over the ranks, so each needs at least one sequence; "
                "set actor.ppo_micro_batch_size_per_gpu instead"
            )


@dataclass
class FSDPActorConfig(ActorConfig):
    """The policy trained with FSDP2 (actor/dp_actor.yaml; strategy fsdp or fsdp2)."""

    optim: FSDPOptimizerConfig = doc("Optimizer and schedule.", default_factory=FSDPOptimizerConfig)

    grad_clip: float = doc("FSDP: clip the global gradient norm to this value (see optim.clip_grad).", default=1.0)
    ulysses_sequence_parallel_size: int = doc(
        "Ulysses sequence-parallel group size: > 1 splits each packed sequence across this many ranks "
        "(needs use_remove_padding; see docs/sequence_parallel.md).",
        default=1,
    )
    entropy_from_logits_with_chunking: bool = doc(
        f"Compute entropy in chunks. {_SPEED}.", status=IGNORED, default=False
    )
    entropy_from_logits_chunk_size: int = doc(
        f"Rows per chunk of the entropy computed from the logits (the engine's section follows it). {_SPEED}: "
        "the entropy here is chunked by memory size (about 256 MiB of float32 logits per chunk).",
        status=IGNORED,
        default=2048,
    )
    entropy_checkpointing: bool = doc(f"Recompute entropy in backward. {_SPEED}.", status=IGNORED, default=False)
    pad_to_length: bool = doc(
        f"Pad packed micro-batches to a multiple of fsdp_config.pad_to_length_bucket. {_SPEED}.",
        status=IGNORED,
        default=False,
    )
    use_remove_padding: bool = doc(
        "FSDP: pack sequences without padding in the actor's forward passes (follows the model's).",
        default=False,
    )
    calculate_sum_pi_squared: bool = doc(
        "Compute the sum of squared token probabilities (for adv_estimator=optimal_token_baseline).",
        default=False,
    )
    sum_pi_squared_checkpointing: bool = doc(
        f"Recompute that sum in backward. {_SPEED}.", status=IGNORED, default=False
    )
    fsdp_config: FSDPEngineConfig = doc("FSDP engine (strategy fsdp or fsdp2).", default_factory=FSDPEngineConfig)

    def validate(self, n_gpus: int, train_batch_size: int, model_config: dict | None = None) -> None:
        """`ActorConfig.validate`, and upstream's FSDP rule: Ulysses sequence parallelism needs the packed
        layout, i.e. `use_remove_padding` on in `model_config` (the model section) or in this section."""
        super().validate(n_gpus, train_batch_size, model_config)
        if self.strategy not in ("fsdp", "fsdp2") or model_config is None:
            return
        sp, key = role_sp(self, "actor")
        if sp > 1 and not (model_config.get("use_remove_padding", False) or self.use_remove_padding):
            raise ValueError(
                f"{key}={sp}: when using sequence parallelism for actor/ref policy, you must enable "
                "`use_remove_padding` (model.use_remove_padding=true): the sequences are split in their packed layout"
            )


@dataclass
class McoreActorConfig(ActorConfig):
    """The policy trained with Megatron-core (actor/megatron_actor.yaml)."""

    optim: McoreOptimizerConfig = doc("Optimizer and schedule.", default_factory=McoreOptimizerConfig)

    strategy: str = doc(
        "Training backend (see ActorConfig.strategy).",
        choices=STRATEGIES,
        hardware_values=STRATEGIES_NOT_IN_THIS_BUILD,
        default="megatron",
    )
    megatron: McoreEngineConfig = doc(
        "Megatron-core parallelism (strategy megatron).", default_factory=McoreEngineConfig
    )
    load_weight: bool = doc(
        "Megatron: start from the weights at model.path (or megatron.dist_checkpointing_path); false: megatron's "
        "random initialisation (normal, std init_method_std), seeded by megatron.seed, no weights read. Upstream "
        "v0.9.0 dropped the key; kept so that older scripts run.",
        optional=True,
        default=True,
    )
    entropy_from_logits_with_chunking: bool = doc(
        f"Compute entropy in chunks (here always). {_SPEED}.", status=IGNORED, default=False
    )
    entropy_from_logits_chunk_size: int = doc(
        f"Rows per chunk of the entropy computed from the logits (the engine's section follows it). {_SPEED}: "
        "the entropy here is chunked by memory size (about 256 MiB of float32 logits per chunk).",
        status=IGNORED,
        default=2048,
    )
    calculate_sum_pi_squared: bool = doc(
        "Compute the sum of squared token probabilities (for adv_estimator=optimal_token_baseline).",
        default=False,
    )


@dataclass
class RefConfig(BaseConfig):
    """Reference policy (frozen copy of the initial policy) for the KL terms."""

    rollout_n: int = doc("Responses per prompt (follows actor_rollout_ref.rollout.n).", default=1)
    strategy: str = doc(
        "Backend of the reference model (the actor's: it lives in the actor's workers).",
        choices=STRATEGIES,
        hardware_values=STRATEGIES_NOT_IN_THIS_BUILD,
        default="fsdp",
    )
    use_torch_compile: bool = doc(
        f"torch.compile the log-prob helpers (follows the actor's). {_SPEED}.", status=IGNORED, default=True
    )
    log_prob_micro_batch_size: int | None = doc(
        "Global micro-batch.", status=DEPRECATED, replacement="use log_prob_micro_batch_size_per_gpu", default=None
    )
    log_prob_micro_batch_size_per_gpu: int | None = doc("Sequences per forward pass on one rank.", default=None)
    log_prob_use_dynamic_bsz: bool = doc("Pack forward micro-batches by token count.", default=False)
    log_prob_max_token_len_per_gpu: int = doc("Token budget of one packed forward micro-batch.", default=16384)
    profiler: ProfilerConfig = doc("Profiling of the reference forward passes.", default_factory=ProfilerConfig)
    router_replay: RouterReplayConfig = doc("Mixture-of-experts routing replay.", default_factory=RouterReplayConfig)
    fsdp_config: FSDPEngineConfig = doc(
        "FSDP engine (strategy fsdp or fsdp2).", optional=True, default_factory=FSDPEngineConfig
    )
    ulysses_sequence_parallel_size: int = doc(
        "Ulysses sequence-parallel group size of the reference forward (must equal the actor's).",
        optional=True,
        default=1,
    )
    entropy_from_logits_with_chunking: bool = doc(
        "Compute entropy in chunks.", status=IGNORED, optional=True, default=False
    )
    entropy_checkpointing: bool = doc("Recompute entropy in backward.", status=IGNORED, optional=True, default=False)
    entropy_from_logits_chunk_size: int = doc(
        "Rows per chunk of the reference's entropy (memory only; the reference computes no entropy here).",
        status=IGNORED,
        optional=True,
        default=2048,
    )
    pad_to_length: bool = doc(
        f"Pad packed micro-batches (follows the actor's). {_SPEED}.", status=IGNORED, optional=True, default=False
    )
    megatron: McoreEngineConfig = doc(
        "Megatron-core parallelism (strategy megatron).", optional=True, default_factory=McoreEngineConfig
    )
    load_weight: bool = doc(
        "Megatron: start from the weights at model.path (false: random initialisation, seeded by megatron.seed); "
        "must equal the actor's, since the reference is the initial policy. Upstream v0.9.0 dropped the key; kept "
        "so that older scripts run.",
        optional=True,
        default=True,
    )
