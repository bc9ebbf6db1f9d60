"""AdamW and its lr schedule from an `optim` config section (upstream keys), and the schedules.

Keys read: `lr`, `weight_decay`, `betas`, `eps`; `lr_warmup_steps` (used when > 0, else
`lr_warmup_steps_ratio * total_training_steps`), `lr_scheduler_type` or the older `warmup_style`
(`constant` | `cosine`; warmup_style wins when set, as upstream), `min_lr_ratio`, `num_cycles`, `total_training_steps` (filled in by the
trainer once the dataloader length is known).

Schedules are `LambdaLR`s, so their whole state is a step counter that checkpoints restore
exactly. (Upstream exposes the two schedule functions from `verl.utils.torch_functional`.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

__all__ = [
    "build_lr_scheduler",
    "build_optimizer",
    "local_optimizer",
    "get_constant_schedule_with_warmup",
    "get_cosine_schedule_with_warmup",
]

_SCHEDULES = ("constant", "cosine")


def get_constant_schedule_with_warmup(
    optimizer: torch.optim.Optimizer, num_warmup_steps: int, last_epoch: int = -1
) -> LambdaLR:
    """Linear warm-up from 0 to the base lr over `num_warmup_steps`, then constant."""

    def factor(step: int) -> float:
        if step < num_warmup_steps:
            return float(step) / float(max(1, num_warmup_steps))
        return 1.0

    return LambdaLR(optimizer, factor, last_epoch)


def get_cosine_schedule_with_warmup(
    optimizer: torch.optim.Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
    last_epoch: int = -1,
) -> LambdaLR:
    """Linear warm-up, then cosine decay from the base lr to `min_lr_ratio * lr`.

    With the default half cycle the lr reaches `min_lr_ratio * lr` at `num_training_steps`.
    """
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {min_lr_ratio}")

    def factor(step: int) -> float:
        if step < num_warmup_steps:
            return float(step) / float(max(1, num_warmup_steps))
        progress = float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
        cosine = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
        return min_lr_ratio + (1.0 - min_lr_ratio) * max(0.0, cosine)

    return LambdaLR(optimizer, factor, last_epoch)


def _get(cfg, key, default=None):
    value = cfg.get(key, default) if cfg is not None else default
    return default if value is None else value


def build_optimizer(
    parameters: Iterable[torch.nn.Parameter], optim_config, shard_state_over=None
) -> torch.optim.Optimizer:
    """AdamW over `parameters` (FSDP2 DTensor parameters work unchanged).

    The fused implementation (one kernel per parameter) when every parameter is a floating-point
    tensor on CPU or CUDA: torch's default on CPU is a per-parameter Python loop of about ten ops,
    each dispatched through DTensor under FSDP2. Measured on the bundled model (2 gloo ranks, 50
    parameters): 2.4 ms per step fused against 20.9 ms for the loop (7.6 ms with foreach).

    `shard_state_over`: a process group of data-parallel replicas (every rank holding the same
    parameters, each with the averaged gradient). With more than one rank the Adam state is split
    over them by whole parameters (ZeRO stage 1, torch's `ZeroRedundancyOptimizer`): each rank
    steps only the parameters it owns and broadcasts them to the others. Adam is elementwise, so
    the result equals the unsharded step; `local_optimizer` gives the AdamW holding this rank's part.
    """
    from verl.utils.device import has_fused_adamw

    params = list(parameters)
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    fused = bool(tensors) and all(has_fused_adamw(p) for p in tensors)
    kwargs = {
        "lr": float(_get(optim_config, "lr", 1e-6)),
        "betas": tuple(_get(optim_config, "betas", (0.9, 0.999))),
        "eps": float(_get(optim_config, "eps", 1e-8)),
        "weight_decay": float(_get(optim_config, "weight_decay", 1e-2)),
        "fused": fused or None,
    }
    if shard_state_over is not None and torch.distributed.get_world_size(shard_state_over) > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(
            params, optimizer_class=torch.optim.AdamW, process_group=shard_state_over, **kwargs
        )
    return torch.optim.AdamW(params, **kwargs)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose `state` holds this rank's Adam moments: `optimizer` itself, or the local
    AdamW of a `ZeroRedundancyOptimizer` (whose own `state` stays empty)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def build_lr_scheduler(optimizer: torch.optim.Optimizer, optim_config) -> torch.optim.lr_scheduler.LambdaLR:
    """Warm-up + constant or cosine schedule, stepped once per training step."""
    total_steps = int(_get(optim_config, "total_training_steps", -1))
    warmup_steps = int(_get(optim_config, "lr_warmup_steps", -1))
    if warmup_steps <= 0:
        ratio = float(_get(optim_config, "lr_warmup_steps_ratio", 0.0))
        if ratio > 0 and total_steps <= 0:
            raise ValueError(
                f"optim.lr_warmup_steps_ratio={ratio} needs optim.total_training_steps, which is unset; "
                "the trainer sets it from the dataloader length, or set optim.lr_warmup_steps instead"
            )
        warmup_steps = int(ratio * max(total_steps, 0))
    # upstream's rule: the deprecated warmup_style, when set, wins over lr_scheduler_type (default constant)
    style = _get(optim_config, "warmup_style", None) or _get(optim_config, "lr_scheduler_type", "constant")
    if style == "constant":
        return get_constant_schedule_with_warmup(optimizer, num_warmup_steps=warmup_steps)
    if style == "cosine":
        if total_steps <= 0:
            raise ValueError(
                "optim.lr_scheduler_type=cosine needs optim.total_training_steps > 0 to know where the decay ends"
            )
        return get_cosine_schedule_with_warmup(
            optimizer,
            num_warmup_steps=warmup_steps,
            num_training_steps=total_steps,
            min_lr_ratio=float(_get(optim_config, "min_lr_ratio", 0.0)),
            num_cycles=float(_get(optim_config, "num_cycles", 0.5)),
        )
    raise ValueError(f"optim.lr_scheduler_type={style!r} is not one of {list(_SCHEDULES)}")
