"""The hybrid worker's weight handoff from the trained actor to its rollout engine.

`sync_rollout_weights` streams the training engine's full weights, cast to the rollout's dtype
(`rollout_dtype`), into the colocated engine; `PendingWeights` is a rollout-only worker's view of the
versions the trainer broadcasts (asynchronous training, partial rollouts). Used by
`verl.workers.engine_workers.ActorRolloutRefWorker`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from verl.utils import device as dev
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import RolloutConfig

if TYPE_CHECKING:
    from verl.workers.engine import BaseEngine

__all__ = ["PendingWeights", "rollout_dtype", "sync_rollout_weights"]


def rollout_dtype(rollout_cfg) -> torch.dtype:
    """The dtype the rollout engine holds its weights in (`rollout.dtype`; auto: bf16 on an
    accelerator, fp32 on CPU): what weight sync casts to before gathering and sending."""
    from verl.workers.rollout.native.engine import resolve_dtype

    return resolve_dtype(omega_conf_to_dataclass(rollout_cfg, RolloutConfig).dtype, dev.get_device())


def sync_rollout_weights(engine: BaseEngine, rollout, dtype: torch.dtype) -> None:
    """The hybrid engine's weight sync: the trained model's full weights, cast to the rollout's
    `dtype` shard by shard, streamed into `rollout` (woken up first). Every rank calls it (the
    gathers are collectives); a rank without an engine (`rollout` None) only takes part in them.
    `engine` is the actor's training engine (`verl.workers.engine.BaseEngine`)."""
    with engine.on_device():
        params = engine.iter_hf_params(dtype)
        if rollout is None:
            for _ in params:
                pass
        else:
            rollout.wake_up()
            rollout.update_weights(params)


class PendingWeights:
    """A rollout-only worker's `WeightRefresh` for partial rollouts (see `HFRollout`): newer weights are
    pending once the trainer has announced a version newer than the one this worker holds."""

    def __init__(self, worker):  # an engine_workers.ActorRolloutRefWorker
        self.worker = worker

    @property
    def version(self) -> int:
        return self.worker.weight_version

    def pending(self) -> bool:
        latest = self.worker._weight_receiver.latest_version()
        received = self.worker._received_version
        return latest is not None and (received is None or latest > received)

    def load(self) -> int:
        self.worker._load_weight_version(self.worker._weight_receiver.latest_version())
        return self.version
