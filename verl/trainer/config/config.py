"""`verl.trainer.config.CheckpointConfig`, upstream's import path of the checkpoint section.

The class lives with the actor and critic sections that hold it (`verl.workers.config.checkpoint`): a
section class in the trainer layer could not be named by them without an upward import.
"""

from verl.workers.config.checkpoint import CheckpointConfig

__all__ = ["CheckpointConfig"]
