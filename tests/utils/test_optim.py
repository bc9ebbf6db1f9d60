import math

import pytest
import torch

from verl.utils.optim import build_lr_scheduler, build_optimizer


def lrs(scheduler, steps):
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def optimizer(lr=1.0):
    return build_optimizer([torch.nn.Parameter(torch.zeros(2))], {"lr": lr, "weight_decay": 0.0, "betas": [0.9, 0.95]})


def test_constant_schedule_warms_up_linearly_then_stays():
    scheduler = build_lr_scheduler(optimizer(), {"lr_warmup_steps": 4, "warmup_style": "constant"})
    assert lrs(scheduler, 7) == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert scheduler.optimizer.param_groups[0]["betas"] == (0.9, 0.95)


def test_cosine_schedule_decays_to_the_min_ratio():
    config = {
        "lr_warmup_steps_ratio": 0.2,
        "total_training_steps": 10,
        "lr_scheduler_type": "cosine",
        "min_lr_ratio": 0.1,
    }
    values = lrs(build_lr_scheduler(optimizer(), config), 11)
    assert values[:3] == [0.0, 0.5, 1.0]
    # step 6: progress (6-2)/8 = 0.5 -> cosine factor 0.5 -> 0.1 + 0.9 * 0.5
    assert values[6] == pytest.approx(0.55)
    assert values[10] == pytest.approx(0.1)
    assert values[4] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))


def test_schedule_errors_name_the_key():
    with pytest.raises(ValueError, match="total_training_steps"):
        build_lr_scheduler(optimizer(), {"lr_scheduler_type": "cosine"})
    with pytest.raises(ValueError, match="lr_scheduler_type='linear'"):
        build_lr_scheduler(optimizer(), {"lr_scheduler_type": "linear"})
