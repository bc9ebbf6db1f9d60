"""Typed optimizer sections, with upstream verl's names and defaults: `OptimizerConfig` (the keys every
engine reads), `FSDPOptimizerConfig` (optim/fsdp.yaml's `_target_`) and `McoreOptimizerConfig`
(optim/megatron.yaml's).

The schema declares a role's `optim` field by the base class; the `_target_` each trainer's YAML
holds picks the subclass whose keys the section is checked against and built as (one resolver,
`verl.utils.config.target_class`). Each field carries its runtime default (the YAML holds the same
value) and the `doc(...)` metadata the validator and docgen read. Checks that need only this
section (a positive learning rate, a warm-up ratio in [0, 1]) run in `__post_init__`; a role's
`grad_clip` against its `optim.clip_grad` spans two sections and stays in validate.py.

Deliberately left out: upstream's deprecated `optim.grad_clip` alias (its YAML does not hold it; the
role section's `grad_clip` is the older spelling here, so a second alias would only be a second way
to disagree), and `McoreOptimizerConfig.lr_decay_style`'s dataclass default `linear` (upstream's
YAML says `constant`, and only constant and cosine schedules exist here: the YAML's value is the
default).

`VeOmniOptimizerConfig` is upstream's optimizer section of the VeOmni engine, which is not in this
build: it constructs as upstream's (see `VeOmniEngineConfig`). `build_optimizer(parameters, config)`
is upstream's entry point to build the torch optimizer a section names; it is
`verl.utils.optim.build_optimizer`, the function the engines call (imported when called: it needs
torch, which this module does not import).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from verl.base_config import BaseConfig
from verl.workers.config._fields import DEPRECATED, IGNORED, UNSUPPORTED, doc

__all__ = ["FSDPOptimizerConfig", "McoreOptimizerConfig", "OptimizerConfig", "VeOmniOptimizerConfig", "build_optimizer"]

LR_SCHEDULES = ("constant", "cosine")
# megatron-core OptimizerParamScheduler's wd_incr_style values
WEIGHT_DECAY_INCR_STYLES = ("constant", "linear", "cosine")


@dataclass
class OptimizerConfig(BaseConfig):
    """Optimizer and learning-rate schedule of one trained model: the keys both engines read."""

    # the trainer fills the schedule length in from the run length; the clip may follow grad_clip
    _mutable_fields: ClassVar[frozenset[str]] = frozenset({"clip_grad", "total_training_steps", "lr_warmup_steps"})

    lr: float = doc("Peak learning rate.", default=1e-3)
    lr_warmup_steps_ratio: float = doc("Warm-up length as a fraction of the total training steps.", default=0.0)
    total_training_steps: int = doc("Schedule length; -1 is filled in by the trainer from the run length.", default=-1)
    weight_decay: float = doc("AdamW decoupled weight decay.", default=0.01)
    lr_warmup_steps: int | None = doc(
        "Linear warm-up steps; null, 0 or negative defers to `lr_warmup_steps_ratio`.", default=-1
    )
    betas: list[float] = doc("AdamW (beta1, beta2).", default_factory=lambda: [0.9, 0.999])
    clip_grad: float = doc(
        "Clip the global gradient norm to this value: the Megatron roles' clip; an FSDP role clips to its own "
        "grad_clip, and this key, when set to something else than its default 1.0, replaces it (upstream's newer "
        "engine reads it; its default workers read grad_clip).",
        default=1.0,
    )

    def __post_init__(self):
        if not self.lr > 0:
            raise ValueError(
                f"optim.lr={self.lr} must be > 0: it is the peak learning rate; set a positive value such as 1e-6"
            )
        if not 0 <= self.lr_warmup_steps_ratio <= 1:
            raise ValueError(
                f"optim.lr_warmup_steps_ratio={self.lr_warmup_steps_ratio} must be between 0 and 1: it is a "
                "fraction of the training steps"
            )


@dataclass
class FSDPOptimizerConfig(OptimizerConfig):
    """An FSDP role's optimizer: any torch optimizer class by module and name, constant or cosine schedule."""

    optimizer: str = doc(
        "Optimizer class, looked up in optimizer_impl (a Megatron section names adam or sgd).", default="AdamW"
    )
    optimizer_impl: str = doc("Module the optimizer class is taken from.", default="torch.optim")
    min_lr_ratio: float | None = doc("Cosine schedule floor as a fraction of `lr` (null: 0).", default=None)
    num_cycles: float = doc("Number of cosine half-waves over training (0.5: one decay to the floor).", default=0.5)
    lr_scheduler_type: str = doc("Schedule after warm-up.", choices=LR_SCHEDULES, default="constant")
    warmup_style: str | None = doc(
        "Older spelling of lr_scheduler_type; wins when set.",
        choices=(None, *LR_SCHEDULES),
        status=DEPRECATED,
        replacement="use lr_scheduler_type",
        default=None,
    )
    override_optimizer_config: dict | None = doc("Keyword arguments merged into the optimizer's.", default=None)
    zero_indexed_step: bool = doc(
        "Step counting of the cosine schedule: true counts the first step as 0 (its lr is the warm-up's start); "
        "false as 1, so every step's lr is the next step's of the 0-indexed curve. The constant schedule ignores it, "
        "as upstream's.",
        default=True,
    )

    def __post_init__(self):
        super().__post_init__()
        for key in ("lr_scheduler_type", "warmup_style"):
            value = getattr(self, key)
            if value is not None and value not in LR_SCHEDULES:
                raise ValueError(f"optim.{key}={value!r} is not a schedule here; use one of: {', '.join(LR_SCHEDULES)}")
        if self.warmup_style is not None:  # upstream: the older key wins
            object.__setattr__(self, "lr_scheduler_type", self.warmup_style)


@dataclass
class McoreOptimizerConfig(OptimizerConfig):
    """A Megatron role's optimizer, in Megatron-core's spelling (`adam` is AdamW; `lr_decay_style` the schedule)."""

    optimizer: str = doc("Megatron's optimizer name: adam (with decoupled weight decay) or sgd.", default="adam")
    lr_warmup_init: float = doc("lr at the start of warm-up.", default=0.0)
    lr_decay_steps: int | None = doc("Steps the decay spans; null: the whole run.", default=None)
    lr_decay_style: str = doc(
        "Megatron's spelling of lr_scheduler_type (constant or cosine).", choices=LR_SCHEDULES, default="constant"
    )
    min_lr: float = doc("Absolute floor of the cosine decay (min_lr_ratio = min_lr / lr).", default=0.0)
    weight_decay_incr_style: str = doc(
        "Megatron's weight-decay schedule from its start to its end value over total_training_steps. Upstream "
        "starts and ends it at optim.weight_decay, so every style keeps the weight decay constant; so here.",
        choices=WEIGHT_DECAY_INCR_STYLES,
        default="constant",
    )
    lr_wsd_decay_style: str = doc(
        "Decay of the warmup-stable-decay schedule, read only with lr_decay_style=WSD (not available).",
        status=IGNORED,
        default="exponential",
    )
    lr_wsd_decay_steps: int | None = doc(
        "Decay steps of the WSD schedule (see lr_wsd_decay_style).", status=IGNORED, default=None
    )
    use_checkpoint_opt_param_scheduler: bool = doc(
        "On resume, take the lr and weight-decay schedule's settings (lr, warm-up, decay, total steps, weight "
        "decay) from the checkpoint instead of this section; false: this section's settings, at the checkpoint's "
        "step.",
        default=False,
    )
    use_precision_aware_optimizer: bool = doc(
        "Megatron's precision-aware optimizer (gradients and Adam moments in the dtypes below); not in this build: "
        "the Adam state is fp32.",
        status=UNSUPPORTED,
        neutral=False,
        optional=True,
        default=False,
    )
    main_grads_dtype: str = doc(
        "Dtype of the main gradients (precision-aware optimizer only).",
        status=UNSUPPORTED,
        neutral="fp32",
        optional=True,
        default="fp32",
    )
    exp_avg_dtype: str = doc(
        "Dtype of Adam's first moment (precision-aware optimizer only).",
        status=UNSUPPORTED,
        neutral="fp32",
        optional=True,
        default="fp32",
    )
    exp_avg_sq_dtype: str = doc(
        "Dtype of Adam's second moment (precision-aware optimizer only).",
        status=UNSUPPORTED,
        neutral="fp32",
        optional=True,
        default="fp32",
    )
    use_layer_wise_distributed_optimizer: bool = doc(
        "Megatron's layer-wise sharding of the optimizer state (for Muon). Not in this build.",
        status=UNSUPPORTED,
        neutral=False,
        optional=True,
        default=False,
    )
    muon_momentum: float = doc(
        "Muon (optimizer=muon, not in this build): Momentum.",
        status=UNSUPPORTED,
        neutral=0.95,
        optional=True,
        default=0.95,
    )
    muon_nesterov: bool = doc(
        "Muon (optimizer=muon, not in this build): Nesterov momentum.",
        status=UNSUPPORTED,
        neutral=False,
        optional=True,
        default=False,
    )
    muon_split_qkv: bool = doc(
        "Muon (optimizer=muon, not in this build): Orthogonalise q, k and v separately.",
        status=UNSUPPORTED,
        neutral=True,
        optional=True,
        default=True,
    )
    muon_scale_mode: str = doc(
        "Muon (optimizer=muon, not in this build): Update scaling.",
        status=UNSUPPORTED,
        neutral="spectral",
        optional=True,
        default="spectral",
    )
    muon_coefficient_type: str = doc(
        "Muon (optimizer=muon, not in this build): Newton-Schulz coefficients.",
        status=UNSUPPORTED,
        neutral="quintic",
        optional=True,
        default="quintic",
    )
    muon_num_ns_steps: int = doc(
        "Muon (optimizer=muon, not in this build): Newton-Schulz iterations.",
        status=UNSUPPORTED,
        neutral=5,
        optional=True,
        default=5,
    )
    muon_tp_mode: str = doc(
        "Muon (optimizer=muon, not in this build): Tensor-parallel mode.",
        status=UNSUPPORTED,
        neutral="blockwise",
        optional=True,
        default="blockwise",
    )
    muon_fp32_matmul_prec: str = doc(
        "Muon (optimizer=muon, not in this build): fp32 matmul precision.",
        status=UNSUPPORTED,
        neutral="medium",
        optional=True,
        default="medium",
    )
    muon_extra_scale_factor: float = doc(
        "Muon (optimizer=muon, not in this build): Extra update scale.",
        status=UNSUPPORTED,
        neutral=1.0,
        optional=True,
        default=1.0,
    )
    muon_scalar_optimizer: str = doc(
        "Muon (optimizer=muon, not in this build): Optimizer of the non-matrix parameters.",
        status=UNSUPPORTED,
        neutral="adam",
        optional=True,
        default="adam",
    )
    muon_match_adamw_update_rms: bool = doc(
        "Muon (optimizer=muon, not in this build): Match AdamW's update RMS.",
        status=UNSUPPORTED,
        neutral=False,
        optional=True,
        default=False,
    )
    override_optimizer_config: dict | None = doc("Keyword arguments merged into the optimizer's.", default_factory=dict)

    def __post_init__(self):
        super().__post_init__()
        if self.weight_decay_incr_style not in WEIGHT_DECAY_INCR_STYLES:
            raise ValueError(
                f"optim.weight_decay_incr_style={self.weight_decay_incr_style!r} is not megatron's; use one of: "
                f"{', '.join(WEIGHT_DECAY_INCR_STYLES)}"
            )
        if self.lr_decay_style not in LR_SCHEDULES:
            raise ValueError(
                f"optim.lr_decay_style={self.lr_decay_style!r} is not a schedule here; use one of: "
                f"{', '.join(LR_SCHEDULES)}"
            )


@dataclass
class VeOmniOptimizerConfig(OptimizerConfig):
    """Upstream's optimizer section of the VeOmni engine (optim/veomni.yaml), with its fields and dataclass
    defaults; the engine is not in this build (see `VeOmniEngineConfig`)."""

    optimizer: str = doc("VeOmni's optimizer name.", default="adamw")
    lr_min: float = doc("Floor of the decayed learning rate.", default=0.0)
    lr_start: float = doc("Learning rate at the start of warm-up.", default=0.0)
    lr_decay_ratio: float = doc("Fraction of the run the decay spans.", default=1.0)
    lr_scheduler_type: str = doc("Schedule after warm-up.", choices=LR_SCHEDULES, default="constant")
    override_optimizer_config: dict | None = doc("Keyword arguments merged into the optimizer's.", default=None)

    def __post_init__(self):
        super().__post_init__()
        if self.lr_scheduler_type not in LR_SCHEDULES:
            raise ValueError(
                f"optim.lr_scheduler_type={self.lr_scheduler_type!r} is not a schedule here; use one of: "
                f"{', '.join(LR_SCHEDULES)}"
            )


def build_optimizer(parameters, config: OptimizerConfig):
    """The torch optimizer `config` names, over `parameters` (tensors or param-group dicts).

    Upstream's signature and behaviour: the class `config.optimizer` in the module `config.optimizer_impl`
    (an FSDP section: `AdamW` in `torch.optim` by default; a Megatron one's `adam` / `sgd` are torch's
    AdamW / SGD) with `lr`, `weight_decay`, `betas` (Adam-family names) and `override_optimizer_config`
    merged over them. A missing package or class is an error naming it. torch's Adam/AdamW run fused
    where every parameter allows (same update, one kernel per parameter; see verl.utils.optim).
    """
    from verl.utils.optim import build_optimizer as _build

    return _build(parameters, config)
