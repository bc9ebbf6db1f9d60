"""The checkpoint section of the trained roles, with upstream verl's name and defaults
(`verl.trainer.config.CheckpointConfig`, the `_target_` of actor.checkpoint and critic.checkpoint).

Defined in the workers layer, where the actor and critic sections that hold it live, and
re-exported under upstream's import path by `verl.trainer.config`.

Each field carries its runtime default and the `doc(...)` metadata the validator and docgen read:
the section is declared once, here, and `schema.py` composes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl.base_config import BaseConfig
from verl.workers.config._fields import CHECKPOINT_CONTENTS, IGNORED, UNSUPPORTED, doc

__all__ = ["CheckpointConfig", "McoreCheckpointConfig"]


def _default_contents() -> list[str]:
    return ["model", "optimizer", "extra"]


@dataclass
class CheckpointConfig(BaseConfig):
    """What a checkpoint holds."""

    save_contents: list[str] = doc(
        "Parts written at each save.", choices=CHECKPOINT_CONTENTS, default_factory=_default_contents
    )
    load_contents: list[str] = doc(
        "Parts read when resuming.", choices=CHECKPOINT_CONTENTS, default_factory=_default_contents
    )
    async_save: bool = doc(
        "Write checkpoints in the background: the state is copied to host memory and training goes on; "
        "the tracker file moves once every rank's write is complete (strategy=fsdp).",
        default=False,
    )
    strict: bool = doc(
        "Strict checking of the exported HF weights (every expected tensor present, none left over); the "
        "converter here always checks them so: false is not implemented.",
        status=UNSUPPORTED,
        neutral=True,
        optional=True,
        default=True,
    )
    mbridge_config: dict = doc(
        "Keyword arguments of mbridge's `save_weights` (Megatron: its memory-efficient and distributed-filesystem "
        "writing of the HF weights); here verl's own converter writes them, so nothing reads them.",
        status=IGNORED,
        optional=True,
        default_factory=dict,
    )

    def __post_init__(self):
        for key in ("save_contents", "load_contents"):
            unknown = [c for c in getattr(self, key) if c not in CHECKPOINT_CONTENTS]
            if unknown:
                raise ValueError(
                    f"checkpoint.{key} has unknown part(s) {unknown}: a checkpoint holds only "
                    f"{', '.join(CHECKPOINT_CONTENTS)}; list those"
                )


@dataclass
class McoreCheckpointConfig(CheckpointConfig):
    """A Megatron role's checkpoint section (upstream v0.9's `_target_` of megatron_critic.yaml's)."""

    mbridge_config: dict = doc(
        "Keyword arguments of mbridge's `save_weights` (its memory-efficient and distributed-filesystem writing "
        "of the HF weights); here verl's own converter writes them, so nothing reads them.",
        status=IGNORED,
        default_factory=dict,
    )
