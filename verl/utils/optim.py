"""The optimizer, its lr schedule and the gradient-clipping norm from an `optim` config section
(upstream's keys, FSDP and Megatron spellings).

Optimizer (`build_optimizer`): `optim.optimizer` names a class in the module `optim.optimizer_impl`
(upstream's defaults `AdamW` in `torch.optim`; e.g. `_AdamW` in `torchao.optim`, `AdamW8bit` in
`bitsandbytes.optim`, imported only when named, with an error naming the package when it is not
installed). Arguments: `lr`, `weight_decay`, `betas` (for Adam-family names), `eps` when given, then
`optim.override_optimizer_config` merged over them (any constructor argument of the class). A
Megatron section names its optimizer without a module (`optimizer: adam` or `sgd`): `adam` is Adam
with decoupled weight decay, as Megatron's own, so torch's AdamW; `sgd` torch's SGD.

Schedule (`build_lr_scheduler`), stepped once per training step, two families:

- FSDP (`lr_scheduler_type`, or its older name `warmup_style`, which wins when set, as upstream):
  linear warm-up from 0 over `lr_warmup_steps` (when > 0, else `lr_warmup_steps_ratio *
  total_training_steps`), then `constant`, or `cosine` decay to `min_lr_ratio * lr` over the
  remaining steps with `num_cycles` (0.5: one half cosine).
- Megatron (`lr_decay_style`, in a section without the FSDP keys): Megatron-core's
  `OptimizerParamScheduler` curve: warm-up from `lr_warmup_init` to `lr` over `lr_warmup_steps`
  (else `lr_warmup_steps_ratio * lr_decay_steps`), then `constant`, `linear`, `cosine`,
  `inverse_square_root` (also spelt `inverse-square-root`) or `WSD` (hold, then anneal over
  `lr_wsd_decay_steps` by `lr_wsd_decay_style`) from `lr` to `min_lr` over `lr_decay_steps`
  (default `total_training_steps`), `min_lr` after. `weight_decay_incr_style` (constant, linear,
  cosine) is checked: upstream gives megatron's scheduler `optim.weight_decay` as both the start and
  the end of the weight-decay ramp, so every style keeps it constant, which the optimizer's own
  `weight_decay` already is.

Both are `LambdaLR`s, so their whole state is a step counter that checkpoints restore exactly.

The Megatron engine's schedule (`MegatronParamScheduler`) is the same lr curve (either family) plus
megatron's weight-decay ramp (`megatron_weight_decay`), set on the optimizer every step. Its state
also carries the settings it was built from, so that `optim.use_checkpoint_opt_param_scheduler=true`
resumes with the checkpoint's schedule (megatron's `use_checkpoint_opt_param_scheduler`); without it
the section's settings continue from the checkpoint's step.
(Upstream exposes these schedule functions, and `get_wsd_schedule_with_warmup`, from
`verl.utils.torch_functional`, which re-exports them.)

Gradient clipping (`grad_clip`): upstream names the max gradient norm twice, the older
`actor.grad_clip` / `critic.grad_clip` and the newer `optim.clip_grad`. They are one setting: when
they disagree, the one changed from the default 1.0 wins, and two different non-default values
are an error.
"""

from __future__ import annotations

import importlib
import inspect
import math
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

__all__ = [
    "DEFAULT_CLIP_GRAD",
    "LR_DECAY_STYLES",
    "LR_SCHEDULER_TYPES",
    "WEIGHT_DECAY_INCR_STYLES",
    "MegatronParamScheduler",
    "build_lr_scheduler",
    "build_optimizer",
    "get_constant_schedule_with_warmup",
    "get_cosine_schedule_with_warmup",
    "get_megatron_schedule",
    "get_wsd_schedule_with_warmup",
    "grad_clip",
    "local_optimizer",
    "megatron_weight_decay",
    "optimizer_class",
]

LR_SCHEDULER_TYPES = ("constant", "cosine")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse_square_root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WEIGHT_DECAY_INCR_STYLES = ("constant", "linear", "cosine")
DEFAULT_CLIP_GRAD = 1.0
# Megatron sections name the optimizer without a module; these are what Megatron-core builds.
_MEGATRON_OPTIMIZERS = {"adam": "AdamW", "sgd": "SGD"}


def _get(cfg, key, default=None):
    if cfg is None:
        return default
    value = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    return default if value is None else value


def _has(cfg, key) -> bool:
    return _get(cfg, key) is not None


# ==============================================================================================
# Optimizer
# ==============================================================================================


def optimizer_class(optim_config) -> type[torch.optim.Optimizer]:
    """The optimizer class `optim.optimizer` / `optim.optimizer_impl` name (see the module docstring)."""
    name = str(_get(optim_config, "optimizer", "AdamW"))
    impl = _get(optim_config, "optimizer_impl")
    if impl is None:
        if name.lower() not in _MEGATRON_OPTIMIZERS and name not in vars(torch.optim):
            raise ValueError(
                f"optim.optimizer={name!r} without optim.optimizer_impl: a Megatron section names `adam` or `sgd`, an "
                "FSDP one a class and its module, e.g. optim.optimizer=AdamW optim.optimizer_impl=torch.optim"
            )
        return getattr(torch.optim, _MEGATRON_OPTIMIZERS.get(name.lower(), name))
    try:
        module = importlib.import_module(str(impl))
    except ImportError as err:
        package = str(impl).split(".")[0]
        raise ImportError(
            f"optim.optimizer_impl={impl!r} cannot be imported ({err}); install the package that provides it "
            f"(pip install {package}) or use torch's: optim.optimizer=AdamW optim.optimizer_impl=torch.optim"
        ) from err
    cls = getattr(module, name, None)
    if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)):
        available = sorted(
            n for n, v in vars(module).items() if inspect.isclass(v) and issubclass(v, torch.optim.Optimizer)
        )
        raise ValueError(
            f"optim.optimizer={name!r} is not an optimizer class of {impl!r}; it has: {', '.join(available) or 'none'}"
        )
    return cls


def _optimizer_kwargs(cls: type, optim_config) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "lr": float(_get(optim_config, "lr", 1e-6)),
        "weight_decay": float(_get(optim_config, "weight_decay", 1e-2)),
    }
    name = cls.__name__.lower()
    if "adam" in name or "ademamix" in name:
        kwargs["betas"] = tuple(float(b) for b in _get(optim_config, "betas", (0.9, 0.999)))
        if _has(optim_config, "eps"):
            kwargs["eps"] = float(_get(optim_config, "eps"))
    overrides = _get(optim_config, "override_optimizer_config") or {}
    if hasattr(overrides, "items"):
        overrides = dict(overrides.items())
    if not isinstance(overrides, dict):
        raise ValueError(
            f"optim.override_optimizer_config={overrides!r} must be a mapping of {cls.__name__} arguments, "
            "e.g. {eps: 1e-6}"
        )
    accepted = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    unknown = sorted(k for k in overrides if k not in accepted and not takes_any)
    if unknown:
        valid = sorted(k for k in accepted if k not in ("self", "params"))
        raise ValueError(
            f"optim.override_optimizer_config has {unknown}, which {cls.__module__}.{cls.__name__} does not take; "
            f"its arguments: {', '.join(valid)}"
        )
    kwargs.update(overrides)
    return kwargs


def build_optimizer(
    parameters: Iterable[torch.nn.Parameter], optim_config, shard_state_over=None
) -> torch.optim.Optimizer:
    """The configured optimizer over `parameters` (FSDP2 DTensor parameters work unchanged).

    torch's Adam/AdamW run fused (one kernel per parameter) when every parameter is a
    floating-point tensor on CPU or CUDA and `override_optimizer_config` does not choose an
    implementation: torch's default on CPU is a per-parameter Python loop of about ten ops, each
    dispatched through DTensor under FSDP2. Measured on the bundled model (2 gloo ranks, 50
    parameters): 2.4 ms per step fused against 20.9 ms for the loop (7.6 ms with foreach).

    `shard_state_over`: a process group of data-parallel replicas (every rank holding the same
    parameters, each with the averaged gradient). With more than one rank the optimizer state is
    split over them by whole parameters (ZeRO stage 1, torch's `ZeroRedundancyOptimizer`): each rank
    steps only the parameters it owns and broadcasts them to the others. The optimizer must be
    elementwise (Adam's family, SGD) for the result to equal the unsharded step; `local_optimizer`
    gives the optimizer holding this rank's part.
    """
    from verl.utils.device import has_fused_adamw

    cls = optimizer_class(optim_config)
    kwargs = _optimizer_kwargs(cls, optim_config)
    params = list(parameters)
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    chooses_kernel = {"fused", "foreach"} & set(kwargs)
    if cls in (torch.optim.AdamW, torch.optim.Adam) and not chooses_kernel and tensors:
        kwargs["fused"] = all(has_fused_adamw(p) for p in tensors) or None
    if shard_state_over is not None and torch.distributed.get_world_size(shard_state_over) > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=shard_state_over, **kwargs)
    return cls(params, **kwargs)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose `state` holds this rank's moments: `optimizer` itself, or the local
    optimizer of a `ZeroRedundancyOptimizer` (whose own `state` stays empty)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def grad_clip(section, role: str = "actor") -> float | None:
    """The max gradient norm of a role's section (`actor_rollout_ref.actor` or `critic`), from its
    `grad_clip` and its `optim.clip_grad` (see the module docstring); None: no clipping."""
    older = _get(section, "grad_clip")
    newer = _get(_get(section, "optim"), "clip_grad")
    if older is None or newer is None or float(older) == float(newer):
        value = newer if newer is not None else older
        return None if value is None else float(value)
    changed = [v for v in (older, newer) if float(v) != DEFAULT_CLIP_GRAD]
    if len(changed) == 2:
        raise ValueError(
            f"{role}.grad_clip={older} and {role}.optim.clip_grad={newer} disagree; they are the same setting "
            "(upstream's older and newer name of the max gradient norm): set one of them, or both to the same value"
        )
    return float(changed[0])


# ==============================================================================================
# Schedules
# ==============================================================================================


def get_constant_schedule_with_warmup(
    optimizer: torch.optim.Optimizer, num_warmup_steps: int, last_epoch: int = -1
) -> LambdaLR:
    """Linear warm-up from 0 to the base lr over `num_warmup_steps`, then constant."""
    return LambdaLR(optimizer, _constant_factor(num_warmup_steps), last_epoch)


def get_cosine_schedule_with_warmup(
    optimizer: torch.optim.Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
    last_epoch: int = -1,
    init_lr_ratio: float | None = None,
    zero_indexed_step: bool = True,
) -> LambdaLR:
    """Linear warm-up from `init_lr_ratio * lr` (None: 0), then cosine decay from the base lr to
    `min_lr_ratio * lr` (None: 0).

    With the default half cycle the lr reaches `min_lr_ratio * lr` at `num_training_steps`.
    `zero_indexed_step=False` counts the scheduler's steps from 1 (`optim.zero_indexed_step`): the
    lr at scheduler step s is the 0-indexed curve's at s + 1.
    """
    factor = _cosine_factor(
        num_warmup_steps,
        num_training_steps,
        0.0 if min_lr_ratio is None else min_lr_ratio,
        num_cycles,
        init_lr_ratio,
        zero_indexed_step,
    )
    return LambdaLR(optimizer, factor, last_epoch)


def get_wsd_schedule_with_warmup(
    optimizer: torch.optim.Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
    last_epoch: int = -1,
    stable_ratio: float = 0.9,
) -> LambdaLR:
    """Warmup-stable-decay: linear warm-up from 0 over `num_warmup_steps`, the base lr held for
    `int(stable_ratio * (num_training_steps - num_warmup_steps))` steps, then a cosine decay to
    `min_lr_ratio * lr` over the remaining steps, `min_lr_ratio * lr` from `num_training_steps` on.
    `stable_ratio=0` is the cosine schedule. (`_cosine_factor` checks `min_lr_ratio`.)"""
    return LambdaLR(
        optimizer, _wsd_factor(num_warmup_steps, num_training_steps, min_lr_ratio, num_cycles, stable_ratio), last_epoch
    )


def _wsd_factor(
    num_warmup_steps: int, num_training_steps: int, min_lr_ratio: float, num_cycles: float, stable_ratio: float
):
    if not 0.0 <= stable_ratio <= 1.0:
        raise ValueError(f"stable_ratio must be in [0, 1] (the share of post-warm-up steps held), got {stable_ratio}")
    remaining = max(0, num_training_steps - num_warmup_steps)
    num_stable = int(remaining * stable_ratio)
    decay = _cosine_factor(0, remaining - num_stable, min_lr_ratio, num_cycles)

    def factor(step: int) -> float:
        if step < num_warmup_steps:
            return float(step) / float(max(1, num_warmup_steps))
        if step < num_warmup_steps + num_stable:
            return 1.0
        if step < num_training_steps:
            return decay(step - num_warmup_steps - num_stable)
        return min_lr_ratio

    return factor


def _megatron_lr(
    step: int,
    max_lr: float,
    min_lr: float,
    init_lr: float,
    warmup_steps: int,
    decay_steps: int,
    style: str,
    wsd_decay_steps: int | None,
    wsd_style: str,
) -> float:
    """Megatron-core's learning rate at `step` (its `OptimizerParamScheduler.get_lr`)."""
    if warmup_steps > 0 and step <= warmup_steps:
        return init_lr + (max_lr - init_lr) * step / warmup_steps
    if style == "constant":
        return max_lr
    if step > decay_steps:
        return min_lr
    if style == "inverse_square_root":
        return max(min_lr, max_lr * math.sqrt(max(warmup_steps, 1)) / math.sqrt(max(step, 1)))
    ratio = (step - warmup_steps) / (decay_steps - warmup_steps)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:  # WSD: hold the peak, then anneal over the last wsd_decay_steps
        anneal_start = decay_steps - wsd_decay_steps
        if step <= anneal_start:
            coeff = 1.0
        else:
            r = (step - anneal_start) / wsd_decay_steps
            coeff = {
                "linear": 1.0 - r,
                "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                "exponential": 2.0 * 0.5**r - 1.0,
                "minus_sqrt": 1.0 - math.sqrt(r),
            }[wsd_style]
    return min_lr + coeff * (max_lr - min_lr)


def get_megatron_schedule(optimizer: torch.optim.Optimizer, optim_config, last_epoch: int = -1) -> LambdaLR:
    """Megatron's schedule (`lr_decay_style` and friends, see the module docstring) as a LambdaLR
    over the optimizer's base lr (`optim.lr`)."""
    return LambdaLR(optimizer, _megatron_factor(optim_config), last_epoch)


def _megatron_factor(optim_config):
    """Megatron's lr at a step over `optim.lr` (see `get_megatron_schedule`)."""
    style = str(_get(optim_config, "lr_decay_style", "constant"))
    style = "inverse_square_root" if style == "inverse-square-root" else style
    if style not in LR_DECAY_STYLES:
        raise ValueError(f"optim.lr_decay_style={style!r} is not one of {list(LR_DECAY_STYLES)}")
    _weight_decay_incr_style(optim_config)
    max_lr = float(_get(optim_config, "lr", 1e-6))
    min_lr = float(_get(optim_config, "min_lr", 0.0))
    init_lr = float(_get(optim_config, "lr_warmup_init", 0.0))
    total = int(_get(optim_config, "total_training_steps", -1))
    decay_steps = int(_get(optim_config, "lr_decay_steps", total))
    warmup_steps = _warmup_steps(
        optim_config,
        decay_steps,
        "optim.lr_decay_steps or optim.total_training_steps, both unset; the trainer sets total_training_steps from "
        "the dataloader length, or set optim.lr_warmup_steps",
    )
    if not 0.0 <= min_lr <= max_lr or init_lr > max_lr:
        raise ValueError(
            f"optim.min_lr={min_lr}, optim.lr_warmup_init={init_lr} and optim.lr={max_lr} must satisfy "
            "0 <= min_lr <= lr and lr_warmup_init <= lr"
        )
    if style != "constant" and decay_steps <= warmup_steps:
        raise ValueError(
            f"optim.lr_decay_style={style} decays over optim.lr_decay_steps={decay_steps} (default: "
            f"total_training_steps), which must exceed the {warmup_steps} warm-up steps"
        )
    wsd_steps = _get(optim_config, "lr_wsd_decay_steps")
    wsd_style = str(_get(optim_config, "lr_wsd_decay_style", "exponential"))
    if style == "WSD":
        if wsd_steps is None or not 0 < int(wsd_steps) <= decay_steps:
            raise ValueError(
                f"optim.lr_decay_style=WSD needs optim.lr_wsd_decay_steps in (0, lr_decay_steps={decay_steps}], "
                f"got {wsd_steps}"
            )
        if wsd_style not in WSD_DECAY_STYLES:
            raise ValueError(f"optim.lr_wsd_decay_style={wsd_style!r} is not one of {list(WSD_DECAY_STYLES)}")
        wsd_steps = int(wsd_steps)

    def factor(step: int) -> float:
        lr = _megatron_lr(step, max_lr, min_lr, init_lr, warmup_steps, decay_steps, style, wsd_steps, wsd_style)
        return lr / max_lr if max_lr > 0 else 0.0

    return factor


def _weight_decay_incr_style(optim_config) -> str:
    style = str(_get(optim_config, "weight_decay_incr_style", "constant"))
    if style not in WEIGHT_DECAY_INCR_STYLES:
        raise ValueError(
            f"optim.weight_decay_incr_style={style!r} is not one of megatron's {list(WEIGHT_DECAY_INCR_STYLES)}"
        )
    return style


def megatron_weight_decay(step: int, start_wd: float, end_wd: float, incr_steps: int, style: str) -> float:
    """Megatron-core's weight decay at `step` (its `OptimizerParamScheduler.get_wd`): from `start_wd`
    to `end_wd` over `incr_steps` steps, linearly or along a half cosine (`constant`: they must be
    equal), `end_wd` after. Upstream passes `optim.weight_decay` as both ends."""
    if step > incr_steps or incr_steps <= 0:
        return end_wd
    if style == "constant":
        if start_wd != end_wd:
            raise ValueError(f"weight_decay_incr_style=constant needs start_wd == end_wd, got {start_wd}, {end_wd}")
        return end_wd
    ratio = step / incr_steps
    if style == "linear":
        coeff = ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
    else:
        raise ValueError(f"weight_decay_incr_style={style!r} is not one of {list(WEIGHT_DECAY_INCR_STYLES)}")
    return start_wd + coeff * (end_wd - start_wd)


def _scheduler_type(optim_config) -> str | None:
    """The FSDP schedule name, or None for a Megatron-style section (`lr_decay_style` only)."""
    older = _get(optim_config, "warmup_style")
    newer = _get(optim_config, "lr_scheduler_type")
    if older is not None:
        if newer is not None and newer != older:
            warnings.warn(
                f"optim.warmup_style={older} overrides optim.lr_scheduler_type={newer}: warmup_style is the older "
                "name of lr_scheduler_type and wins when set, as upstream; set only lr_scheduler_type",
                DeprecationWarning,
                stacklevel=3,
            )
        return str(older)
    if newer is not None:
        return str(newer)
    return None if _has(optim_config, "lr_decay_style") else "constant"


def _warmup_steps(optim_config, span: int, span_needed: str) -> int:
    """`lr_warmup_steps` when > 0, else `lr_warmup_steps_ratio` of `span` (the schedule's length);
    a ratio without a known span is an error that ends with `span_needed`."""
    warmup_steps = int(_get(optim_config, "lr_warmup_steps", -1))
    if warmup_steps > 0:
        return warmup_steps
    ratio = float(_get(optim_config, "lr_warmup_steps_ratio", 0.0))
    if ratio > 0 and span <= 0:
        raise ValueError(f"optim.lr_warmup_steps_ratio={ratio} needs {span_needed}")
    return int(ratio * max(span, 0))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, optim_config) -> LambdaLR:
    """The configured lr schedule of `optimizer` (see the module docstring), stepped once per
    training step."""
    return LambdaLR(optimizer, _lr_factor(optim_config))


def _lr_factor(optim_config):
    """The configured schedule's lr at a step over `optim.lr` (either family, see the module docstring)."""
    style = _scheduler_type(optim_config)
    if style is None:
        return _megatron_factor(optim_config)
    total_steps = int(_get(optim_config, "total_training_steps", -1))
    warmup_steps = _warmup_steps(
        optim_config,
        total_steps,
        "optim.total_training_steps, which is unset; the trainer sets it from the dataloader length, or set "
        "optim.lr_warmup_steps instead",
    )
    if style == "constant":
        return _constant_factor(warmup_steps)
    if style == "cosine":
        if total_steps <= 0:
            raise ValueError(
                "optim.lr_scheduler_type=cosine needs optim.total_training_steps > 0 to know where the decay ends"
            )
        return _cosine_factor(
            warmup_steps,
            total_steps,
            float(_get(optim_config, "min_lr_ratio", 0.0)),
            float(_get(optim_config, "num_cycles", 0.5)),
            zero_indexed_step=bool(_get(optim_config, "zero_indexed_step", True)),
        )
    raise ValueError(f"optim.lr_scheduler_type={style!r} is not one of {list(LR_SCHEDULER_TYPES)}")


# the keys a schedule reads (either family, lr and weight decay): MegatronParamScheduler's settings
SCHEDULE_KEYS = (
    "lr",
    "warmup_style",
    "lr_scheduler_type",
    "total_training_steps",
    "lr_warmup_steps",
    "lr_warmup_steps_ratio",
    "min_lr_ratio",
    "num_cycles",
    "zero_indexed_step",
    "lr_decay_style",
    "lr_decay_steps",
    "lr_warmup_init",
    "min_lr",
    "lr_wsd_decay_style",
    "lr_wsd_decay_steps",
    "weight_decay",
    "weight_decay_incr_style",
)


class MegatronParamScheduler(LRScheduler):
    """The Megatron engine's lr and weight-decay schedule, stepped once per training step.

    The lr is `build_lr_scheduler`'s curve; the weight decay of every parameter group is
    `megatron_weight_decay(step, weight_decay, weight_decay, total_training_steps,
    weight_decay_incr_style)`, upstream's arguments to megatron's scheduler. `settings` (the
    section's SCHEDULE_KEYS) are part of the state dict. Loading one takes its step; its settings
    too when built with `use_checkpoint_settings` (upstream's `use_checkpoint_opt_param_scheduler`),
    else this section's stay (megatron's `override_opt_param_scheduler`). Either way the lr and
    weight decay of the loaded step are then set on the optimizer, over the hyper-parameters its own
    state dict restored.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, optim_config, use_checkpoint_settings: bool = False):
        self.settings = {k: _plain(_get(optim_config, k)) for k in SCHEDULE_KEYS if _has(optim_config, k)}
        # the optimizer was built with override_optimizer_config's lr / weight_decay where it sets them
        overrides = _get(optim_config, "override_optimizer_config") or {}
        self.settings.update({k: float(overrides[k]) for k in ("lr", "weight_decay") if k in overrides})
        self.use_checkpoint_settings = bool(use_checkpoint_settings)
        self._use(self.settings)
        super().__init__(optimizer)

    def _use(self, settings: dict) -> None:
        self._factor = _lr_factor(settings)  # checks them
        _weight_decay_incr_style(settings)
        self.settings = dict(settings)

    def lr_at(self, step: int) -> float:
        return float(self.settings.get("lr", 1e-6)) * self._factor(step)

    def weight_decay_at(self, step: int) -> float:
        wd = float(self.settings.get("weight_decay", 1e-2))
        total = int(self.settings.get("total_training_steps", -1))
        return megatron_weight_decay(step, wd, wd, total, str(self.settings.get("weight_decay_incr_style", "constant")))

    def get_lr(self) -> list[float]:
        return [self.lr_at(self.last_epoch)] * len(self.optimizer.param_groups)

    def step(self, epoch=None) -> None:
        super().step(epoch)
        self._set_weight_decay()

    def _set_weight_decay(self) -> None:
        wd = self.weight_decay_at(self.last_epoch)
        for group in self.optimizer.param_groups:
            group["weight_decay"] = wd

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch, "_step_count": self._step_count, "settings": dict(self.settings)}

    def load_state_dict(self, state_dict: dict) -> None:
        if self.use_checkpoint_settings:
            if "settings" not in state_dict:
                raise ValueError(
                    "optim.use_checkpoint_opt_param_scheduler=true, but the checkpoint's schedule state holds no "
                    "settings (it was written by an lr-only schedule); set use_checkpoint_opt_param_scheduler=false "
                    "to continue its step with this section's settings"
                )
            self._use(state_dict["settings"])
        self.last_epoch = int(state_dict["last_epoch"])
        self._step_count = int(state_dict.get("_step_count", self.last_epoch + 1))
        lr = self.lr_at(self.last_epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._last_lr = [lr] * len(self.optimizer.param_groups)
        self._set_weight_decay()


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def _constant_factor(num_warmup_steps: int):
    def factor(step: int) -> float:
        if step < num_warmup_steps:
            return float(step) / float(max(1, num_warmup_steps))
        return 1.0

    return factor


def _cosine_factor(
    num_warmup_steps: int,
    num_training_steps: int,
    min_lr_ratio: float,
    num_cycles: float,
    init_lr_ratio: float | None = None,
    zero_indexed_step: bool = True,
):
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    init = 0.0 if init_lr_ratio is None else init_lr_ratio
    if not 0.0 <= init <= 1.0:
        raise ValueError(f"init_lr_ratio (the warm-up's starting share of the lr) must be in [0, 1], got {init}")

    offset = 0 if zero_indexed_step else 1

    def factor(step: int) -> float:
        step += offset
        if step < num_warmup_steps:
            return init + (1.0 - init) * float(step) / float(max(1, num_warmup_steps))
        progress = float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
        cosine = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
        return min_lr_ratio + (1.0 - min_lr_ratio) * max(0.0, cosine)

    return factor
