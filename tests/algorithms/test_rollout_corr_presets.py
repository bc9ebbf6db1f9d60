"""Upstream's rollout-correction presets: every name on both config classes (the algorithm's and the
config tree's `verl.trainer.config.algorithm.RolloutCorrectionConfig`), each giving upstream's fields."""

from __future__ import annotations

import pytest

from verl.algorithms.rollout_corr import RolloutCorrectionConfig as AlgorithmRolloutCorrection
from verl.trainer.config.algorithm import RolloutCorrectionConfig as TreeRolloutCorrection

# name -> (rollout_is, rollout_is_threshold, rollout_rs, rollout_rs_threshold, bypass_mode, loss_type) with defaults
PRESETS = {
    "decoupled_token_is": ("token", 2.0, None, None, False, "ppo_clip"),
    "decoupled_seq_is": ("sequence", 2.0, None, None, False, "ppo_clip"),
    "decoupled_seq_is_rs": ("sequence", 2.0, "seq_sum_k1", "0.5_2.0", False, "ppo_clip"),
    "decoupled_geo_rs": (None, None, "seq_mean_k1", "0.999_1.001", False, "ppo_clip"),
    "bypass_ppo_clip": (None, None, None, None, True, "ppo_clip"),
    "bypass_ppo_clip_geo_rs": (None, None, "seq_mean_k1", "0.999_1.001", True, "ppo_clip"),
    "bypass_ppo_clip_k3_rs": (None, None, "seq_mean_k3", 0.01, True, "ppo_clip"),
    "bypass_pg_is": ("sequence", 2.0, None, None, True, "reinforce"),
    "bypass_pg_geo_rs": (None, None, "seq_mean_k1", "0.999_1.001", True, "reinforce"),
    "decoupled_geo_rs_seq_tis": ("sequence", 2.0, "seq_mean_k1", "0.999_1.001", False, "ppo_clip"),
    "decoupled_geo_rs_token_tis": ("token", 2.0, "seq_mean_k1", "0.999_1.001", False, "ppo_clip"),
    "bypass_pg_geo_rs_seq_tis": ("sequence", 2.0, "seq_mean_k1", "0.999_1.001", True, "reinforce"),
    "bypass_pg_geo_rs_token_tis": ("token", 2.0, "seq_mean_k1", "0.999_1.001", True, "reinforce"),
    "decoupled_k3_rs": (None, None, "seq_mean_k3", 0.01, False, "ppo_clip"),
    "decoupled_k3_rs_seq_tis": ("sequence", 2.0, "seq_mean_k3", 0.01, False, "ppo_clip"),
    "decoupled_k3_rs_token_tis": ("token", 2.0, "seq_mean_k3", 0.01, False, "ppo_clip"),
    "disabled": (None, None, None, None, False, "ppo_clip"),
    "decoupled_token_icepop": ("token", "0.5_5.0", None, None, False, "ppo_clip"),
    "bypass_pg_token_icepop": ("token", "0.5_5.0", None, None, True, "reinforce"),
}
FIELDS = ("rollout_is", "rollout_is_threshold", "rollout_rs", "rollout_rs_threshold", "bypass_mode", "loss_type")


@pytest.mark.parametrize("cls", [AlgorithmRolloutCorrection, TreeRolloutCorrection], ids=["algorithm", "config_tree"])
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_gives_upstreams_fields(cls, name):
    config = getattr(cls, name)()
    assert isinstance(config, cls)
    expected = dict(zip(FIELDS, PRESETS[name], strict=True))
    got = {key: getattr(config, key) for key in FIELDS}
    if expected["rollout_is"] is None:  # without weights the truncation is unused; the classes' defaults differ
        got.pop("rollout_is_threshold"), expected.pop("rollout_is_threshold")
    assert got == expected


def test_thresholds_are_passed_through_and_the_config_tree_preset_reads_back_in_the_algorithm():
    tree = TreeRolloutCorrection.decoupled_k3_rs_token_tis(is_threshold=3.5, rs_threshold=0.02)
    assert (tree.rollout_is_threshold, tree.rollout_rs_threshold) == (3.5, 0.02)
    algo = AlgorithmRolloutCorrection.from_config(tree)
    assert (algo.rollout_is, algo.rollout_rs, algo.rs_bounds["seq_mean_k3"].upper) == ("token", "seq_mean_k3", 0.02)
    assert AlgorithmRolloutCorrection.decoupled_geo_rs_seq_tis(rs_threshold=1.001).rollout_rs_threshold == 1.001
