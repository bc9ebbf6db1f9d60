"""Upstream's optimizer keys: `optim.optimizer` / `optimizer_impl` / `override_optimizer_config`,
`lr_scheduler_type` with its older `warmup_style`, Megatron's `lr_decay_style` family, and
`optim.clip_grad` against `grad_clip`. Schedules are checked at given steps against hand-computed
values and, for Megatron's, against megatron-core's own scheduler."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from verl.utils.optim import build_lr_scheduler, build_optimizer, grad_clip, optimizer_class


def params():
    return [torch.nn.Parameter(torch.ones(3))]


def lrs(scheduler, steps):
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return out


# ------------------------------------------------------------------------------------ optimizer


def test_default_is_torch_adamw_with_the_configured_betas_and_overrides_merged_last():
    opt = build_optimizer(
        params(),
        {
            "lr": 0.1,
            "weight_decay": 0.0,
            "betas": [0.8, 0.9],
            "override_optimizer_config": {"eps": 1e-3, "amsgrad": True},
        },
    )
    assert type(opt) is torch.optim.AdamW
    group = opt.param_groups[0]
    assert (group["betas"], group["eps"], group["amsgrad"], group["lr"]) == ((0.8, 0.9), 1e-3, True, 0.1)


def test_sgd_from_torch_optim_steps_like_the_hand_worked_update():
    cfg = {"optimizer": "SGD", "optimizer_impl": "torch.optim", "lr": 0.1, "weight_decay": 0.01}
    cfg["override_optimizer_config"] = {"momentum": 0.5}
    (p,) = params()
    opt = build_optimizer([p], cfg)
    assert type(opt) is torch.optim.SGD and "betas" not in opt.defaults
    for _ in range(2):
        p.grad = torch.full_like(p, 0.5)
        opt.step()
    # step 1: d = 0.5 + 0.01*1 = 0.51, buf = 0.51, p = 0.949
    # step 2: d = 0.5 + 0.01*0.949 = 0.50949, buf = 0.5*0.51 + 0.50949 = 0.76449, p = 0.949 - 0.076449
    assert p[0].item() == pytest.approx(0.949 - 0.076449, rel=1e-6)


@pytest.mark.parametrize("name, cls", [("adam", torch.optim.AdamW), ("sgd", torch.optim.SGD)])
def test_megatron_sections_name_the_optimizer_without_a_module(name, cls):
    assert optimizer_class({"optimizer": name}) is cls


def test_an_uninstalled_optimizer_package_fails_naming_it_and_the_torch_fallback():
    with pytest.raises(ImportError, match="pip install bitsandbytes") as err:
        build_optimizer(params(), {"optimizer": "AdamW8bit", "optimizer_impl": "bitsandbytes.optim", "lr": 1e-3})
    assert "optim.optimizer_impl=torch.optim" in str(err.value)


def test_an_unknown_class_or_argument_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="AdamW") as err:
        optimizer_class({"optimizer": "AdamX", "optimizer_impl": "torch.optim"})
    assert "SGD" in str(err.value)
    with pytest.raises(ValueError, match="'momentum'.*AdamW") as err:
        build_optimizer(params(), {"lr": 1e-3, "override_optimizer_config": {"momentum": 0.9}})
    assert "amsgrad" in str(err.value)


# ------------------------------------------------------------------------------- FSDP schedules


def test_warmup_style_the_older_name_wins_over_lr_scheduler_type_as_upstream():
    cfg = {"warmup_style": "cosine", "lr_scheduler_type": "constant", "total_training_steps": 4}
    with pytest.warns(DeprecationWarning, match="warmup_style"):
        scheduler = build_lr_scheduler(build_optimizer(params(), {"lr": 1.0}), cfg)
    assert lrs(scheduler, 5) == pytest.approx(
        [1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 - math.cos(math.pi / 4)), 0.0]
    )


def test_lr_scheduler_type_alone_and_its_default():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        constant = build_lr_scheduler(build_optimizer(params(), {"lr": 2.0}), {"lr_scheduler_type": "constant"})
    assert lrs(constant, 3) == [2.0, 2.0, 2.0]
    assert lrs(build_lr_scheduler(build_optimizer(params(), {"lr": 2.0}), {}), 2) == [2.0, 2.0]


def test_cosine_num_cycles_one_goes_down_to_the_floor_and_back_up():
    cfg = {"lr_scheduler_type": "cosine", "total_training_steps": 8, "num_cycles": 1.0, "min_lr_ratio": 0.2}
    cfg["lr_warmup_steps"] = 0
    values = lrs(build_lr_scheduler(build_optimizer(params(), {"lr": 1.0}), cfg), 9)
    # progress p = s/8: factor 0.2 + 0.8 * (1 + cos(2 pi p)) / 2
    assert values[0] == pytest.approx(1.0)
    assert values[2] == pytest.approx(0.6)
    assert values[4] == pytest.approx(0.2)
    assert values[8] == pytest.approx(1.0)


def test_lr_warmup_steps_wins_over_the_ratio():
    cfg = {
        "lr_scheduler_type": "constant",
        "lr_warmup_steps": 2,
        "lr_warmup_steps_ratio": 0.5,
        "total_training_steps": 10,
    }
    assert lrs(build_lr_scheduler(build_optimizer(params(), {"lr": 1.0}), cfg), 4) == [0.0, 0.5, 1.0, 1.0]


# --------------------------------------------------------------------------- Megatron schedules


def megatron_section(**overrides):
    cfg = {
        "optimizer": "adam",
        "lr": 1.0,
        "min_lr": 0.1,
        "lr_warmup_init": 0.0,
        "lr_warmup_steps": 2,
        "lr_decay_steps": 10,
        "lr_decay_style": "linear",
        "total_training_steps": 20,
        "weight_decay": 0.0,
    }
    cfg.update(overrides)
    return cfg


def test_megatron_linear_decay_hand_worked():
    cfg = megatron_section(lr_warmup_init=0.2)
    values = lrs(build_lr_scheduler(build_optimizer(params(), cfg), cfg), 13)
    # warm-up 0.2 -> 1 over 2 steps (inclusive), then 1 -> 0.1 linearly until step 10, 0.1 after
    assert values[:3] == pytest.approx([0.2, 0.6, 1.0])
    assert values[6] == pytest.approx(0.1 + 0.9 * (1 - 4 / 8))
    assert values[10:] == pytest.approx([0.1, 0.1, 0.1])


@pytest.mark.parametrize(
    "overrides",
    [
        dict(lr_decay_style="constant"),
        dict(lr_decay_style="linear"),
        dict(lr_decay_style="cosine", lr_decay_steps=None),
        dict(lr_decay_style="inverse-square-root"),
        dict(lr_decay_style="inverse_square_root", lr_warmup_steps=-1, lr_warmup_steps_ratio=0.25),
        dict(lr_decay_style="WSD", lr_wsd_decay_steps=4, lr_wsd_decay_style="exponential"),
        dict(lr_decay_style="WSD", lr_wsd_decay_steps=3, lr_wsd_decay_style="minus_sqrt"),
        dict(lr_decay_style="WSD", lr_wsd_decay_steps=5, lr_wsd_decay_style="cosine"),
    ],
)
def test_megatron_schedules_equal_megatron_cores_scheduler(overrides):
    pytest.importorskip("megatron.core.optimizer_param_scheduler", reason="needs megatron-core")
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    cfg = megatron_section(**overrides)
    ours = lrs(build_lr_scheduler(build_optimizer(params(), cfg), cfg), 24)
    decay = cfg["lr_decay_steps"] or cfg["total_training_steps"]
    warmup = cfg["lr_warmup_steps"] if cfg["lr_warmup_steps"] > 0 else int(cfg["lr_warmup_steps_ratio"] * decay)
    style = cfg["lr_decay_style"].replace("_", "-") if "square" in cfg["lr_decay_style"] else cfg["lr_decay_style"]
    reference = OptimizerParamScheduler(
        torch.optim.SGD(params(), lr=cfg["lr"]),
        init_lr=cfg["lr_warmup_init"],
        max_lr=cfg["lr"],
        min_lr=cfg["min_lr"],
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=style,
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=decay,
        wd_incr_style="constant",
        wsd_decay_steps=cfg.get("lr_wsd_decay_steps"),
        lr_wsd_decay_style=cfg.get("lr_wsd_decay_style"),
    )
    expected = []
    for _ in range(24):
        expected.append(reference.get_lr(reference.optimizer.param_groups[0]))
        reference.step(1)
    assert ours == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert len(set(round(v, 9) for v in ours)) > 1 or cfg["lr_decay_style"] == "constant"


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(lr_decay_style="exponential"), "lr_decay_style='exponential'"),
        (dict(lr_decay_steps=2), "lr_decay_steps=2"),
        (dict(lr_decay_style="WSD"), "lr_wsd_decay_steps"),
        (dict(min_lr=2.0), "min_lr"),
        (dict(weight_decay_incr_style="exponential"), "weight_decay_incr_style"),
    ],
)
def test_megatron_schedule_errors_name_the_key(overrides, match):
    cfg = megatron_section(**overrides)
    with pytest.raises(ValueError, match=match):
        build_lr_scheduler(build_optimizer(params(), {"lr": 1.0}), cfg)


# ------------------------------------------------------------------------------- gradient clip


@pytest.mark.parametrize(
    "section, expected",
    [
        ({"grad_clip": 1.0, "optim": {"clip_grad": 1.0}}, 1.0),
        ({"grad_clip": 1.0, "optim": {"clip_grad": 0.3}}, 0.3),  # upstream's newer name, changed
        ({"grad_clip": 0.5, "optim": {"clip_grad": 1.0}}, 0.5),  # the older name, changed
        ({"grad_clip": 0.5}, 0.5),
        ({"optim": {"clip_grad": 2.0}}, 2.0),
        ({}, None),
    ],
)
def test_grad_clip_reads_either_name(section, expected):
    assert grad_clip(section) == expected


def test_two_different_grad_clips_are_refused_naming_both_keys():
    with pytest.raises(ValueError, match=r"critic.grad_clip=0.5 and critic.optim.clip_grad=2.0"):
        grad_clip({"grad_clip": 0.5, "optim": {"clip_grad": 2.0}}, "critic")
