"""The driver's checkpointer: save a step, find the step to resume from, prune old steps.

A component the training loop calls (`checkpointer.save(step, driver_state)`,
`checkpointer.load()`), built from explicit parts: the trainer section of the config and the
worker groups whose state it writes. It never sees the trainer object, so it can be tested with
any object that has `save_checkpoint(dir, step, max_to_keep)` / `load_checkpoint(dir)`.

Layout (upstream's): `<default_local_dir>/global_step_N/{actor,critic,data.pt}` plus
`latest_checkpointed_iteration.txt`. `data.pt` is written to a temporary name and renamed once
the workers' parts are on disk, and the tracker file is written last, so a crash during a save leaves the previous checkpoint the one
resumed from. What goes into `data.pt` (dataloader position, RNG states, KL coefficient, queued
async groups) is the caller's business: the checkpointer stores and returns that dict unchanged.

Background writes (`actor.checkpoint.async_save` / `critic.checkpoint.async_save`): the worker
groups return as soon as their state is copied to host memory and write it on a thread. The step
is then pending: `finish_pending(wait=False)`, which the loop calls after every step, asks the
groups whether they are done, and only when every rank of every group is, the tracker file moves
to the step, old steps are pruned and the step is copied to `trainer.default_hdfs_dir`. The next
save and the end of training (`finish_pending(wait=True)`) wait for a pending step. So the tracker
never names an incomplete checkpoint, and a crash mid-write resumes from the previous one. Upstream
instead never writes the tracker under async_save (its Megatron writer moves it itself); the
result on disk is the same once the write is complete. Retention is the driver's alone under
async_save (the workers get no `max_to_keep`), so no step is deleted while the tracker still
names it.

`trainer.default_hdfs_dir`: after the tracker moves, `global_step_N/` is copied whole (actor,
critic, data.pt) to `<default_hdfs_dir>/global_step_N/`, followed by a tracker file there, so
the copy is itself a directory to resume from (copy it back and point default_local_dir at it).
A local directory or `file://` path is copied with shutil (into a `.tmp` name, then renamed), an
`hdfs://` one with `hdfs dfs -put` (verl.utils.fs). As upstream, copies are never deleted:
`max_*_ckpt_to_keep` prunes the local directory only.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from verl.utils.checkpoint.checkpoint_manager import (
    copy_checkpoint_step,
    find_latest_ckpt_path,
    write_checkpoint_tracker,
)
from verl.utils.checkpoint.safe_load import torch_load
from verl.utils.logging_utils import get_logger

logger = get_logger(__name__, "INFO")


class Checkpointer:
    """Writes and reads the driver's checkpoints; see the module docstring for the layout.

    trainer_cfg: the `trainer` config section (default_local_dir, resume_mode, resume_from_path,
        max_actor_ckpt_to_keep, max_critic_ckpt_to_keep, default_hdfs_dir).
    actor_wg: the actor worker group; critic_wg: the critic worker group or None without a critic.
    async_save: the groups write in the background (`checkpoint.async_save`); they then also need
        `finish_checkpoint(wait) -> bool per rank`, which raises when a write failed.
    """

    def __init__(self, trainer_cfg, actor_wg, critic_wg=None, async_save: bool = False):
        self.trainer_cfg = trainer_cfg
        self.actor_wg = actor_wg
        self.critic_wg = critic_wg
        self.async_save = async_save
        self.pending_step: int | None = None
        self._pending_state: dict[str, Any] | None = None

    @property
    def root(self) -> str:
        return os.path.abspath(os.path.expanduser(self.trainer_cfg.default_local_dir))

    def save(self, step: int, driver_state: dict[str, Any]) -> str:
        """Write global_step_<step>/{actor,critic,data.pt}, then (at once, or under async_save once the
        groups report the write done) point the tracker file at it, prune and copy it."""
        self.finish_pending(wait=True)
        root = self.root
        step_dir = os.path.join(root, f"global_step_{step}")
        # under async_save the driver prunes, after the tracker has moved (see the module docstring)
        keep_actor = None if self.async_save else self.trainer_cfg.max_actor_ckpt_to_keep
        keep_critic = None if self.async_save else self.trainer_cfg.max_critic_ckpt_to_keep
        self.actor_wg.save_checkpoint(os.path.join(step_dir, "actor"), step, keep_actor)
        if self.critic_wg is not None:
            self.critic_wg.save_checkpoint(os.path.join(step_dir, "critic"), step, keep_critic)
        if self.async_save:
            self.pending_step, self._pending_state = step, driver_state
        else:
            self._complete(step, driver_state)
        return step_dir

    def finish_pending(self, wait: bool = True) -> bool:
        """Whether no step is pending any more (waiting for it with `wait`); a step whose writes are
        done on every rank is completed here (tracker, pruning, copy). A failed background write
        raises (the worker group's error, naming the checkpoint) and the step stays unpublished."""
        if self.pending_step is None:
            return True
        step = self.pending_step
        for wg in (self.actor_wg, self.critic_wg):
            if wg is None:
                continue
            try:
                done = wg.finish_checkpoint(wait)
            except BaseException:
                self.pending_step = self._pending_state = None  # never published; the previous step stays the latest
                raise
            if not (all(done) if isinstance(done, (list, tuple)) else done):
                return False
        state, self.pending_step, self._pending_state = self._pending_state, None, None
        self._complete(step, state)
        return True

    def _complete(self, step: int, driver_state: dict[str, Any]) -> None:
        """The workers' parts are on disk: write data.pt (last in the step directory: its presence
        marks a complete step), move the tracker, prune, copy."""
        root = self.root
        step_dir = os.path.join(root, f"global_step_{step}")
        os.makedirs(step_dir, exist_ok=True)
        tmp = os.path.join(step_dir, "data.pt.tmp")
        torch.save(driver_state, tmp)
        os.replace(tmp, os.path.join(step_dir, "data.pt"))
        write_checkpoint_tracker(root, step)
        self._remove_old(root)
        if self.trainer_cfg.get("default_hdfs_dir"):
            copy = copy_checkpoint_step(root, step, self.trainer_cfg.default_hdfs_dir)
            logger.info(f"copied global_step_{step} to {copy}")

    def _remove_old(self, root: str) -> None:
        keep = self.trainer_cfg.max_actor_ckpt_to_keep
        if not keep or keep <= 0:
            return
        steps = sorted(int(d.split("_")[-1]) for d in os.listdir(root) if d.startswith("global_step_"))
        for step in steps[:-keep]:
            shutil.rmtree(os.path.join(root, f"global_step_{step}"), ignore_errors=True)

    def resume_dir(self) -> str | None:
        """The global_step_N directory to resume from under `trainer.resume_mode`, or None."""
        mode = self.trainer_cfg.resume_mode
        if mode == "disable":
            return None
        if mode == "resume_path":
            path = self.trainer_cfg.resume_from_path
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
