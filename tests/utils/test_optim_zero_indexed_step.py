"""optim.zero_indexed_step (upstream v0.9.0): false counts the cosine schedule's steps from 1."""

from __future__ import annotations

import math

import pytest
import torch

from verl.utils.optim import build_lr_scheduler
from verl.workers.config import FSDPOptimizerConfig


def _lrs(zero_indexed: bool, schedule: str = "cosine", steps: int = 4) -> list[float]:
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    cfg = FSDPOptimizerConfig(
        lr=1.0,
        lr_scheduler_type=schedule,
        total_training_steps=4,
        lr_warmup_steps=2,
        zero_indexed_step=zero_indexed,
    )
    sched = build_lr_scheduler(opt, cfg)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_cosine_counts_from_zero_or_one():
    # warm-up of 2 steps, then a half cosine over the remaining 2: factor(s) = s/2 for s < 2,
    # else 0.5 * (1 + cos(pi * (s - 2) / 2))
    def curve(s):
        return s / 2 if s < 2 else 0.5 * (1 + math.cos(math.pi * (s - 2) / 2))

    assert _lrs(True) == pytest.approx([0.0, 0.5, 1.0, 0.5])  # curve(0..3)
    assert _lrs(False) == pytest.approx([0.5, 1.0, 0.5, 0.0])  # curve(1..4)
    assert _lrs(False) == pytest.approx([curve(s) for s in range(1, 5)])


def test_constant_schedule_ignores_it_as_upstream():
    assert _lrs(True, "constant") == _lrs(False, "constant") == pytest.approx([0.0, 0.5, 1.0, 1.0])


def test_the_yaml_default_is_zero_indexed():
    from verl.trainer.config.loader import compose

    assert compose("ppo_trainer").actor_rollout_ref.actor.optim.zero_indexed_step is True
