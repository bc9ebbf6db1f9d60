"""Typed config sections of the role workers, with upstream verl's names (`verl.workers.config`).

Each class is the one definition of its section: its fields carry the runtime defaults (the
YAML holds the same values) and the `doc(...)` metadata the validator and the docs generator read;
`verl.trainer.config.schema` composes them into the whole config tree.
"""

from verl.workers.config.actor import PolicyLossConfig
from verl.workers.config.engine import McoreEngineConfig

__all__ = ["McoreEngineConfig", "PolicyLossConfig"]
