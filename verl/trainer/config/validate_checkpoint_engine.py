"""Rules of `actor_rollout_ref.rollout.checkpoint_engine.backend` that span sections.

Split from validate.py. The section's own rules (`engine_kwargs` under the selected backend's name,
the nccl options) live in `CheckpointEngineConfig.__post_init__`; `hccl` is refused by its field
declaration (Ascend NPUs). Left here: what the backend needs from the rest of the run.

- nccl is upstream's transport for a disaggregated rollout (trainer and rollout in different
  workers). Here that is the separate rollout pool of asynchronous training; a colocated run
  (staleness_threshold 0) has no pool to broadcast to, and upstream's colocated path is naive, so
  nccl there is refused rather than silently meaning naive. NCCL exists only on NVIDIA GPUs: on CPU
  the same broadcast runs over gloo, which is what naive does there (`trainer.device=auto` counts as
  CPU on a machine where torch sees no CUDA GPU).
- nixl: this build has no NIXL transport. Refused, naming the library when it is missing.
"""

from __future__ import annotations

import importlib.util

_KEY = "actor_rollout_ref.rollout.checkpoint_engine.backend"


def check_checkpoint_engine(c: dict, errors: list[str]) -> None:
    backend = c["actor_rollout_ref"]["rollout"]["checkpoint_engine"]["backend"]
    staleness = c["async_training"]["staleness_threshold"]
    if backend == "nccl":
        device = _device(c["trainer"]["device"])
        if device is not None:
            errors.append(
                f"{_KEY}=nccl needs NVIDIA GPUs (NCCL), but {device}; on CPU set {_KEY}=naive, which "
                "broadcasts the weights to a separate rollout pool over gloo"
            )
        elif staleness <= 0:
            errors.append(
                f"{_KEY}=nccl sends the weights to a separate rollout pool, but async_training.staleness_threshold="
                f"{staleness} colocates the rollout with the trainer (the hybrid engine loads them in process, "
                f"upstream's naive path); set async_training.staleness_threshold >= 1 for a rollout pool of its own "
                f"(rollout.nnodes x rollout.n_gpus_per_node workers), or {_KEY}=naive"
            )
    elif backend == "nixl":
        if importlib.util.find_spec("nixl") is None:
            why = "needs the NIXL library (the nixl package), which is not installed, and this build has no NIXL transport"
        else:
            why = "is not implemented in this build (no NIXL transport, although the nixl package is installed)"
        errors.append(
            f"{_KEY}=nixl {why}; for a separate rollout pool on a fixed cluster set {_KEY}=nccl (GPUs) or naive "
            "(its bucketed broadcast over the device's backend)"
        )


def _device(device: str) -> str | None:
    """How the run ends up on CPU, in words, or None when it runs on GPUs."""
    if device == "cpu":
        return "trainer.device=cpu"
    if device == "auto":
        import torch  # only for backend=nccl: the check stays light otherwise

        if not torch.cuda.is_available():
            return "trainer.device=auto picks the CPU on this machine (torch sees no CUDA GPU)"
    return None
