"""The Megatron engine's schedule (`MegatronParamScheduler`): megatron's weight-decay ramp
(`weight_decay_incr_style`, with upstream's arguments) and `use_checkpoint_opt_param_scheduler`
(the schedule's settings from the checkpoint on resume, else the section's at the checkpoint's step)."""

from __future__ import annotations

import math

import pytest
import torch

from verl.utils.optim import MegatronParamScheduler, build_lr_scheduler, megatron_weight_decay
from verl.workers.config import McoreOptimizerConfig


def _optimizer(lr=1.0, weight_decay=0.0):
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=lr, weight_decay=weight_decay)


# hand-worked: start 0, end 0.1 over 4 steps; cosine coefficient 0.5 (cos(pi (1 - r)) + 1)
HALF_SQRT2 = math.sqrt(2.0) / 2.0
RAMPS = {
    "linear": [0.0, 0.025, 0.05, 0.075, 0.1, 0.1, 0.1],
    "cosine": [0.0, 0.05 * (1 - HALF_SQRT2), 0.05, 0.05 * (1 + HALF_SQRT2), 0.1, 0.1, 0.1],
}


@pytest.mark.parametrize("style", sorted(RAMPS))
def test_the_weight_decay_ramp_is_megatrons_formula(style):
    got = [megatron_weight_decay(step, 0.0, 0.1, 4, style) for step in range(7)]
    assert got == pytest.approx(RAMPS[style], abs=1e-15)


def test_the_weight_decay_ramp_equals_megatron_cores_scheduler():
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    for style in ("constant", "linear", "cosine"):
        end = 0.02 if style == "constant" else 0.3
        reference = OptimizerParamScheduler(
            _optimizer(),
            init_lr=0.0,
            max_lr=1.0,
            min_lr=0.0,
            lr_warmup_steps=0,
            lr_decay_steps=10,
            lr_decay_style="constant",
            start_wd=0.02,
            end_wd=end,
            wd_incr_steps=7,
            wd_incr_style=style,
        )
        for step in range(10):
            assert megatron_weight_decay(step, 0.02, end, 7, style) == pytest.approx(reference.get_wd(), abs=1e-15)
            reference.step(1)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_every_style_keeps_upstreams_weight_decay_and_the_lr_curve(style):
    # upstream hands megatron start_wd = end_wd = optim.weight_decay: the decay stays put at every step
    section = dict(lr=0.5, lr_scheduler_type="cosine", lr_warmup_steps=2, total_training_steps=8)
    section.update(weight_decay=0.05, weight_decay_incr_style=style)
    optimizer = _optimizer(weight_decay=0.0)  # the scheduler sets it from the section
    scheduler = MegatronParamScheduler(optimizer, section)
    lr_only = build_lr_scheduler(_optimizer(lr=0.5), section)
    for _ in range(10):
        assert optimizer.param_groups[0]["weight_decay"] == 0.05
        assert optimizer.param_groups[0]["lr"] == pytest.approx(lr_only.get_last_lr()[0], rel=1e-15)
        for opt, sched in ((optimizer, scheduler), (lr_only.optimizer, lr_only)):
            opt.step()
            sched.step()


def test_an_unknown_weight_decay_style_is_refused_naming_megatrons():
    with pytest.raises(ValueError, match="weight_decay_incr_style='exponential'.*constant, linear, cosine"):
        McoreOptimizerConfig(weight_decay_incr_style="exponential")
    with pytest.raises(ValueError, match="weight_decay_incr_style='square'"):
        MegatronParamScheduler(_optimizer(), dict(lr=1.0, weight_decay_incr_style="square"))


SAVED = dict(lr=1e-3, lr_scheduler_type="cosine", lr_warmup_steps=2, total_training_steps=10, min_lr_ratio=0.1)
SAVED.update(weight_decay=0.1, weight_decay_incr_style="linear")
NEW = dict(lr=5e-4, lr_scheduler_type="constant", total_training_steps=20, weight_decay=0.0)


def _saved_after(steps: int):
    optimizer = _optimizer(lr=SAVED["lr"])
    scheduler = MegatronParamScheduler(optimizer, SAVED)
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    return optimizer, scheduler


def _resumed(use_checkpoint_settings: bool, state: dict, optimizer_state: dict):
    optimizer = _optimizer(lr=NEW["lr"])
    scheduler = MegatronParamScheduler(optimizer, NEW, use_checkpoint_settings=use_checkpoint_settings)
    optimizer.load_state_dict(optimizer_state)  # as the checkpoint manager: the optimizer first
    scheduler.load_state_dict(state)
    return optimizer, scheduler


def test_resume_with_use_checkpoint_opt_param_scheduler_takes_the_saved_schedule():
    saved_optimizer, saved = _saved_after(3)
    optimizer, resumed = _resumed(True, saved.state_dict(), saved_optimizer.state_dict())
    assert resumed.settings == saved.settings
    for step in range(3, 11):  # the resumed run continues the saved run's lr and weight decay
        want_lr = 1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - 2) / 8)))  # float64, by hand
        group, saved_group = optimizer.param_groups[0], saved_optimizer.param_groups[0]
        assert group["lr"] == pytest.approx(want_lr, rel=1e-12)
        assert group["lr"] == saved_group["lr"]
        assert group["weight_decay"] == saved_group["weight_decay"] == 0.1
        for opt, sched in ((optimizer, resumed), (saved_optimizer, saved)):
            opt.step()
            sched.step()


def test_resume_without_the_flag_continues_the_sections_schedule_at_the_saved_step():
    saved_optimizer, saved = _saved_after(3)
    optimizer, resumed = _resumed(False, saved.state_dict(), saved_optimizer.state_dict())
    assert resumed.settings == NEW and resumed.last_epoch == 3
    # the optimizer's own state dict brought back lr ~1e-3 and weight decay 0.1: the section's win
    assert (optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["weight_decay"]) == (5e-4, 0.0)


def test_the_flag_refuses_a_checkpoint_without_schedule_settings():
    lr_only = build_lr_scheduler(_optimizer(lr=1e-3), SAVED)
    _, scheduler = _saved_after(0)
    scheduler.use_checkpoint_settings = True
    with pytest.raises(ValueError, match="holds no settings.*use_checkpoint_opt_param_scheduler=false"):
        scheduler.load_state_dict(lr_only.state_dict())


def test_override_optimizer_configs_lr_and_weight_decay_are_the_schedules():
    section = dict(lr=1.0, weight_decay=0.1, override_optimizer_config={"lr": 0.5, "weight_decay": 0.02})
    optimizer = _optimizer()
    MegatronParamScheduler(optimizer, section)
    assert (optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["weight_decay"]) == (0.5, 0.02)
