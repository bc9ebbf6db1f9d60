"""Training engines: one interface (`BaseEngine`), FSDP2 and Megatron-core backends, a registry.

Importing this package registers both backends (neither imports its heavy framework until a
model is built), so `EngineRegistry.new(model_type, strategy, ...)` finds them.
"""

from verl.workers.engine.base import BaseEngine, EngineRegistry
from verl.workers.engine.fsdp import FSDPEngine, FSDPEngineWithLMHead, FSDPEngineWithValueHead
from verl.workers.engine.megatron import MegatronEngine, MegatronEngineWithLMHead, MegatronEngineWithValueHead

__all__ = [
    "BaseEngine",
    "EngineRegistry",
    "FSDPEngine",
    "FSDPEngineWithLMHead",
    "FSDPEngineWithValueHead",
    "MegatronEngine",
    "MegatronEngineWithLMHead",
    "MegatronEngineWithValueHead",
]
