"""The driver's checkpointer: save a step, find the step to resume from, prune old steps.

A component the training loop calls (`checkpointer.save(step, driver_state)`,
`checkpointer.load()`), built from explicit parts: the trainer section of the config and the
worker groups whose state it writes. It never sees the trainer object, so it can be tested with
any object that has `save_checkpoint(dir, step, max_to_keep)` / `load_checkpoint(dir)`.

Layout (upstream's): `<default_local_dir>/global_step_N/{actor,critic,data.pt}` plus
`latest_checkpointed_iteration.txt`. `data.pt` is written to a temporary name and renamed, and the
tracker file is written last, so a crash during a save leaves the previous checkpoint the one
resumed from. What goes into `data.pt` (dataloader position, RNG states, KL coefficient, queued
async groups) is the caller's business: the checkpointer stores and returns that dict unchanged.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path, write_checkpoint_tracker
from verl.utils.checkpoint.safe_load import torch_load
from verl.utils.logging_utils import get_logger

logger = get_logger(__name__, "INFO")


class Checkpointer:
    """Writes and reads the driver's checkpoints; see the module docstring for the layout.

    trainer_cfg: the `trainer` config section (default_local_dir, resume_mode, resume_from_path,
        max_actor_ckpt_to_keep, max_critic_ckpt_to_keep).
    actor_wg: the actor worker group; critic_wg: the critic worker group or None without a critic.
    """

    def __init__(self, trainer_cfg, actor_wg, critic_wg=None):
        self.trainer_cfg = trainer_cfg
        self.actor_wg = actor_wg
        self.critic_wg = critic_wg

    @property
    def root(self) -> str:
        return os.path.abspath(os.path.expanduser(self.trainer_cfg.default_local_dir))

    def save(self, step: int, driver_state: dict[str, Any]) -> str:
        """Write global_step_<step>/{actor,critic,data.pt}, point the tracker file at it, prune."""
        root = self.root
        step_dir = os.path.join(root, f"global_step_{step}")
        self.actor_wg.save_checkpoint(
            os.path.join(step_dir, "actor"), step, self.trainer_cfg.get("max_actor_ckpt_to_keep")
        )
        if self.critic_wg is not None:
            self.critic_wg.save_checkpoint(
                os.path.join(step_dir, "critic"), step, self.trainer_cfg.get("max_critic_ckpt_to_keep")
            )
        tmp = os.path.join(step_dir, "data.pt.tmp")
        torch.save(driver_state, tmp)
        os.replace(tmp, os.path.join(step_dir, "data.pt"))
        write_checkpoint_tracker(root, step)
        self._remove_old(root)
        return step_dir

    def _remove_old(self, root: str) -> None:
        keep = self.trainer_cfg.get("max_actor_ckpt_to_keep")
        if not keep or keep <= 0:
            return
        steps = sorted(int(d.split("_")[-1]) for d in os.listdir(root) if d.startswith("global_step_"))
        for step in steps[:-keep]:
            shutil.rmtree(os.path.join(root, f"global_step_{step}"), ignore_errors=True)

    def resume_dir(self) -> str | None:
        """The global_step_N directory to resume from under `trainer.resume_mode`, or None."""
        mode = self.trainer_cfg.get("resume_mode", "auto")
        if mode == "disable":
            return None
        if mode == "resume_path":
            path = self.trainer_cfg.get("resume_from_path")
            if not path or "global_step_" not in os.path.basename(os.path.normpath(str(path))):
                raise ValueError(
                    f"trainer.resume_mode=resume_path needs trainer.resume_from_path pointing at a "
                    f"global_step_N directory, got {path!r}; e.g. "
                    f"trainer.resume_from_path={self.root}/global_step_10"
                )
            if not os.path.isdir(path):
                raise FileNotFoundError(f"trainer.resume_from_path={path} does not exist")
            return os.path.abspath(path)
        if mode != "auto":
            raise ValueError(f"trainer.resume_mode={mode!r} is not one of auto, disable, resume_path")
        return find_latest_ckpt_path(self.root)

    def load(self) -> dict[str, Any] | None:
        """Load the workers' state from the resume directory and return the driver state saved
        with it (None when there is nothing to resume)."""
        step_dir = self.resume_dir()
        if step_dir is None:
            return None
        # Said before loading, so a load that fails still names the directory it was reading.
        logger.info(f"resuming from {step_dir}")
        self.actor_wg.load_checkpoint(os.path.join(step_dir, "actor"))
        if self.critic_wg is not None:
            self.critic_wg.load_checkpoint(os.path.join(step_dir, "critic"))
        state = torch_load(os.path.join(step_dir, "data.pt"), "driver checkpoint state")
        state["step_dir"] = step_dir
        return state
