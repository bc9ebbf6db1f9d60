"""Typed config sections of the actor, with upstream verl's names and defaults
(`verl.workers.config.PolicyLossConfig`, the `_target_` of actor.policy_loss).

Each field carries its runtime default (the YAML holds the same value) and the `doc(...)` metadata
the validator and docgen read, so the section is declared once, here; `schema.py` composes it into
the actor section. Checks that concern this section alone run in `__post_init__`, when the section
is built; rules that span sections (a loss mode that needs rollout log-probs) stay in validate.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl.base_config import BaseConfig
from verl.workers.config._fields import doc, policy_loss_choices

__all__ = ["PolicyLossConfig"]


@dataclass
class PolicyLossConfig(BaseConfig):
    """Policy-gradient loss variant and its parameters."""

    loss_mode: str = doc("Policy loss: vanilla PPO clip or a variant.", choices=policy_loss_choices, default="vanilla")
    clip_cov_ratio: float = doc("clip-cov: fraction of tokens whose gradient is clipped.", default=0.0002)
    clip_cov_lb: float = doc("clip-cov: lower bound of the covariance window.", default=1.0)
    clip_cov_ub: float = doc("clip-cov: upper bound of the covariance window.", default=5.0)
    kl_cov_ratio: float = doc("kl-cov: fraction of tokens given a KL penalty.", default=0.0002)
    ppo_kl_coef: float = doc("kl-cov: coefficient of that KL penalty.", default=0.1)

    def __post_init__(self):
        choices = policy_loss_choices()
        if self.loss_mode not in choices:
            raise ValueError(
                f"policy_loss.loss_mode={self.loss_mode!r} is not a valid choice; use one of: "
                f"{', '.join(choices)} (or register a loss with verl.algorithms.register_policy_loss)"
            )
        for key in ("clip_cov_ratio", "kl_cov_ratio"):
            value = getattr(self, key)
            if not 0.0 <= value <= 1.0:
                raise ValueError(
                    f"policy_loss.{key}={value} is outside [0, 1]: it is a fraction of the tokens; "
                    "set it between 0 and 1"
                )
        if self.clip_cov_lb > self.clip_cov_ub:
            raise ValueError(
                f"policy_loss.clip_cov_lb={self.clip_cov_lb} is above clip_cov_ub={self.clip_cov_ub}: "
                "the covariance window would be empty; set clip_cov_lb <= clip_cov_ub"
            )
