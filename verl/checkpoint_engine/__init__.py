"""Upstream's checkpoint-engine API: weight transfer from a trainer worker group into rollout replicas
(see `base` for the protocol, `nccl_checkpoint_engine` for the bucketed broadcast)."""

from .base import (
    CheckpointEngine,
    CheckpointEngineManager,
    CheckpointEngineRegistry,
    CheckpointEngineWithCache,
    CheckpointEngineWorker,
    ColocatedCheckpointEngine,
    TensorMeta,
)
from .nccl_checkpoint_engine import NCCLCheckpointEngine

# upstream's Ascend (HCCL) and NIXL backends: not in this build, None as upstream's package leaves them
# where their libraries are missing
HCCLCheckpointEngine = None
NIXLCheckpointEngine = None

__all__ = [
    "CheckpointEngine",
    "CheckpointEngineManager",
    "CheckpointEngineRegistry",
    "CheckpointEngineWithCache",
    "CheckpointEngineWorker",
    "ColocatedCheckpointEngine",
    "NCCLCheckpointEngine",
    "TensorMeta",
]
