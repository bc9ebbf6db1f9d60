"""Megatron-core's own optimizer and lr scheduler for hand-built megatron models (upstream's
`verl.utils.megatron.optimizer`).

Upstream's recipes (GKD) build their model with `verl.utils.megatron_utils.get_model` (megatron's
DDP around each chunk) and step it with megatron's optimizer: `optimizer.step()` returns
`(update_successful, grad_norm, num_zeros_in_grad)` and clips by the global norm itself. These
are those functions, over megatron's classes. verl's own megatron engine
(`verl.workers.engine.megatron`) does not use them: it steps a torch AdamW over the model's
shards (see `verl.workers.actor.megatron_actor` for why).

Design decisions:
- `init_megatron_optim_config` turns upstream's `optim` section into megatron's
  `OptimizerConfig` exactly as upstream does: bf16 (or fp16 with loss scaling) master-weight
  settings, then `override_optimizer_config` on top, so a section written for upstream builds
  the same optimizer here.
- megatron's process groups come from `verl.utils.megatron.parallel_state`, without gloo
  copies; the optimizer is built without them (they only serve megatron's own checkpoint
  format, which verl's checkpoint manager does not use).
- CPU (no CUDA): megatron's fp32 optimizer runs (its gradient clipping is made device-neutral
  by `verl.utils.megatron.cpu_compat`); its 16-bit and distributed optimizers check for CUDA
  tensors and are refused with an error that says which override runs on CPU.
"""

from __future__ import annotations

import logging

import torch

from verl.utils.device import is_cuda_available
from verl.utils.optim import _get  # a section key (DictConfig, dataclass or mapping), None -> default

__all__ = [
    "get_megatron_last_lr",
    "get_megatron_optimizer",
    "get_megatron_optimizer_param_scheduler",
    "init_megatron_optim_config",
]

logger = logging.getLogger(__name__)


def init_megatron_optim_config(optim_config, use_distributed_optimizer: bool = True, fp16: bool = False):
    """megatron's `OptimizerConfig` from an `optim` section (optim/megatron.yaml: optimizer, lr, min_lr,
    clip_grad, weight_decay, override_optimizer_config).

    bf16 master weights by default (`bf16=True`, `params_dtype=bfloat16`); `fp16=True` instead
    takes fp16 with dynamic loss scaling (initial scale 2**15, floor 1) and the precision-aware
    optimizer. `override_optimizer_config` entries replace any of these keywords last."""
    from megatron.core.optimizer import OptimizerConfig

    kwargs = {
        "optimizer": optim_config.optimizer,
        "lr": optim_config.lr,
        "min_lr": optim_config.min_lr,
        "clip_grad": optim_config.clip_grad,
        "weight_decay": optim_config.weight_decay,
        "use_distributed_optimizer": use_distributed_optimizer,
    }
    if fp16:
        kwargs.update(
            bf16=False,
            fp16=True,
            params_dtype=torch.float16,
            initial_loss_scale=32768,
            min_loss_scale=1,
            use_precision_aware_optimizer=True,
            store_param_remainders=False,
        )
    else:
        kwargs.update(bf16=True, params_dtype=torch.bfloat16)
    kwargs.update(dict(_get(optim_config, "override_optimizer_config", {}) or {}))
    logger.info("megatron optimizer config after overrides: %s", kwargs)
    return OptimizerConfig(**kwargs)


def _refuse_cuda_only_settings(config) -> None:
    if is_cuda_available():
        return
    needs_cuda = [key for key in ("use_distributed_optimizer", "bf16", "fp16") if getattr(config, key)]
    if needs_cuda:
        raise ValueError(
            f"megatron's optimizer with {', '.join(f'{k}=True' for k in needs_cuda)} checks for CUDA tensors and "
            "cannot run on this CPU-only machine; on CPU build it with override_optimizer_config "
            "{bf16: false, fp16: false, params_dtype: torch.float32}, use_distributed_optimizer=False (and "
            "get_model(..., use_distributed_optimizer=False)), or train with verl's megatron engine, which runs on CPU"
        )


def get_megatron_optimizer(model, config):
    """megatron's optimizer (`MegatronOptimizer`, a `ChainedOptimizer` over its parameter groups) for
    the model chunks `model` (a list of megatron-DDP-wrapped chunks, as `get_model` returns) with
    megatron's `OptimizerConfig` `config` (`init_megatron_optim_config`).
    `config.use_distributed_optimizer` must match the chunks' DDP setting (gradients are then
    reduce-scattered, and only a sharded optimizer reads them correctly)."""
    from megatron.core.optimizer import get_megatron_optimizer as megatron_get_optimizer

    chunks = model if isinstance(model, list | tuple) else [model]
    for chunk in chunks:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is None:
            raise TypeError(
                f"get_megatron_optimizer needs megatron-DDP-wrapped chunks (get_model(..., wrap_with_ddp=True)); got "
                f"{type(chunk).__name__}"
            )
        if ddp_config.use_distributed_optimizer != config.use_distributed_optimizer:
            raise ValueError(
                f"the model was wrapped with use_distributed_optimizer={ddp_config.use_distributed_optimizer} but the "
                f"optimizer config says {config.use_distributed_optimizer}: the gradients would be "
                f"{'reduce-scattered' if ddp_config.use_distributed_optimizer else 'all-reduced'} for an optimizer "
                "expecting the other; pass the same value to get_model and init_megatron_optim_config"
            )
    _refuse_cuda_only_settings(config)
    return megatron_get_optimizer(config=config, model_chunks=list(chunks), use_gloo_process_groups=False)


def get_megatron_optimizer_param_scheduler(optimizer, config):
    """megatron's `OptimizerParamScheduler` for `optimizer` from an `optim` section (lr_warmup_init, lr,
    min_lr, lr_decay_style, lr_decay_steps (null: total_training_steps), lr_warmup_steps, or
    lr_warmup_steps_ratio * decay steps when lr_warmup_steps is unset or <= 0, weight_decay with
    its increment style over total_training_steps, the WSD keys and
    use_checkpoint_opt_param_scheduler). Call its `step(1)` once per optimizer step."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    total_steps = config.total_training_steps
    decay_steps = _get(config, "lr_decay_steps", total_steps)
    warmup_steps = _get(config, "lr_warmup_steps")
    ratio = _get(config, "lr_warmup_steps_ratio")
    if ratio is not None and (warmup_steps is None or warmup_steps <= 0):
        warmup_steps = int(ratio * decay_steps)
    use_checkpoint = config.use_checkpoint_opt_param_scheduler
    return OptimizerParamScheduler(
        optimizer,
        init_lr=config.lr_warmup_init,
        max_lr=config.lr,
        min_lr=config.min_lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=config.lr_decay_style,
        start_wd=config.weight_decay,
        end_wd=config.weight_decay,
        wd_incr_steps=total_steps,
        wd_incr_style=config.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=use_checkpoint,
        override_opt_param_scheduler=not use_checkpoint,
        wsd_decay_steps=_get(config, "lr_wsd_decay_steps"),
        lr_wsd_decay_style=config.lr_wsd_decay_style,
    )


def get_megatron_last_lr(optimizer) -> float:
    """The learning rate the scheduler last set: the first parameter group's."""
    return optimizer.param_groups[0]["lr"]
