"""Start-up checks of the checkpoint keys: `checkpoint.async_save` on a backend that writes in the
background (FSDP), and a `trainer.default_hdfs_dir` the driver can copy to (a local path, file://,
or hdfs:// with the `hdfs` command on PATH), so neither fails only at the first save."""

from __future__ import annotations

from verl.trainer.config.validate_batches import need_critic
from verl.utils.checkpoint.checkpoint_manager import remote_checkpoint_dir_problem


def check_checkpoints(c: dict, errors: list[str]):
    """checkpoint.async_save on a backend that writes in the background; a default_hdfs_dir the
    driver can copy to (a local path, file:// or hdfs:// with the `hdfs` command on PATH)."""
    roles = [("actor_rollout_ref.actor", c["actor_rollout_ref"]["actor"])]
    if need_critic(c):
        roles.append(("critic", c["critic"]))
    for prefix, section in roles:
        if section["checkpoint"]["async_save"] and section["strategy"] == "megatron":
            errors.append(
                f"{prefix}.checkpoint.async_save=true: background checkpoint writes are implemented for "
                f"strategy=fsdp only, and {prefix}.strategy=megatron; set {prefix}.checkpoint.async_save=false"
            )
    remote = c["trainer"]["default_hdfs_dir"]
    problem = remote_checkpoint_dir_problem(str(remote)) if remote else None
    if problem:
        errors.append(f"trainer.default_hdfs_dir={remote}: {problem}")
