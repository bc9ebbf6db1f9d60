"""What the training loop keeps about each step besides its metrics.

- `NonFiniteStreak`: the workers skip an optimizer step whose gradient norm is NaN/inf and report
  it (`*/skipped_nonfinite_grad`); the streak counts such steps in a row, and the loop stops with
  `NonFiniteLossError` after `trainer.max_consecutive_nonfinite_steps` of them, before that step's
  checkpoint, so the last checkpoint holds weights the skipped updates never touched.
- `dump_rollouts`: `<trainer.rollout_data_dir>/<step>.jsonl`, one line per trained sample.
- `dump_generations`: upstream's sample dump, `<dir>/<step>.jsonl` with a field per column (the
  validator's `trainer.validation_data_dir` and upstream's `_dump_generations` write it).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from verl.protocol import DataProto

NONFINITE_METRICS = ("actor/skipped_nonfinite_grad", "critic/skipped_nonfinite_grad")
"""Metrics the workers report per update: > 0 when an optimizer step was skipped for a NaN/inf gradient."""


class NonFiniteLossError(RuntimeError):
    """`trainer.max_consecutive_nonfinite_steps` steps in a row had a NaN/inf loss or gradient."""


class NonFiniteStreak:
    """Steps in a row whose actor or critic skipped an update; limit None never stops."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.num_in_a_row = 0

    def record(self, metrics: dict[str, Any]) -> bool:
        """Count the step (adds `training/nonfinite_steps_in_a_row`); True when the limit is reached."""
        skipped = any(metrics.get(key, 0.0) > 0 for key in NONFINITE_METRICS)
        self.num_in_a_row = self.num_in_a_row + 1 if skipped else 0
        metrics["training/nonfinite_steps_in_a_row"] = self.num_in_a_row
        return self.limit is not None and self.num_in_a_row >= self.limit

    def error(self, step: int) -> NonFiniteLossError:
        n = self.num_in_a_row
        steps = f"steps {step - n + 1}-{step}" if n > 1 else f"step {step}"
        return NonFiniteLossError(
            f"stopping: the loss or gradient norm was NaN or infinite in {n} steps in a row ({steps}; "
            f"trainer.max_consecutive_nonfinite_steps={n}), so their updates were skipped and the model stopped "
            "learning. Usual causes: rewards of extreme magnitude (see critic/score/*), a learning rate that is too "
            "high, or fp16 overflow. Fix the cause (lower actor_rollout_ref.actor.optim.lr, rescale the reward, "
            "train in bf16 or fp32) and resume: the checkpoints in trainer.default_local_dir are untouched"
        )


def dump_rollouts(batch: DataProto, tokenizer, directory: str, step: int) -> None:
    """`<directory>/<step>.jsonl`: one line per trained sample (uid, input, output, score, the number
    of images of a vision-language prompt, and when generation runs ahead the oldest and newest weight
    versions that generated it)."""
    os.makedirs(directory, exist_ok=True)
    inputs = tokenizer.batch_decode(batch.batch["prompts"], skip_special_tokens=True)
    outputs = tokenizer.batch_decode(batch.batch["responses"], skip_special_tokens=True)
    scores = batch.batch["token_level_scores"].sum(-1).tolist()
    versions = batch.non_tensor_batch.get("weight_version")
    newest = batch.non_tensor_batch.get("weight_version_max")
    media = batch.non_tensor_batch.get("multi_modal_data")
    with open(os.path.join(directory, f"{step}.jsonl"), "w") as f:
        for i, uid in enumerate(batch.non_tensor_batch["uid"]):
            row = {"step": step, "uid": str(uid), "input": inputs[i], "output": outputs[i], "score": scores[i]}
            if media is not None:  # the decoded input drops the image tokens (special tokens)
                row["num_images"] = len((media[i] or {}).get("images", []))
            if versions is not None:
                row["weight_version"] = int(versions[i])
            if newest is not None:
                row["weight_version_max"] = int(newest[i])
            f.write(json.dumps(row) + "\n")


def dump_generations(directory: str, step: int, columns: dict[str, list]) -> str:
    """Write `<directory>/<step>.jsonl`: one line per sample, a field per column that holds one value per
    sample (as upstream, a reward extra value some batches lacked is left out), plus `step`. The sample
    count is that of `columns["score"]`. Returns the file's path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{step}.jsonl")
    num_samples = len(columns["score"])
    columns = {key: values for key, values in columns.items() if len(values) == num_samples}
    with open(path, "w") as f:
        for i in range(num_samples):
            row = {key: _plain(values[i]) for key, values in columns.items()}
            row["step"] = step
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def _plain(value):
    """A JSON-serialisable form of one value (numpy scalars and arrays become Python numbers and lists)."""
    return value.tolist() if isinstance(value, np.ndarray | np.generic) else value
