"""The sharding-manager interface: a context manager around an RPC body, plus the two hooks that
reshape its input and output `DataProto` (identity here)."""

from __future__ import annotations

from verl.protocol import DataProto


class BaseShardingManager:
    """Entering and leaving do nothing; `preprocess_data` / `postprocess_data` return the data
    unchanged. `timing` is a dict subclasses may fill with phase durations (seconds)."""

    def __init__(self):
        self.timing = {}

    def __enter__(self):
        return None

    def __exit__(self, exc_type, exc_value, traceback):
        return None

    def preprocess_data(self, data: DataProto) -> DataProto:
        return data

    def postprocess_data(self, data: DataProto) -> DataProto:
        return data
