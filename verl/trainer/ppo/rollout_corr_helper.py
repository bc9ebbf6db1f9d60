"""Upstream verl's import path for rollout correction; the code lives in `verl.algorithms.rollout_corr`.

Kept so `from verl.trainer.ppo.rollout_corr_helper import ...` keeps working: every public name
is re-exported unchanged (the same objects).
"""

from verl.algorithms import rollout_corr as _impl
from verl.algorithms.rollout_corr import *  # noqa: F403  (the whole public surface, by design)

__all__ = list(_impl.__all__)
