"""The PPO critic's training logic (free of Ray): value predictions and value-loss updates."""

from verl.workers.critic.base import BasePPOCritic
from verl.workers.critic.dp_critic import DataParallelPPOCritic
from verl.workers.critic.ppo_critic import PPOCritic

__all__ = ["BasePPOCritic", "DataParallelPPOCritic", "PPOCritic"]
