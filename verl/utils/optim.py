"""AdamW and its lr schedule from an `optim` config section (upstream keys).

Keys read: `lr`, `weight_decay`, `betas`, `eps`; `lr_warmup_steps` (used when > 0, else
`lr_warmup_steps_ratio * total_training_steps`), `lr_scheduler_type` or the older `warmup_style`
(`constant` | `cosine`), `min_lr_ratio`, `num_cycles`, `total_training_steps` (filled in by the
trainer once the dataloader length is known).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

__all__ = ["build_lr_scheduler", "build_optimizer"]

_SCHEDULES = ("constant", "cosine")


def _get(cfg, key, default=None):
    value = cfg.get(key, default) if cfg is not None else default
    return default if value is None else value


def build_optimizer(parameters: Iterable[torch.nn.Parameter], optim_config) -> torch.optim.AdamW:
    """AdamW over `parameters` (FSDP2 DTensor parameters work unchanged)."""
    betas = tuple(_get(optim_config, "betas", (0.9, 0.999)))
    return torch.optim.AdamW(
        parameters,
        lr=float(_get(optim_config, "lr", 1e-6)),
        betas=betas,
        eps=float(_get(optim_config, "eps", 1e-8)),
        weight_decay=float(_get(optim_config, "weight_decay", 1e-2)),
    )


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
    style = _get(optim_config, "lr_scheduler_type", None) or _get(optim_config, "warmup_style", "constant")
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
