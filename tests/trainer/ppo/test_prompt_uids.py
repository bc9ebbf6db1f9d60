"""Prompt uids: GRPO groups rows by uid, so two prompts must never share one within a step."""

import numpy as np
import torch

from verl.trainer.ppo.rollout_source import PromptStream


def _batch(first_prompt: int) -> dict:
    ids = torch.arange(first_prompt, first_prompt + 3).unsqueeze(1)
    return {"input_ids": ids, "raw_prompt": np.array([f"p{i}" for i in ids.squeeze(1).tolist()], dtype=object)}


def test_batches_drawn_within_one_step_get_distinct_uids_and_a_new_step_starts_at_zero():
    """Dynamic sampling draws several batches in one step; their uids continue the step's count
    (the first batch keeps `<step>_0..`), and the next step starts again at `<step>_0`."""
    step = [1]
    prompts = PromptStream([_batch(0), _batch(3), _batch(6)], current_step=lambda: step[0])
    first = prompts().non_tensor_batch["uid"].tolist()
    second = prompts().non_tensor_batch["uid"].tolist()
    assert first == ["1_0", "1_1", "1_2"]
    assert second == ["1_3", "1_4", "1_5"]
    step[0] = 2
    assert prompts().non_tensor_batch["uid"].tolist() == ["2_0", "2_1", "2_2"]


def test_the_stream_begins_a_new_epoch_when_the_last_ends_and_restarts_on_request():
    step = [1]
    prompts = PromptStream([_batch(0), _batch(3)], current_step=lambda: step[0])
    drawn = [prompts().batch["input_ids"][0, 0].item() for _ in range(3)]
    assert drawn == [0, 3, 0]  # the third call begins the second epoch
    prompts.restart()  # e.g. after the dataloader's position was loaded from a checkpoint
    assert prompts().batch["input_ids"][0, 0].item() == 0
