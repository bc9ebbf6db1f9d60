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


def test_cosine_schedule_of_an_fsdp_optimizer_section_with_its_null_min_ratio_decays_to_zero():
    from verl.workers.config import FSDPOptimizerConfig

    # upstream's dataclass default min_lr_ratio is null, read as 0
    config = FSDPOptimizerConfig(lr=1.0, lr_warmup_steps=2, total_training_steps=10, lr_scheduler_type="cosine")
    assert config.min_lr_ratio is None
    values = lrs(build_lr_scheduler(optimizer(), config), 11)
    # step 6: progress (6-2)/8 = 0.5 -> 0.5 * (1 + cos(pi/2)) = 0.5; step 10: the floor, 0
    assert values[:3] == [0.0, 0.5, 1.0] and values[6] == pytest.approx(0.5) and values[10] == pytest.approx(0.0)


def test_schedule_errors_name_the_key():
    with pytest.raises(ValueError, match="total_training_steps"):
        build_lr_scheduler(optimizer(), {"lr_scheduler_type": "cosine"})
    with pytest.raises(ValueError, match="lr_scheduler_type='linear'"):
        build_lr_scheduler(optimizer(), {"lr_scheduler_type": "linear"})


def test_adamw_is_fused_and_steps_like_the_float64_textbook_update():
    """Five steps of the fused AdamW against AdamW written out by hand in float64 (bias-corrected
    moments, decoupled weight decay)."""
    torch.manual_seed(0)
    start = torch.randn(3, 4)
    grads = [torch.randn(3, 4) for _ in range(5)]
    param = torch.nn.Parameter(start.clone())
    cfg = {"lr": 0.1, "weight_decay": 0.01, "betas": [0.9, 0.95], "eps": 1e-8}
    opt = build_optimizer([param], cfg)
    assert opt.defaults["fused"] is True
    p, m, v = start.double(), torch.zeros(3, 4, dtype=torch.float64), torch.zeros(3, 4, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        param.grad = g.clone()
        opt.step()
        g = g.double()
        p = p * (1 - cfg["lr"] * cfg["weight_decay"])
        m = 0.9 * m + 0.1 * g
        v = 0.95 * v + 0.05 * g * g
        p = p - cfg["lr"] * (m / (1 - 0.9**t)) / ((v / (1 - 0.95**t)).sqrt() + cfg["eps"])
    torch.testing.assert_close(param.detach().double(), p, atol=1e-6, rtol=1e-6)
