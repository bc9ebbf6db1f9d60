"""PF-PPO (`algorithm.use_pf_ppo`): the batch redrawn by score weight after GAE, against hand-worked
weights and, for the draw itself, the expected frequencies over many draws."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl.protocol import DataProto
from verl.trainer.ppo.core_algos import compute_pf_ppo_reweight_data, pf_ppo_weights
from verl.trainer.ppo.driver_math import compute_advantage

D = torch.float64


def _batch(scores) -> DataProto:
    scores = torch.tensor(scores, dtype=D)
    levels = torch.zeros(len(scores), 3, dtype=D)
    levels[:, -1] = scores
    return DataProto.from_dict(
        tensors={"token_level_scores": levels, "token_level_rewards": levels.clone(), "row": torch.arange(len(scores))},
        non_tensors={"uid": np.array([f"u{i}" for i in range(len(scores))], dtype=object)},
        meta_info={"global_token_num": [10 + i for i in range(len(scores))]},
    )


def test_weights_of_each_method_by_hand():
    s = torch.tensor([-2.0, 0.5, 1.0, 1.0], dtype=D)
    torch.testing.assert_close(pf_ppo_weights(s, "pow", 2.0), torch.tensor([4, 0.25, 1, 1], dtype=D) + 1e-8)
    torch.testing.assert_close(pf_ppo_weights(s, "max_min"), torch.tensor([1, 0, 1, 1], dtype=D) + 1e-8)
    torch.testing.assert_close(pf_ppo_weights(s, "max_random"), torch.tensor([0.1, 0.1, 0.4, 0.4], dtype=D) + 1e-8)
    with pytest.raises(ValueError, match="reweight_method='top' is not one of"):
        pf_ppo_weights(s, "top")


def test_max_min_draws_only_the_best_and_worst_rows_and_columns_follow_them():
    data = _batch([0.0, 0.3, 1.0, 0.5])
    out = compute_pf_ppo_reweight_data(data, "max_min", generator=torch.Generator().manual_seed(0))
    rows = out.batch["row"].tolist()
    assert len(rows) == 4 and set(rows) <= {0, 2}
    assert out.non_tensor_batch["uid"].tolist() == [f"u{r}" for r in rows]
    assert out.meta_info["global_token_num"] == [10 + r for r in rows]
    torch.testing.assert_close(out.batch["token_level_scores"], data.batch["token_level_scores"][rows])


def test_pow_draw_frequencies_match_the_weights():
    data = _batch([1.0, 2.0, 3.0])  # weights 1, 4, 9 -> probabilities 1/14, 4/14, 9/14
    generator = torch.Generator().manual_seed(1)
    counts = np.zeros(3)
    for _ in range(2000):
        out = compute_pf_ppo_reweight_data(data, "pow", 2.0, generator)
        counts += np.bincount(out.batch["row"].numpy(), minlength=3)
    freq = counts / counts.sum()  # 6000 draws: standard error <= 0.0065
    np.testing.assert_allclose(freq, [1 / 14, 4 / 14, 9 / 14], atol=0.03)


def _algorithm(use_pf_ppo: bool, estimator: str):
    return OmegaConf.create(
        {
            "adv_estimator": estimator,
            "gamma": 1.0,
            "lam": 1.0,
            "norm_adv_by_std_in_grpo": True,
            "use_pf_ppo": use_pf_ppo,
            "pf_ppo": {"reweight_method": "max_min", "weight_pow": 2.0},
        }
    )


@pytest.mark.parametrize(("use_pf_ppo", "estimator", "redrawn"), [(True, "gae", True), (False, "gae", False)])
def test_trainer_redraws_after_gae_only_when_asked(use_pf_ppo, estimator, redrawn):
    data = _batch([0.0, 0.3, 1.0, 0.5])
    data.batch["values"] = torch.zeros(4, 3, dtype=D)
    data.batch["response_mask"] = torch.ones(4, 3, dtype=D)
    out = compute_advantage(data, _algorithm(use_pf_ppo, estimator), pf_ppo_seed=5)
    rows = out.batch["row"].tolist()
    assert (set(rows) <= {0, 2}) if redrawn else rows == [0, 1, 2, 3]
    # GAE with gamma = lam = 1 and zero values: every token's advantage is the final score of its row
    torch.testing.assert_close(out.batch["returns"][:, 0], torch.tensor([0.0, 0.3, 1.0, 0.5], dtype=D)[rows])
