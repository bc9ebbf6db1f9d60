"""The embedded task's data, generated on first use: the default config points `data.train_files`
and `data.val_files` at cache files of the bundled arithmetic task (verl/utils/dataset/arith.py).

Both the entry point (`main_ppo`, before the datasets load) and its pre-flight checks (before Ray
starts, so the files they inspect exist) call `ensure_default_data`; it sits here, below both, so
neither reaches into the other.
"""

from __future__ import annotations

import os

__all__ = ["ensure_default_data"]


def ensure_default_data(config) -> None:
    """Generate the embedded arithmetic task on first use when the config points at its cache files."""
    from verl.utils.dataset.arith import default_cache_dir, ensure_arith_data

    defaults = {os.path.realpath(os.path.join(default_cache_dir(), name)) for name in ("train.parquet", "test.parquet")}
    files = []
    for key in ("train_files", "val_files"):
        value = config.data.get(key)
        files.extend([value] if isinstance(value, str) else list(value or []))
    if any(os.path.realpath(os.path.expanduser(f)) in defaults for f in files):
        ensure_arith_data()
