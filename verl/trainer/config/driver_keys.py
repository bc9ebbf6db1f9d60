"""Keys a recipe's own driver config declares beyond the trainer's schema.

verl-recipe's drivers (`recipe/sppo/main_sppo.py`, ...) compose `ppo_trainer` with a config file of their
own (`recipe/sppo/config/sppo_trainer.yaml`) that adds the keys their own code reads
(`algorithm.sppo_eta`), then call upstream's `verl.utils.config.validate_config`. Upstream checks no
unknown keys, so those run there; here every unknown key is refused (a typo would otherwise train
something else), except the ones the driver's own config files declare: those are the recipe's
settings, read by the recipe's code.

The same holds for upstream's examples and users' drivers that build `RayPPOTrainer` themselves from a
config file of their own (upstream's `examples/split_placement/config/ppo_trainer_split.yaml` sets keys its
release no longer reads): the trainer's check looks beside the first caller outside verl
(`calling_driver_file`).

Design decision: the declared keys are read from the YAML files next to the calling driver
(`<driver's directory>/config/*.yaml`, Hydra's `config_path="config"`), not from the composed config,
which keeps no record of where a key came from. A key the user adds on the command line (`+algorithm.x=1`)
is not in those files and stays an error; a key a recipe declares is accepted with one log line naming
it and the file.
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

__all__ = ["DriverKeys", "calling_driver_file", "driver_keys_near"]

logger = logging.getLogger(__name__)

_NOT_KEYS = ("defaults", "hydra")


class DriverKeys(dict):
    """{dotted key: value} of what a driver's config files set (sections and leaves), with the file
    that declares each (`source`)."""

    def __init__(self):
        super().__init__()
        self.source: dict[str, str] = {}

    def add_file(self, path: Path) -> None:
        try:
            raw = OmegaConf.load(path)
        except Exception as e:  # a file Hydra would not load either: its own error comes first
            logger.debug(f"not reading driver config {path}: {e}")
            return
        if isinstance(raw, DictConfig):
            for key in raw:
                if key not in _NOT_KEYS:
                    self._walk(raw._get_node(key), str(key), str(path))

    def _walk(self, node, key: str, source: str) -> None:
        value = OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else node._value()
        self.setdefault(key, value)
        self.source.setdefault(key, source)
        if isinstance(node, DictConfig):
            for child in node:
                self._walk(node._get_node(child), f"{key}.{child}", source)

    def declares(self, key: str) -> bool:
        return key in self


def driver_keys_near(driver_file: str | None) -> DriverKeys:
    """The keys declared by the YAML files in `config/` beside `driver_file` (empty when there are none)."""
    keys = DriverKeys()
    if not driver_file:
        return keys
    config_dir = Path(driver_file).resolve().parent / "config"
    if config_dir.is_dir():
        for path in sorted(config_dir.glob("*.yaml")):
            keys.add_file(path)
    return keys


def calling_driver_file() -> str | None:
    """The file of the innermost caller outside the verl package: the driver (or its trainer subclass) that
    builds a `RayPPOTrainer` or calls `validate_config`; None when verl itself is the caller."""
    import sys

    package = Path(__file__).resolve().parents[2]  # .../verl
    frame = sys._getframe(1)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.suffix == ".py" and path.is_file():
            resolved = path.resolve()
            if package not in resolved.parents:
                return str(resolved)
        frame = frame.f_back
    return None
