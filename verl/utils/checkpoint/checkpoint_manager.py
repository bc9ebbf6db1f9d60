"""What every checkpoint manager shares: which contents to save/load, retention, resume lookup.

The trainer writes `<default_local_dir>/global_step_<n>/<role>/` per role and then the tracker
file `latest_checkpointed_iteration.txt` holding `n`; resuming reads the tracker.
"""

from __future__ import annotations

import os
import random
import shutil

import torch

from verl.utils.checkpoint.safe_load import numpy_rng_state, set_numpy_rng_state
from verl.utils.device import get_torch_device, is_cuda_available

__all__ = [
    "BaseCheckpointManager",
    "find_latest_ckpt_path",
    "get_checkpoint_tracker_filename",
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

    def _prune_old(self, max_ckpt_to_keep: int | None) -> None:
        """Delete the oldest saved checkpoints beyond `max_ckpt_to_keep` (only after a save succeeded)."""
        if not max_ckpt_to_keep or max_ckpt_to_keep <= 0:
            return
        while len(self.previous_saved_paths) > max_ckpt_to_keep:
            shutil.rmtree(self.previous_saved_paths.pop(0), ignore_errors=True)

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
