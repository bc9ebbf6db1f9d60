"""`main_ppo` with multi-token prediction on the megatron actor, end to end on CPU: the bundled model
with one MTP layer added (MiMo's layout), trained with upstream's mimo-example keys for two GRPO steps
at tp=2, at pp=2 and at cp=2, and checkpointed: the built-in rollout engine loads the checkpoint without its MTP layer, the
MTP loss is logged under upstream's name (finite, positive) and the actor's checkpoint is written
(that megatron checkpoints hold the MTP layers is checked in tests/models/mcore/test_mcore_mtp.py)."""

from __future__ import annotations

import math
import shutil

import pytest

from tests.models.mcore.test_mcore_mtp import add_mtp_layer
from tests.trainer.main_ppo_runs import common_overrides, main_ppo_cmd, model_path, read_metrics, run_main_ppo

pytestmark = pytest.mark.slow  # the slow tier (make test-all, CI): see docs/testing.md


@pytest.mark.parametrize(
    "layout",
    ["tensor_model_parallel_size=2", "pipeline_model_parallel_size=2", "context_parallel_size=2"],
    ids=["tp2", "pp2", "cp2"],
)
def test_grpo_trains_the_mtp_layer_beside_the_policy(tmp_path, shared_ray_cluster, layout):
    from transformers import AutoConfig

    model = tmp_path / "mtp-model"
    shutil.copytree(model_path(), model)
    add_mtp_layer(model, AutoConfig.from_pretrained(model))
    run_main_ppo(
        main_ppo_cmd(
            "arith_demo_megatron",
            f"actor_rollout_ref.actor.megatron.{layout}",
            "actor_rollout_ref.model.mtp.enable=True",
            "actor_rollout_ref.model.mtp.enable_train=True",
            "actor_rollout_ref.model.mtp.mtp_loss_scaling_factor=0.1",
            "actor_rollout_ref.model.mtp.detach_encoder=True",
            "trainer.save_freq=2",
            *common_overrides(tmp_path, steps=2, model=str(model)),
        ),
        tmp_path,
        cluster=shared_ray_cluster,
    )
    rows = [r["data"] for r in read_metrics(tmp_path) if "actor/pg_loss" in r["data"]]
    assert len(rows) == 2
    losses = [row["mtp_losses/mtp_1_loss"] for row in rows]
    assert all(math.isfinite(x) and x > 0 for x in losses), losses
    assert (tmp_path / "ckpt" / "global_step_2" / "actor" / "dist_ckpt" / "metadata.json").is_file()
