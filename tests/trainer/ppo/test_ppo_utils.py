"""Upstream's `verl.trainer.ppo.utils` helpers, including need_reference_policy's earlier signature (a role
mapping), which verl-recipe's SPPO/SPIN/PRIME/GVPO/SPO drivers pass."""

from __future__ import annotations

from verl.trainer.config import load_ppo_config
from verl.trainer.ppo.utils import Role, need_reference_policy, need_reward_model


def test_need_reference_policy_reads_a_config_or_a_role_mapping():
    assert not need_reference_policy(load_ppo_config([], config_name="arith_demo"))
    assert need_reference_policy(load_ppo_config(["algorithm.use_kl_in_reward=true"], config_name="arith_demo"))
    assert not need_reference_policy({Role.ActorRollout: object})
    assert need_reference_policy({Role.ActorRollout: object, Role.RefPolicy: object})
    assert need_reference_policy({Role.ActorRolloutRef: object})
    assert need_reward_model({Role.RewardModel: object}) and not need_reward_model({Role.ActorRollout: object})
