"""When the old-log-prob pass is skipped (strictly on-policy: one epoch over one mini-batch): decided on the
step's actual batch, so data.gen_batch_size > train_batch_size without group filtering (every generated prompt
trains, in several mini-batches) computes them."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from verl.protocol import DataProto
from verl.trainer.config import load_ppo_config
from verl.trainer.ppo.ray_trainer import RayPPOTrainer


def _reuses(overrides: list[str], prompts: int | None) -> bool:
    config = load_ppo_config(overrides, config_name="arith_demo")
    n = config.actor_rollout_ref.rollout.n
    batch = None if prompts is None else DataProto.from_dict(tensors={"x": torch.zeros(prompts * n, 1)})
    return RayPPOTrainer._reuses_current_log_probs(SimpleNamespace(config=config), batch)


def test_one_mini_batch_of_the_steps_own_rows_skips_the_pass_and_more_do_not():
    one = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=4"]
    assert _reuses(one, None) and _reuses(one, 8)
    assert not _reuses([*one, "+data.gen_batch_size=16"], 16)  # 16 prompts trained: two mini-batches
    assert not _reuses([*one, "actor_rollout_ref.actor.ppo_epochs=2"], 8)
    assert not _reuses(["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4"], 8)


def test_rollout_log_probs_alone_keep_the_shortcut_and_tis_needs_the_pass():
    """rollout.calculate_log_probs is on by default (upstream v0.9.0): the update reports the rollout mismatch
    itself, so only a reader of old log-probs before the update (truncated IS here) brings the pass back."""
    one = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=4"]
    assert _reuses([*one, "actor_rollout_ref.rollout.calculate_log_probs=true"], 8)
    assert _reuses([*one, "actor_rollout_ref.rollout.calculate_log_probs=false"], 8)
    assert not _reuses(
        [*one, "actor_rollout_ref.rollout.calculate_log_probs=true", "actor_rollout_ref.actor.tis_imp_ratio_cap=2"], 8
    )
