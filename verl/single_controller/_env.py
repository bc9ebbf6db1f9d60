"""Environment-variable parsing shared by the worker and the shared-memory transport.

It lives here, not in verl.utils, because importing `verl.single_controller.base` must pull in
neither torch nor Ray (a driver that only declares workers stays light), and verl.utils' package
import brings torch.
"""

from __future__ import annotations

import os


def env_int(name: str, default: int | None) -> int | None:
    """The integer in environment variable `name`, or `default` when it is unset or empty."""
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from None
