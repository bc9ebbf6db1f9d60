"""Upstream's sharding managers: context managers a legacy worker enters around each RPC body.

This build's workers need none (the engine owns its process groups); verl-recipe's workers that
rebuild upstream's legacy FSDP worker (SPIN, PRIME, GVPO) import
`fsdp_ulysses.FSDPUlyssesShardingManager` and use it as upstream's does.
"""

from verl.workers.sharding_manager.base import BaseShardingManager
from verl.workers.sharding_manager.fsdp_ulysses import FSDPUlyssesShardingManager

__all__ = ["BaseShardingManager", "FSDPUlyssesShardingManager"]
