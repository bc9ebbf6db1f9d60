"""The actor keys from upstream's config: `calculate_entropy`, `loss_scale_factor`, `data_loader_seed`,
`optim.clip_grad`, `tau_pos`/`tau_neg` through the `sapo` loss, `calculate_sum_pi_squared`'s per-token
statistic, and rollout correction's batch keys (`rollout_is_weights`, `rollout_log_probs`) and
bypass loss. Each is checked by what it changes in an update or an output."""

from __future__ import annotations

import copy

import pytest
import torch
from test_dp_actor import (
    TEMPERATURE,
    actor_config,
    assert_same_delta,
    param_delta,
    sgd_actor,
    training_batch,
)

from tests.distributed_helpers import make_tiny_causal_lm, one_thread, reference_response_log_probs
from verl.trainer.ppo.core_algos import agg_loss

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


def delta_of(config, data, lr=1.0):
    actor = sgd_actor(config, lr=lr)
    before = copy.deepcopy(actor.actor_module)
    metrics = actor.update_policy(data)
    return param_delta(before, actor.actor_module), metrics


def flat(delta: dict) -> torch.Tensor:
    return torch.cat([v.flatten() for v in delta.values()])


def assert_scaled(delta: dict, reference: dict, factor: float):
    """delta == factor * reference, to the tiny model's precision: its RMSNorm computes in float32,
    so gradients of a float64 model agree to ~1e-7 relative, not to float64 rounding."""
    expected = factor * flat(reference)
    torch.testing.assert_close(flat(delta), expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())


def test_calculate_entropy_reports_the_policys_entropy_without_an_entropy_bonus():
    data = training_batch(seed=3)
    _, plain = delta_of(actor_config(ppo_micro_batch_size_per_gpu=8), data)
    assert "actor/entropy" not in plain
    with_entropy_delta, metrics = delta_of(actor_config(ppo_micro_batch_size_per_gpu=8, calculate_entropy=True), data)
    _, entropy = reference_response_log_probs(make_tiny_causal_lm(), data.batch, TEMPERATURE)
    expected = agg_loss(entropy, data.batch["response_mask"].double(), "token-mean").item()
    assert metrics["actor/entropy"] == [pytest.approx(expected, rel=1e-9)]
    # reported only: the update is the plain one
    plain_delta, _ = delta_of(actor_config(ppo_micro_batch_size_per_gpu=8), data)
    assert_same_delta(with_entropy_delta, plain_delta)


def test_loss_scale_factor_rescales_the_seq_mean_token_sum_norm_update():
    data = training_batch(seed=4)
    response_length = data.batch["responses"].shape[1]
    default, _ = delta_of(actor_config(loss_agg_mode="seq-mean-token-sum-norm"), data)
    scaled, _ = delta_of(actor_config(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=2), data)
    assert_scaled(scaled, default, response_length / 2)


def test_optim_clip_grad_clips_the_update_like_grad_clip():
    data = training_batch(seed=5)
    config = actor_config(grad_clip=1.0, optim={"clip_grad": 1e-4})
    delta, metrics = delta_of(config, data)
    assert metrics["actor/grad_norm"][0] > 1e-3
    assert flat(delta).norm().item() == pytest.approx(1e-4, rel=1e-6)
    with pytest.raises(ValueError, match="grad_clip=0.5 and actor_rollout_ref.actor.optim.clip_grad=0.0001"):
        sgd_actor(actor_config(grad_clip=0.5, optim={"clip_grad": 1e-4}))


def test_data_loader_seed_chooses_the_mini_batch_order_when_shuffling():
    data = training_batch(seed=6)
    config = dict(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2, shuffle=True)
    a, _ = delta_of(actor_config(data_loader_seed=1, **config), data)
    a_again, _ = delta_of(actor_config(data_loader_seed=1, **config), data)
    b, _ = delta_of(actor_config(data_loader_seed=2, **config), data)
    assert_same_delta(a, a_again, atol=0)
    assert (flat(a) - flat(b)).abs().max() > 1e-6


def test_sapo_actor_aggregates_per_sequence_whatever_loss_agg_mode_says_and_splits_do_not_matter():
    data = training_batch(seed=7)
    sapo = {"policy_loss": {"loss_mode": "sapo"}, "tau_pos": 2.0, "tau_neg": 3.0}
    one, _ = delta_of(actor_config(ppo_micro_batch_size_per_gpu=8, **sapo), data)
    split, _ = delta_of(actor_config(ppo_micro_batch_size_per_gpu=3, loss_agg_mode="token-mean", **sapo), data)
    assert_same_delta(one, split)
    # at ratio 1 SAPO's gradient is PPO's: the update equals vanilla's with seq-mean-token-mean
    vanilla, _ = delta_of(actor_config(ppo_micro_batch_size_per_gpu=8, loss_agg_mode="seq-mean-token-mean"), data)
    assert_same_delta(one, vanilla)
    assert sgd_actor(actor_config(**sapo)).loss_agg_mode == "seq-mean-token-mean"


def test_rollout_is_weights_weight_each_tokens_term_like_advantages_times_weights():
    data = training_batch(seed=8)
    g = torch.Generator().manual_seed(0)
    weights = (torch.rand(data.batch["advantages"].shape, generator=g, dtype=torch.float64) * 2) * data.batch[
        "response_mask"
    ]
    weighted = copy.deepcopy(data)
    weighted.batch["rollout_is_weights"] = weights
    pre_multiplied = copy.deepcopy(data)
    pre_multiplied.batch["advantages"] = data.batch["advantages"] * weights  # ratio 1: no clipping anywhere
    a, _ = delta_of(actor_config(), weighted)
    b, _ = delta_of(actor_config(), pre_multiplied)
    plain, _ = delta_of(actor_config(), data)
    assert_same_delta(a, b)
    assert (flat(a) - flat(plain)).abs().max() > 1e-6


def test_rollout_log_probs_add_the_current_policys_gap_metrics():
    data = training_batch(seed=9)
    data.batch["rollout_log_probs"] = data.batch["old_log_probs"] - 0.1 * data.batch["response_mask"].double()
    _, metrics = delta_of(actor_config(ppo_micro_batch_size_per_gpu=8), data)
    # one micro-batch, before any step: the current policy is the old one, 0.1 above the rollout's
    assert metrics["rollout_corr/kl"] == [pytest.approx(-0.1, rel=1e-9)]
    assert "rollout_corr/chi2_token" in metrics


def test_bypass_mode_reinforce_trains_on_rollout_log_probs_with_importance_weights():
    data = training_batch(seed=10)
    rollout = data.batch["old_log_probs"] - 0.2 * data.batch["response_mask"].double()
    bypass = copy.deepcopy(data)
    bypass.batch["old_log_probs"] = rollout  # the trainer's apply_bypass_mode
    rc = {"bypass_mode": True, "loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": 1.1}
    config = actor_config(
        ppo_micro_batch_size_per_gpu=8, policy_loss={"loss_mode": "bypass_mode", "rollout_correction": rc}
    )
    delta, metrics = delta_of(config, bypass)
    # each weight is min(e^0.2, 1.1) = 1.1, so REINFORCE's gradient is 1.1 x the on-policy PPO gradient
    on_policy, _ = delta_of(actor_config(ppo_micro_batch_size_per_gpu=8), data)
    assert_scaled(delta, on_policy, 1.1)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == [1.0]  # every raw weight e^0.2 > 1.1
    assert metrics["rollout_corr/rollout_is_mean"] == [pytest.approx(torch.exp(torch.tensor(0.2)).item())]


@pytest.mark.parametrize("use_remove_padding", [False, True])
def test_sum_pi_squared_is_the_collision_probability_at_the_sampling_temperature(use_remove_padding):
    data = training_batch(seed=11)
    data.meta_info["micro_batch_size"] = 3
    model = make_tiny_causal_lm()
    actor = sgd_actor(actor_config(use_remove_padding=use_remove_padding), model=model)
    log_probs, stats = actor.compute_log_prob_and_stats(data, ("entropy", "sum_pi_squared"))
    batch = data.batch
    response_length = batch["responses"].shape[1]
    prompt_length = batch["input_ids"].shape[1] - response_length
    expected = torch.zeros_like(log_probs)
    with torch.no_grad():
        for i in range(len(batch)):
            mask = batch["attention_mask"][i].bool()
            ids = batch["input_ids"][i][mask]
            num_prompt, num_response = int(mask[:prompt_length].sum()), int(mask[prompt_length:].sum())
            probs = torch.softmax(model(input_ids=ids[None]).logits[0].double() / TEMPERATURE, -1)
            for k in range(num_response):
                expected[i, k] = probs[num_prompt - 1 + k].square().sum()
    valid = batch["response_mask"].bool()
    torch.testing.assert_close(stats["sum_pi_squared"][valid], expected[valid], rtol=1e-10, atol=1e-12)
    assert set(stats) == {"entropy", "sum_pi_squared"}
    with pytest.raises(ValueError, match="sum_pi_square'"):
        actor.compute_log_prob_and_stats(data, ("sum_pi_square",))
