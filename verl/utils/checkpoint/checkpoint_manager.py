"""What every checkpoint manager shares: which contents to save/load, retention, resume lookup.

The trainer writes `<default_local_dir>/global_step_<n>/<role>/` per role and then the tracker
file `latest_checkpointed_iteration.txt` holding `n`; resuming reads the tracker.

Retention (`max_ckpt_to_keep`): the managers here call `register_checkpoint` after a save has
completed, which deletes the oldest checkpoints beyond the limit; a crash mid-save therefore never
leaves fewer complete checkpoints than the limit. `ensure_checkpoint_capacity` is upstream's other
order (make room *before* saving, keeping `max_ckpt_to_keep - 1`), for callers short of disk.

Background writes (`checkpoint.async_save`): a manager that supports them copies the state to
host memory in `save_checkpoint` (so training may change the live tensors at once), returns, and
writes the copy from a writer thread. One write is in flight at a time: the next save, a load, and
`finish_pending_save(wait=True)` wait for it first. A write that fails is kept and raised by the
next of those calls (and by `finish_pending_save(wait=False)`), naming the checkpoint; it is never
only logged. The caller points the tracker file at a checkpoint only once `finish_pending_save`
reports it done on every rank.

`copy_checkpoint_step` copies a complete `global_step_<n>` directory to a second place
(`trainer.default_hdfs_dir`: a local directory, `file://` or `hdfs://` through verl.utils.fs) with
a tracker file beside it; `remote_checkpoint_dir_problem` says before training why it could not.

`should_save_ckpt_esi` answers whether a cloud capacity reservation (an "elastic server instance"
of Volcano Engine ML Platform or an AWS SageMaker capacity block) expires before another training
step plus a checkpoint save could finish, from the expiry timestamp those platforms put in the
environment.
"""

from __future__ import annotations

import copy
import os
import random
import shutil
import tempfile
import threading
import time

import torch

from verl.utils import fs
from verl.utils.checkpoint.safe_load import numpy_rng_state, set_numpy_rng_state
from verl.utils.device import get_torch_device, is_cuda_available

__all__ = [
    "BackgroundSaveError",
    "BaseCheckpointManager",
    "copy_checkpoint_step",
    "remote_checkpoint_dir_problem",
    "find_latest_ckpt_path",
    "snapshot_to_host",
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


def remote_checkpoint_dir_problem(remote_root: str) -> str | None:
    """Why `copy_checkpoint_step` cannot copy to `remote_root` on this machine (one line, for a config
    check before training), or None."""
    if remote_root.startswith("hdfs://"):
        if shutil.which("hdfs") is None:
            return (
                "copying checkpoints to HDFS runs `hdfs dfs -put`, and no `hdfs` command is on PATH; install the "
                "Hadoop client (its bin/ on PATH), use a local or file:// directory, or set it to null"
            )
    elif "://" in remote_root and not remote_root.startswith("file://"):
        return "only hdfs://, file:// and local directories are supported; mount the storage and give its path, or set it to null"
    return None


def copy_checkpoint_step(root: str, step: int, remote_root: str) -> str:
    """Copy `<root>/global_step_<step>` to `<remote_root>/global_step_<step>` and point a tracker file
    there at it (a local directory, `file://` or `hdfs://`); returns the copy's path."""
    name = f"global_step_{step}"
    src = os.path.join(root, name)
    tracker_name = os.path.basename(get_checkpoint_tracker_filename(root))
    if fs.is_non_local(remote_root):
        fs.makedirs(remote_root, exist_ok=True)
        dst = remote_root.rstrip("/") + "/" + name
        fs.copy(src, remote_root)  # `hdfs dfs -put -f <src> <remote_root>` makes <remote_root>/global_step_N
        with tempfile.TemporaryDirectory() as tmp_dir:
            write_checkpoint_tracker(tmp_dir, step)
            fs.copy(os.path.join(tmp_dir, tracker_name), remote_root.rstrip("/") + "/" + tracker_name)
        return dst
    remote = os.path.abspath(os.path.expanduser(remote_root.removeprefix("file://")))
    dst = os.path.join(remote, name)
    os.makedirs(remote, exist_ok=True)
    tmp = dst + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(dst, ignore_errors=True)
    os.rename(tmp, dst)
    write_checkpoint_tracker(remote, step)
    return dst


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


def snapshot_to_host(obj):
    """A copy of a (nested) state dict whose tensors are fresh host-memory copies (DTensors stay
    DTensors, their local shards copied), so later in-place updates of the live state do not reach it."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((key, snapshot_to_host(value)) for key, value in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot_to_host(value) for value in obj)
    return copy.deepcopy(obj)


class BackgroundSaveError(RuntimeError):
    """A checkpoint written in the background (`checkpoint.async_save`) failed."""


class BaseCheckpointManager:
    """Holds model/optimizer/scheduler/processing class and the save/load content lists.

    `checkpoint_config` keys (upstream): `save_contents` and `load_contents`, lists drawn from
    model, optimizer, extra (lr scheduler + RNG), hf_model (full HF weights in `huggingface/`);
    `async_save` (write in the background, see the module docstring) where the manager supports it.
    """

    supports_async_save = False

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
        self.async_save = bool(cfg.get("async_save", False))
        if self.async_save and not self.supports_async_save:
            raise ValueError(
                f"checkpoint.async_save=true: {type(self).__name__} writes checkpoints synchronously only; "
                "set checkpoint.async_save=false (background writes are implemented for strategy=fsdp)"
            )
        self._pending: threading.Thread | None = None
        self._pending_path: str | None = None
        self._pending_error: BaseException | None = None

    def _start_background_save(self, path: str, write) -> None:
        """Run `write()` (which finishes the checkpoint at `path`) on a writer thread. Not a daemon
        thread: a process that exits normally still completes the write."""
        assert self._pending is None, "a background save is already in flight"

        def run():
            try:
                write()
            except BaseException as e:  # kept for finish_pending_save, which raises it in the caller's thread
                self._pending_error = e

        self._pending_path, self._pending_error = path, None
        self._pending = threading.Thread(target=run, name=f"checkpoint-writer:{os.path.basename(path)}")
        self._pending.start()

    def finish_pending_save(self, wait: bool = True) -> bool:
        """Whether no background write is in flight any more (waiting for it with `wait`). Raises
        `BackgroundSaveError` if the finished write failed; the checkpoint it wrote is then absent
        (its files stay in `<path>.tmp`) and the previous ones are untouched."""
        if self._pending is None:
            return True
        if not wait and self._pending.is_alive():
            return False
        self._pending.join()
        path, error = self._pending_path, self._pending_error
        self._pending = self._pending_path = self._pending_error = None
        if error is not None:
            raise BackgroundSaveError(
                f"writing checkpoint {path} in the background failed ({type(error).__name__}: {error}); it was not "
                "published, and the previous checkpoint remains the latest. Fix the cause (disk space, permissions) "
                "or set checkpoint.async_save=false to see the failure where it happens"
            ) from error
        return True

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
