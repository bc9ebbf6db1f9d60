"""The PPO actor's training logic (free of Ray): log-probs and policy updates on a sharded model."""

from verl.workers.actor.base import BasePPOActor
from verl.workers.actor.dp_actor import DataParallelPPOActor
from verl.workers.actor.ppo_actor import PPOActor

__all__ = ["BasePPOActor", "DataParallelPPOActor", "PPOActor"]
