"""GDPO (`algorithm.adv_estimator=gdpo`): each reward component normalised within its group, the weighted
sum whitened over the batch, against a float64 hand computation; and the config and driver wiring."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from verl.algorithms.advantages import compute_gdpo_outcome_advantage, get_adv_estimator_fn
from verl.protocol import DataProto
from verl.trainer.config import ConfigError, load_ppo_config
from verl.trainer.ppo.driver_math import compute_advantage, gdpo_metrics

UID = np.array(["a", "a", "b", "b"], dtype=object)
FORMAT = [1.0, 0.0, 1.0, 1.0]  # group b: identical, its normalised value is 0
ACCURACY = [0.0, 10.0, 5.0, 0.0]  # larger spread: summing first would let it drown the format reward
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])


def _grpo(scores, groups):
    out = []
    for i, g in enumerate(groups):
        members = [scores[j] for j in range(len(groups)) if groups[j] == g]
        mean = sum(members) / len(members)
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / (len(members) - 1))
        out.append((scores[i] - mean) / (std + 1e-6))
    return out


def _reference(weights):
    per_sample = [
        weights[0] * f + weights[1] * a for f, a in zip(_grpo(FORMAT, UID), _grpo(ACCURACY, UID), strict=True)
    ]
    tokens = [per_sample[i] for i in range(4) for _ in range(int(MASK[i].sum()))]  # valid tokens
    mean = sum(tokens) / len(tokens)
    std = math.sqrt(sum((x - mean) ** 2 for x in tokens) / (len(tokens) - 1))
    return [[(per_sample[i] - mean) / math.sqrt(std**2 + 1e-8) * int(MASK[i, t]) for t in range(3)] for i in range(4)]


@pytest.mark.parametrize("weights", [None, [2.0, 0.5]])
def test_components_are_normalised_apart_then_whitened(weights):
    rewards = torch.zeros(4, 3)
    adv, returns = compute_gdpo_outcome_advantage(
        rewards, MASK, UID, reward_components=[FORMAT, ACCURACY], reward_weights=weights
    )
    expected = torch.tensor(_reference(weights or [1.0, 1.0]), dtype=torch.float32)
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(adv, returns)
    # by hand for the unweighted case: both group-a responses differ in both components, in opposite directions
    if weights is None:
        assert adv[0, 0] == pytest.approx(adv[1, 0].item(), abs=1e-5)  # +0.707 - 0.707 on each side: equal


def test_without_components_it_is_grpo_whitened():
    rewards = torch.zeros(4, 3)
    rewards[:, 0] = torch.tensor(ACCURACY)
    adv, _ = get_adv_estimator_fn("gdpo")(token_level_rewards=rewards, response_mask=MASK, index=UID)
    only_accuracy = compute_gdpo_outcome_advantage(torch.zeros(4, 3), MASK, UID, reward_components=[ACCURACY])[0]
    torch.testing.assert_close(adv, only_accuracy)


def test_the_driver_reads_the_components_from_the_reward_functions_columns():
    cfg = load_ppo_config(
        ["algorithm.adv_estimator=gdpo", "+algorithm.gdpo_reward_keys=[format,acc]"], config_name="arith_demo"
    )
    batch = DataProto.from_dict(
        tensors={"token_level_rewards": torch.zeros(4, 3), "response_mask": MASK},
        non_tensors={"uid": UID, "format": np.array(FORMAT), "acc": np.array(ACCURACY)},
    )
    out = compute_advantage(batch, cfg.algorithm, pf_ppo_seed=0)
    torch.testing.assert_close(out.batch["advantages"], torch.tensor(_reference([1.0, 1.0])), rtol=1e-5, atol=1e-5)
    metrics = gdpo_metrics(batch, cfg.algorithm)
    assert metrics["gdpo/acc/max"] == 10.0 and metrics["gdpo/format/mean"] == 0.75
    del batch.non_tensor_batch["acc"]
    with pytest.raises(KeyError, match=r"gdpo_reward_keys \['acc'\] are not in the batch"):
        compute_advantage(batch, cfg.algorithm, pf_ppo_seed=0)


def test_gdpo_needs_its_keys_and_one_weight_per_key():
    with pytest.raises(ConfigError, match="adv_estimator=gdpo .* needs their names"):
        load_ppo_config(["algorithm.adv_estimator=gdpo"], config_name="arith_demo")
    with pytest.raises(ConfigError, match="2 weights for 1 gdpo_reward_keys"):
        load_ppo_config(
            [
                "algorithm.adv_estimator=gdpo",
                "+algorithm.gdpo_reward_keys=[acc]",
                "+algorithm.gdpo_reward_weights=[1,2]",
            ],
            config_name="arith_demo",
        )
