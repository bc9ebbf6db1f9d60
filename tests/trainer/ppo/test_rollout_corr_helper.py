"""`algorithm.rollout_correction`: importance weights, rejection sampling and off-policy metrics on a
hand-worked batch; config checks and the trainer-side wiring helpers."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from verl.protocol import DataProto
from verl.trainer.ppo.rollout_corr_helper import (
    SUPPORTED_ROLLOUT_RS_OPTIONS,
    RolloutCorrectionConfig,
    apply_bypass_mode,
    check_rollout_correction,
    compute_offpolicy_metrics,
    compute_rollout_correction_and_add_to_batch,
    compute_rollout_correction_and_rejection_mask,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
    configure_rollout_correction,
)

D = torch.float64
# Rollout and trainer probabilities of each sampled token; row 1 has one valid token.
ROLLOUT_P = [[0.1, 0.5, 0.4], [0.4, 0.9, 0.9]]
TRAIN_P = [[0.3, 0.5, 0.2], [0.6, 0.1, 0.1]]
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=D)
# ratios pi_train / pi_rollout on valid tokens: [3, 1, 0.5] and [1.5]


def batch():
    rollout = torch.log(torch.tensor(ROLLOUT_P, dtype=D))
    old = torch.log(torch.tensor(TRAIN_P, dtype=D))
    return old, rollout, MASK.clone()


def test_token_level_weights_are_the_truncated_ratios_and_zero_on_padding():
    old, rollout, mask = batch()
    w, m = compute_rollout_correction_weights(old - rollout, mask, "token", 2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, 0.5], [1.5, 0, 0]], dtype=D))
    assert not w.requires_grad
    assert m["rollout_is_mean"] == pytest.approx((3 + 1 + 0.5 + 1.5) / 4)  # before truncation
    assert (m["rollout_is_max"], m["rollout_is_min"]) == pytest.approx((3.0, 0.5))
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 4)
    assert m["rollout_is_ratio_fraction_low"] == 0.0  # 0.5 is not below 1/2
    # ESS over weights bounded to [1/2, 2]: [2, 1, 0.5, 1.5], mean 1.25
    normalised = [x / 1.25 for x in (2, 1, 0.5, 1.5)]
    assert m["rollout_is_eff_sample_size"] == pytest.approx(1 / (sum(x * x for x in normalised) / 4), rel=1e-6)
    assert m["rollout_is_seq_mean"] == pytest.approx(((3 + 1 + 0.5) / 3 + 1.5) / 2)


def test_icepop_zeroes_the_weights_outside_its_band_and_keeps_the_others_untruncated():
    old, rollout, mask = batch()  # valid ratios [3, 1, 0.5] and [1.5]
    w, m = compute_rollout_correction_weights(old - rollout, mask, "token", "0.6_2.5")
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 0.0], [1.5, 0, 0]], dtype=D))
    assert m["rollout_is_oob_ratio"] == pytest.approx(2 / 4)  # 3 above, 0.5 below
    assert m["rollout_is_ratio_fraction_low"] == pytest.approx(1 / 4)  # below the band's lower bound 0.6
    # the sequence level keeps a response's weight only inside the band: products 1.5 and 1.5
    w, _ = compute_rollout_correction_weights(old - rollout, mask, "sequence", "1.6_4")
    assert w.sum() == 0
    w, _ = compute_rollout_correction_weights(old - rollout, mask, "sequence", "1_1.5")
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5, 1.5], [1.5, 0, 0]], dtype=D))
    # a numeric string is the truncation, as a number is
    w, _ = compute_rollout_correction_weights(old - rollout, mask, "token", "2.0")
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, 0.5], [1.5, 0, 0]], dtype=D))


def test_sequence_level_weight_is_the_truncated_product_of_the_token_ratios():
    old, rollout, mask = batch()
    w, m = compute_rollout_correction_weights(old - rollout, mask, "sequence", 1.4)
    # products: 3 * 1 * 0.5 = 1.5 and 1.5, truncated at 1.4
    torch.testing.assert_close(w, torch.tensor([[1.4, 1.4, 1.4], [1.4, 0, 0]], dtype=D))
    assert m["rollout_is_max"] == pytest.approx(1.5)
    assert m["rollout_is_ratio_fraction_high"] == 1.0


@pytest.mark.parametrize("level, expected", [("token", 1.25), ("sequence", 1.5)])
def test_batch_normalisation_rescales_the_truncated_weights_to_mean_one(level, expected):
    old, rollout, mask = batch()
    w, m = compute_rollout_correction_weights(old - rollout, mask, level, 2.0, rollout_is_batch_normalize=True)
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(expected)
    if level == "token":
        assert w[mask != 0].mean().item() == pytest.approx(1.0)
        torch.testing.assert_close(w[0], torch.tensor([2.0, 1.0, 0.5], dtype=D) / 1.25)
    else:
        assert w[:, 0].mean().item() == pytest.approx(1.0)


@pytest.mark.parametrize(
    "option, threshold, kept",
    [
        # k1 = log(pi_rollout / pi_train) within [log 0.5, log 2]: the ratio 3 token leaves
        ("token_k1", "0.5_2.0", [[0, 1, 1], [1, 0, 0]]),
        ("token_k1", 2.0, [[0, 1, 1], [1, 0, 0]]),  # one number u means [1/u, u]
        # k2 = delta^2 / 2: (ln 3)^2/2 = 0.60, 0, (ln 2)^2/2 = 0.24, (ln 1.5)^2/2 = 0.082
        ("token_k2", 0.1, [[0, 1, 0], [1, 0, 0]]),
        ("seq_max_k2", 0.5, [[0, 0, 0], [1, 0, 0]]),
        ("seq_sum_k2", 0.9, [[1, 1, 1], [1, 0, 0]]),
        ("seq_sum_k2", 0.8, [[0, 0, 0], [1, 0, 0]]),
        # sum of k1 = -(ln 3 + 0 - ln 2) = -ln 1.5 per row: inside [ln(1/1.6), ln 1.6], outside [ln(1/1.4), ln 1.4]
        ("seq_sum_k1", 1.6, [[1, 1, 1], [1, 0, 0]]),
        ("seq_sum_k1", 1.4, [[0, 0, 0], [0, 0, 0]]),
        # k3 = e^d - 1 - d: [0.901, 0, 0.193] mean 0.365; 0.095
        ("seq_mean_k3", 0.3, [[0, 0, 0], [1, 0, 0]]),
        ("seq_mean_k3", 0.4, [[1, 1, 1], [1, 0, 0]]),
        ("token_k1,seq_mean_k3", "0.5_2.0,0.4", [[0, 1, 1], [1, 0, 0]]),
    ],
)
def test_rejection_masks_what_leaves_the_trust_region(option, threshold, kept):
    old, rollout, mask = batch()
    out, metrics = compute_rollout_rejection_mask(old - rollout, mask, option, threshold)
    torch.testing.assert_close(out, torch.tensor(kept, dtype=D))
    valid = int(mask.sum())
    assert metrics["rollout_rs_masked_fraction"] == pytest.approx((valid - sum(map(sum, kept))) / valid)
    for name in option.split(","):
        assert f"rollout_rs_{name}_mean" in metrics and f"rollout_rs_{name}_seq_max" in metrics


def test_offpolicy_metrics_hand_worked():
    old, rollout, mask = batch()
    m = compute_offpolicy_metrics(old, rollout, mask)
    assert m["kl"] == pytest.approx((-math.log(3) + 0 + math.log(2) - math.log(1.5)) / 4)
    assert m["chi2_token"] == pytest.approx((9 + 1 + 0.25 + 2.25) / 4 - 1)
    assert m["chi2_seq"] == pytest.approx((1.5**2 + 1.5**2) / 2 - 1)
    ppl0, ppl1 = (0.3 * 0.5 * 0.2) ** (-1 / 3), 1 / 0.6
    assert m["training_ppl"] == pytest.approx((ppl0 + ppl1) / 2)
    rppl0, rppl1 = (0.1 * 0.5 * 0.4) ** (-1 / 3), 1 / 0.4
    assert m["rollout_ppl"] == pytest.approx((rppl0 + rppl1) / 2)
    assert m["log_ppl_diff"] == pytest.approx((math.log(ppl0 / rppl0) + math.log(ppl1 / rppl1)) / 2)
    k3 = [3 - 1 - math.log(3), 0.0, 0.5 - 1 + math.log(2), 1.5 - 1 - math.log(1.5)]
    assert m["k3_kl"] == pytest.approx(sum(k3) / 4)


def test_the_combined_call_prefixes_metrics_and_wraps_the_weights():
    old, rollout, mask = batch()
    proto, kept, metrics = compute_rollout_correction_and_rejection_mask(
        old,
        rollout,
        mask,
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs="token_k2",
        rollout_rs_threshold=0.1,
    )
    assert isinstance(proto, DataProto)
    torch.testing.assert_close(proto.batch["rollout_is_weights"], torch.tensor([[2.0, 1, 0.5], [1.5, 0, 0]], dtype=D))
    torch.testing.assert_close(kept, torch.tensor([[0, 1, 0], [1, 0, 0]], dtype=D))
    assert all(k.startswith("rollout_corr/") and isinstance(v, float) for k, v in metrics.items())
    assert {"rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_masked_fraction", "rollout_corr/kl"} <= set(
        metrics
    )
    proto, kept, _ = compute_rollout_correction_and_rejection_mask(old, rollout, mask)
    assert proto is None and torch.equal(kept, mask)


def test_add_to_batch_replaces_the_mask_and_adds_weights_for_the_actor():
    old, rollout, mask = batch()
    data = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask})
    rc = RolloutCorrectionConfig(rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0")
    data, metrics = compute_rollout_correction_and_add_to_batch(data, rc)
    torch.testing.assert_close(data.batch["response_mask"], torch.tensor([[0, 1, 1], [1, 0, 0]], dtype=D))
    torch.testing.assert_close(data.batch["rollout_is_weights"][0], torch.tensor([2.0, 1.0, 0.5], dtype=D))
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)
    without = DataProto.from_dict(tensors={"old_log_probs": old, "response_mask": mask})
    with pytest.raises(KeyError, match="calculate_log_probs=true"):
        compute_rollout_correction_and_add_to_batch(without, rc)


def test_an_all_padding_batch_gives_zero_metrics_not_nan():
    old, rollout, _ = batch()
    empty = torch.zeros_like(MASK)
    proto, kept, metrics = compute_rollout_correction_and_rejection_mask(
        old, rollout, empty, "sequence", 2.0, True, "seq_mean_k3,token_k1", "0.1,2"
    )
    assert torch.all(kept == 0) and torch.all(proto.batch["rollout_is_weights"] == 0)
    assert all(math.isfinite(v) for v in metrics.values()), metrics


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rollout_is="tokens"), "rollout_is='tokens'"),
        (dict(rollout_is="token", rollout_is_threshold=0), "rollout_is_threshold"),
        (dict(rollout_is="token", rollout_is_threshold="4_0.5"), "lower bound must be positive and at most"),
        (dict(rollout_is="token", rollout_is_threshold="a_b"), "neither a number nor 'lower_upper'"),
        (dict(rollout_is="token", rollout_is_threshold=True), "must be a number"),
        (dict(rollout_rs="token_k4", rollout_rs_threshold=1), "token_k4"),
        (dict(rollout_rs="token_k2"), "rollout_rs_threshold is unset"),
        (dict(rollout_rs="token_k2", rollout_rs_threshold="0.1_0.2"), "only an upper bound"),
        (dict(rollout_rs="token_k1,token_k2", rollout_rs_threshold="1,2,3"), "3 thresholds for 2"),
        (dict(rollout_rs="token_k1", rollout_rs_threshold="2_0.5"), "lower bound above"),
        (dict(rollout_rs="seq_max_k3", rollout_rs_threshold="abc"), "not a number"),
        (dict(loss_type="ppo"), "loss_type"),
    ],
)
def test_config_errors_name_the_key_and_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RolloutCorrectionConfig(**kwargs)


def test_unknown_rs_option_error_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        RolloutCorrectionConfig(rollout_rs="geo", rollout_rs_threshold=1.0)
    assert all(option in str(err.value) for option in SUPPORTED_ROLLOUT_RS_OPTIONS)


def test_from_config_reads_upstreams_yaml_section_and_refuses_unknown_keys():
    node = OmegaConf.create(
        {
            "rollout_is": "sequence",
            "rollout_is_threshold": 3.0,
            "rollout_rs": None,
            "rollout_rs_threshold": None,
            "bypass_mode": False,
            "loss_type": "ppo_clip",
            "rollout_is_batch_normalize": False,
        }
    )
    assert RolloutCorrectionConfig.from_config(node) == RolloutCorrectionConfig.decoupled_seq_is(3.0)
    with pytest.raises(ValueError, match="rollout_is_treshold"):
        RolloutCorrectionConfig.from_config({"rollout_is_treshold": 2})


@pytest.mark.parametrize(
    "rc, kwargs, match",
    [
        (RolloutCorrectionConfig(rollout_is="token"), dict(calculate_log_probs=False), "calculate_log_probs=true"),
        (RolloutCorrectionConfig.bypass_ppo_clip(), dict(calculate_log_probs=False), "calculate_log_probs=true"),
        (RolloutCorrectionConfig.bypass_ppo_clip(), dict(calculate_log_probs=True, loss_mode="cispo"), "cispo"),
        (
            RolloutCorrectionConfig(rollout_is="token"),
            dict(calculate_log_probs=True, tis_imp_ratio_cap=2.0),
            "weighted twice",
        ),
        (RolloutCorrectionConfig.bypass_pg_is(), dict(calculate_log_probs=True, tis_imp_ratio_cap=2.0), "is 1"),
    ],
)
def test_a_correction_the_run_cannot_carry_out_is_refused(rc, kwargs, match):
    with pytest.raises(ValueError, match=match):
        check_rollout_correction(rc, **kwargs)


def test_metrics_only_config_needs_no_rollout_log_probs():
    check_rollout_correction(RolloutCorrectionConfig(), calculate_log_probs=False)


def _ppo_config(rollout_correction: dict, calculate_log_probs: bool = True):
    return OmegaConf.create(
        {
            "algorithm": {"rollout_correction": rollout_correction},
            "actor_rollout_ref": {
                "actor": {"policy_loss": {"loss_mode": "vanilla"}, "tis_imp_ratio_cap": -1},
                "rollout": {"calculate_log_probs": calculate_log_probs},
            },
        }
    )


def test_configure_hands_bypass_mode_to_the_actor_loss_before_workers_are_built():
    config = _ppo_config({"bypass_mode": True, "loss_type": "reinforce", "rollout_is": "token"})
    rc = configure_rollout_correction(config)
    assert rc == RolloutCorrectionConfig(bypass_mode=True, loss_type="reinforce", rollout_is="token")
    policy_loss = config.actor_rollout_ref.actor.policy_loss
    assert policy_loss.loss_mode == "bypass_mode"
    assert RolloutCorrectionConfig.from_config(policy_loss.rollout_correction) == rc
    decoupled = _ppo_config({"rollout_is": "token"})
    configure_rollout_correction(decoupled)
    assert decoupled.actor_rollout_ref.actor.policy_loss.loss_mode == "vanilla"
    with pytest.raises(ValueError, match="calculate_log_probs"):
        configure_rollout_correction(_ppo_config({"rollout_is": "token"}, calculate_log_probs=False))


def test_apply_bypass_mode_uses_the_rollout_log_probs_as_old_ones():
    old, rollout, mask = batch()
    data = DataProto.from_dict(tensors={"rollout_log_probs": rollout, "response_mask": mask})
    apply_bypass_mode(data)
    assert torch.equal(data.batch["old_log_probs"], rollout)
    with pytest.raises(ValueError, match="requires rollout_log_probs.*calculate_log_probs=true"):
        apply_bypass_mode(DataProto.from_dict(tensors={"response_mask": mask}))


def test_apply_rollout_correction_maps_the_earlier_schema_onto_bypass_mode():
    from verl.trainer.ppo.rollout_corr_helper import apply_rollout_correction

    old, rollout, mask = batch()
    earlier = {  # rep_exp's algorithm.rollout_correction (upstream's schema of late 2025)
        "rollout_is": "token",
        "rollout_is_threshold": 2.0,
        "rollout_rs": None,
        "rollout_rs_threshold": None,
        "rollout_rs_threshold_lower": None,
        "rollout_token_veto_threshold": None,
        "bypass_mode": True,
        "rollout_is_batch_normalize": False,
    }
    for use_policy_gradient, loss_type in ((True, "reinforce"), (False, "ppo_clip")):
        data = DataProto.from_dict(tensors={"rollout_log_probs": rollout, "response_mask": mask})
        policy_loss = OmegaConf.create({"loss_mode": "vanilla"})
        node = OmegaConf.create(earlier | {"use_policy_gradient": use_policy_gradient})
        apply_rollout_correction(batch=data, rollout_corr_config=node, policy_loss_config=policy_loss)
        assert torch.equal(data.batch["old_log_probs"], rollout)
        assert policy_loss.loss_mode == "bypass_mode"
        assert policy_loss.rollout_correction.loss_type == loss_type
        assert policy_loss.rollout_correction.rollout_is == "token"
    with pytest.raises(ValueError, match="rollout_token_veto_threshold.*no counterpart"):
        apply_rollout_correction(
            DataProto.from_dict(tensors={"rollout_log_probs": rollout}),
            earlier | {"rollout_token_veto_threshold": 1e-4},
            OmegaConf.create({}),
        )
    with pytest.raises(ValueError, match="requires rollout_log_probs"):
        apply_rollout_correction(DataProto.from_dict(tensors={"response_mask": mask}), earlier, OmegaConf.create({}))
