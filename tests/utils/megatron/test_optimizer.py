"""megatron's own optimizer and lr scheduler through upstream's helpers (`verl.utils.megatron.optimizer`),
on one gloo rank: an SGD step on a DDP-wrapped GPTModel moves every parameter by exactly -lr * grad
(gradients read before the step), the warm-up scheduler sets lr as a hand-worked schedule says, and
the CUDA-only settings are refused on CPU with what to change."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from tests.distributed_helpers import run_distributed
from tests.megatron_helpers import tiny_hf_model

CPU_OVERRIDES = {"bf16": False, "params_dtype": torch.float32}


def _optim_section(**extra):
    section = {
        "optimizer": "sgd",
        "lr": 0.1,
        "min_lr": 0.0,
        "clip_grad": 1.0e9,
        "weight_decay": 0.0,
        "override_optimizer_config": CPU_OVERRIDES,
    }
    return OmegaConf.create({**section, **extra}, flags={"allow_objects": True})


def _check_step(rank, world_size):
    from verl.models.mcore import build_gpt_model, hf_to_mcore_config
    from verl.utils.megatron.optimizer import (
        get_megatron_last_lr,
        get_megatron_optimizer,
        get_megatron_optimizer_param_scheduler,
        init_megatron_optim_config,
    )
    from verl.utils.megatron.parallel_state import initialize_model_parallel
    from verl.utils.megatron_utils import get_model

    initialize_model_parallel()
    hf = tiny_hf_model("qwen2")
    tf_config = hf_to_mcore_config(hf.config, {}, torch.float32)
    chunks = get_model(
        lambda pre_process, post_process: build_gpt_model(hf.config, tf_config, pre_process, post_process),
        use_distributed_optimizer=False,
    )
    config = init_megatron_optim_config(_optim_section(), use_distributed_optimizer=False)
    assert config.optimizer == "sgd" and config.bf16 is False and config.params_dtype is torch.float32
    optimizer = get_megatron_optimizer(chunks, config)

    before = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}
    chunks[0].zero_grad_buffer()
    optimizer.zero_grad()
    ids = torch.randint(0, 200, (2, 8), generator=torch.Generator().manual_seed(1))
    logits = chunks[0](ids, torch.arange(8).expand(2, 8), None)
    logits.pow(2).mean().backward()
    chunks[0].finish_grad_sync()
    grads = {n: p.main_grad.detach().clone() for n, p in chunks[0].named_parameters()}
    update_successful, grad_norm, _ = optimizer.step()
    assert update_successful and grad_norm > 0
    for name, param in chunks[0].named_parameters():
        torch.testing.assert_close(param.detach(), before[name] - 0.1 * grads[name], atol=1e-7, rtol=0, msg=name)

    section = _optim_section(
        lr_warmup_init=0.0,
        lr_warmup_steps=4,
        lr_decay_steps=None,
        total_training_steps=10,
        lr_decay_style="constant",
        weight_decay_incr_style="constant",
        lr_wsd_decay_style="exponential",
        lr_wsd_decay_steps=None,
        use_checkpoint_opt_param_scheduler=False,
    )
    scheduler = get_megatron_optimizer_param_scheduler(optimizer, section)
    assert get_megatron_last_lr(optimizer) == 0.0  # warm-up starts at lr_warmup_init
    scheduler.step(1)
    assert get_megatron_last_lr(optimizer) == pytest.approx(0.025)  # 0.1 * 1 / 4
    scheduler.step(4)
    assert get_megatron_last_lr(optimizer) == pytest.approx(0.1)  # past warm-up: constant


def test_sgd_step_and_warmup_schedule_through_megatron_optimizer():
    pytest.importorskip("megatron.core")
    run_distributed(_check_step, 1)


def _check_cpu_refusals(rank, world_size):
    from verl.models.mcore import build_gpt_model, hf_to_mcore_config
    from verl.utils.megatron.optimizer import get_megatron_optimizer, init_megatron_optim_config
    from verl.utils.megatron.parallel_state import initialize_model_parallel
    from verl.utils.megatron_utils import get_model

    initialize_model_parallel()
    hf = tiny_hf_model("qwen2")
    tf_config = hf_to_mcore_config(hf.config, {}, torch.float32)
    chunks = get_model(
        lambda pre_process, post_process: build_gpt_model(hf.config, tf_config, pre_process, post_process)
    )
    with pytest.raises(ValueError, match="use_distributed_optimizer=True.*cannot run on this CPU-only machine"):
        get_megatron_optimizer(chunks, init_megatron_optim_config(_optim_section()))
    with pytest.raises(
        ValueError, match="wrapped with use_distributed_optimizer=True but the optimizer config says False"
    ):
        get_megatron_optimizer(chunks, init_megatron_optim_config(_optim_section(), use_distributed_optimizer=False))


def test_cuda_only_optimizer_settings_are_refused_on_cpu():
    pytest.importorskip("megatron.core")
    from verl.utils.device import is_cuda_available

    if is_cuda_available():
        pytest.skip("the refusal is for CPU-only machines")
    run_distributed(_check_cpu_refusals, 1)


def test_optim_config_takes_bf16_or_fp16_then_the_overrides():
    pytest.importorskip("megatron.core")
    from verl.utils.megatron.optimizer import init_megatron_optim_config

    section = _optim_section(optimizer="adam", override_optimizer_config={"adam_beta2": 0.95})
    bf16 = init_megatron_optim_config(section)
    assert bf16.bf16 and not bf16.fp16 and bf16.params_dtype is torch.bfloat16 and bf16.use_distributed_optimizer
    assert bf16.adam_beta2 == 0.95 and bf16.lr == 0.1 and bf16.clip_grad == 1.0e9
    # fp16 asks for megatron's precision-aware optimizer, whose config check needs TransformerEngine:
    # the override (applied last) switches it off here
    section = _optim_section(override_optimizer_config={"use_precision_aware_optimizer": False})
    fp16 = init_megatron_optim_config(section, fp16=True)
    assert fp16.fp16 and not fp16.bf16 and fp16.initial_loss_scale == 32768 and fp16.min_loss_scale == 1
    assert fp16.params_dtype is torch.float16 and not fp16.use_precision_aware_optimizer
