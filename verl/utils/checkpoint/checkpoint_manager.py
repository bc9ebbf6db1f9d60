"""What every checkpoint manager shares: which contents to save/load, retention, resume lookup.

The trainer writes `<default_local_dir>/global_step_<n>/<role>/` per role and then the tracker
file `latest_checkpointed_iteration.txt` holding `n`; resuming reads the tracker.

Retention (`max_ckpt_to_keep`): the managers here call `register_checkpoint` after a save has
completed, which deletes the oldest checkpoints beyond the limit; a crash mid-save therefore never
leaves fewer complete checkpoints than the limit. `ensure_checkpoint_capacity` is upstream's other
order (make room *before* saving, keeping `max_ckpt_to_keep - 1`), for callers short of disk.

`should_save_ckpt_esi` answers whether a cloud capacity reservation (an "elastic server instance"
of Volcano Engine ML Platform or an AWS SageMaker capacity block) expires before another training
step plus a checkpoint save could finish, from the expiry timestamp those platforms put in the
environment.
"""

from __future__ import annotations

import os
import random
import shutil
import time

import torch

from verl.utils.checkpoint.safe_load import numpy_rng_state, set_numpy_rng_state
from verl.utils.device import get_torch_device, is_cuda_available

__all__ = [
    "BaseCheckpointManager",
    "find_latest_ckpt_path",
    "get_checkpoint_tracker_filename",
    "should_save_ckpt_esi",
    "write_checkpoint_tracker",
]

_VALID_CONTENTS = ("model", "optimizer", "extra", "hf_model")


def get_checkpoint_tracker_filename(root_path: str) -> str:
    return os.path.join(root_path, "latest_checkpointed_iteration.txt")


def write_checkpoint_tracker(root_path: str, step: int) -> None:
    """Point the tracker file at `global_step_<step>`: written to a temp file, fsynced, then renamed,
    so a crash leaves either the old or the new step, never a torn file. Call it only after every
    part of the step's checkpoint is on disk."""
    path = get_checkpoint_tracker_filename(root_path)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(step))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def find_latest_ckpt_path(path: str | None, directory_format: str = "global_step_{}") -> str | None:
    """The newest `global_step_<n>` directory under `path` per the tracker file, or None."""
    if path is None:
        return None
    tracker = get_checkpoint_tracker_filename(path)
    if not os.path.exists(tracker):
        return None
    with open(tracker) as f:
        step = int(f.read().strip())
    ckpt = os.path.join(path, directory_format.format(step))
    return ckpt if os.path.exists(ckpt) else None


class BaseCheckpointManager:
    """Holds model/optimizer/scheduler/processing class and the save/load content lists.

    `checkpoint_config` keys (upstream): `save_contents` and `load_contents`, lists drawn from
    model, optimizer, extra (lr scheduler + RNG), hf_model (full HF weights in `huggingface/`).
    """

    def __init__(self, model, optimizer=None, lr_scheduler=None, processing_class=None, checkpoint_config=None):
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.processing_class = processing_class
        cfg = checkpoint_config or {}
        self.save_contents = list(cfg.get("save_contents", None) or ["model", "optimizer", "extra"])
        self.load_contents = list(cfg.get("load_contents", None) or self.save_contents)
        for key, contents in (("save_contents", self.save_contents), ("load_contents", self.load_contents)):
            unknown = [c for c in contents if c not in _VALID_CONTENTS]
            if unknown:
                raise ValueError(f"checkpoint.{key} has unknown entries {unknown}; valid: {list(_VALID_CONTENTS)}")
        self.previous_saved_paths: list[str] = []

    @staticmethod
    def remove_previous_save_local_path(path: str | list[str]) -> None:
        """Delete checkpoint directories (a path or a list of paths); missing ones are skipped."""
        for one in [path] if isinstance(path, str) else path:
            if os.path.exists(one):
                shutil.rmtree(one, ignore_errors=True)

    def register_checkpoint(self, new_path: str, max_ckpt_to_keep: int | None) -> None:
        """Record a completed checkpoint and delete the oldest ones beyond `max_ckpt_to_keep`
        (None or <= 0: keep all). Saving to a path already recorded moves it to the newest place."""
        if new_path in self.previous_saved_paths:
            self.previous_saved_paths.remove(new_path)
        self.previous_saved_paths.append(new_path)
        if not max_ckpt_to_keep or max_ckpt_to_keep <= 0:
            return
        excess = len(self.previous_saved_paths) - max_ckpt_to_keep
        if excess > 0:
            self.remove_previous_save_local_path(self.previous_saved_paths[:excess])
            self.previous_saved_paths = self.previous_saved_paths[excess:]

    def ensure_checkpoint_capacity(self, max_ckpt_to_keep: int | None) -> None:
        """Before a save: delete the oldest checkpoints so that `max_ckpt_to_keep - 1` remain (the
        save then makes `max_ckpt_to_keep`). Does nothing for None or a limit below 2, so the only
        checkpoint is never deleted before its replacement exists."""
        if not max_ckpt_to_keep or max_ckpt_to_keep < 2:
            return
        excess = len(self.previous_saved_paths) - (max_ckpt_to_keep - 1)
        if excess > 0:
            self.remove_previous_save_local_path(self.previous_saved_paths[:excess])
            self.previous_saved_paths = self.previous_saved_paths[excess:]

    @staticmethod
    def get_rng_state() -> dict:
        state = {"cpu": torch.get_rng_state(), "numpy": numpy_rng_state(), "random": random.getstate()}
        if is_cuda_available():
            state["device"] = get_torch_device().get_rng_state()
        return state

    @staticmethod
    def load_rng_state(state: dict) -> None:
        torch.set_rng_state(state["cpu"])
        set_numpy_rng_state(state["numpy"])
        random.setstate(state["random"])
        if is_cuda_available() and "device" in state:
            get_torch_device().set_rng_state(state["device"])


# Expiry timestamps (seconds since the epoch) that cloud platforms set for a capacity reservation.
_ESI_EXPIRY_ENV_VARS = (
    "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP",  # Volcano Engine ML Platform
    "SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP",  # AWS SageMaker
)


def should_save_ckpt_esi(max_steps_duration: float, save_ckpt_duration: float = 60, redundant_time: float = 0) -> bool:
    """Whether to checkpoint now because the instance's capacity reservation expires within one more
    step (`max_steps_duration`, the longest step so far, in seconds) plus a save
    (`save_ckpt_duration`) plus a margin (`redundant_time`). False when no expiry is set (or it
    cannot be read), and on Volcano Engine also once the reservation has expired or before any step
    was timed (`max_steps_duration` <= 0)."""
    mlp, sagemaker = (os.environ.get(name) for name in _ESI_EXPIRY_ENV_VARS)
    budget = save_ckpt_duration + max_steps_duration + redundant_time
    if mlp:
        try:
            remaining = float(mlp) - time.time()
        except ValueError:
            return False
        return remaining > 0 and max_steps_duration > 0 and remaining <= budget
    if sagemaker:
        try:
            remaining = float(int(sagemaker)) - time.time()
        except ValueError:
            return False
        return remaining < budget
    return False
