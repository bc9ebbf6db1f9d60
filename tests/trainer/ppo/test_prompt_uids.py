"""Prompt uids: GRPO groups rows by uid, so two prompts must never share one within a step."""

import numpy as np
import torch

from verl.trainer.ppo.ray_trainer import RayPPOTrainer


def _trainer_over(batches: list[dict]) -> RayPPOTrainer:
    # only what _next_batch reads: the dataloader, the step counter and the uid bookkeeping
    trainer = object.__new__(RayPPOTrainer)
    trainer.train_dataloader = batches
    trainer._train_iter = None
    trainer._uids_drawn = (-1, 0)
    trainer.global_steps = 1
    return trainer


def _batch(first_prompt: int) -> dict:
    ids = torch.arange(first_prompt, first_prompt + 3).unsqueeze(1)
    return {"input_ids": ids, "raw_prompt": np.array([f"p{i}" for i in ids.squeeze(1).tolist()], dtype=object)}


def test_batches_drawn_within_one_step_get_distinct_uids_and_a_new_step_starts_at_zero():
    """Dynamic sampling draws several batches in one step; their uids continue the step's count
    (the first batch keeps `<step>_0..`), and the next step starts again at `<step>_0`."""
    trainer = _trainer_over([_batch(0), _batch(3), _batch(6)])
    first = trainer._next_batch().non_tensor_batch["uid"].tolist()
    second = trainer._next_batch().non_tensor_batch["uid"].tolist()
    assert first == ["1_0", "1_1", "1_2"]
    assert second == ["1_3", "1_4", "1_5"]
    trainer.global_steps = 2
    assert trainer._next_batch().non_tensor_batch["uid"].tolist() == ["2_0", "2_1", "2_2"]
