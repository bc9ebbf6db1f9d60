"""Tiny model and tokenizer factory, plus the checkpoints bundled with the package.

Importing this package is cheap; transformers is imported by the functions that need it
(`verl.models.factory`, `verl.models.tokenizer`).
"""

from __future__ import annotations

import os

ASSETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")


def bundled_model_path(name: str = "arith-tiny") -> str:
    """Path of a model directory shipped inside the package (`verl/assets/<name>`), loadable with
    `AutoModelForCausalLM.from_pretrained` offline."""
    path = os.path.join(ASSETS_DIR, name)
    if not os.path.isfile(os.path.join(path, "config.json")):
        available = (
            sorted(d for d in os.listdir(ASSETS_DIR) if os.path.isfile(os.path.join(ASSETS_DIR, d, "config.json")))
            if os.path.isdir(ASSETS_DIR)
            else []
        )
        raise FileNotFoundError(
            f"no bundled model named {name!r} at {path}; bundled models: {available or 'none'}. "
            "Reinstall the package (the assets ship with it) or rebuild with `python -m verl.models.build_bundled`"
        )
    return path


__all__ = ["ASSETS_DIR", "bundled_model_path"]
