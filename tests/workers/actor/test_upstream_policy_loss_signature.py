"""A policy loss written to upstream's signature `(old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode, config, rollout_is_weights)` and registered with `register_policy_loss` trains in the
actor, called as upstream's actor calls it; the built-in losses take upstream's `config` argument too."""

from __future__ import annotations

import pytest
import torch

from tests.workers.actor.test_dp_actor import actor_config, sgd_actor, training_batch
from verl.algorithms.policy_losses import POLICY_LOSSES, PolicyLossParams
from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla, register_policy_loss
from verl.trainer.ppo.core_algos import get_policy_loss_fn as upstream_get_policy_loss_fn
from verl.workers.config.actor import ActorConfig

NAME = "test_only_upstream_signature"


@pytest.fixture
def upstream_style_loss():
    calls = []

    @register_policy_loss(NAME)
    def loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode="token-mean",
        config=None,
        rollout_is_weights=None,
    ):
        calls.append({"config": config, "rollout_is_weights": rollout_is_weights, "mode": loss_agg_mode})
        scale = config.get("clip_ratio_c", 3.0) / config.clip_ratio  # 3.0 / 0.2 = 15 with the defaults
        ratio = torch.exp(log_prob - old_log_prob)
        per_token = -advantages * ratio * scale
        return (per_token * response_mask).sum() / response_mask.sum(), {"my_metric": 1.5}

    yield loss, calls
    POLICY_LOSSES.pop(NAME)


def test_the_actor_trains_a_loss_written_to_upstreams_signature(upstream_style_loss):
    loss, calls = upstream_style_loss
    data = training_batch(batch_size=4, seed=3)
    cfg = actor_config(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, policy_loss={"loss_mode": NAME})
    actor = sgd_actor(cfg)
    before = {n: p.detach().clone() for n, p in actor.actor_module.named_parameters()}
    metrics = actor.update_policy(data)

    assert len(calls) == 1
    assert isinstance(calls[0]["config"], ActorConfig) and calls[0]["config"] is actor.config
    assert calls[0]["rollout_is_weights"] is None and calls[0]["mode"] == "token-mean"
    assert metrics["actor/my_metric"] == [1.5]  # one micro-batch's value, as upstream's metric lists

    # independent reference: d/dtheta of -mean(A * pi/pi_old) * 15 over the response tokens, at ratio 1
    ref = sgd_actor(cfg)
    td = data.batch
    n_resp = td["responses"].shape[1]
    logits = ref.actor_module(
        input_ids=td["input_ids"], attention_mask=td["attention_mask"], position_ids=td["position_ids"]
    ).logits[:, -n_resp - 1 : -1]
    log_prob = torch.log_softmax(logits / data.meta_info["temperature"], -1).gather(-1, td["responses"][..., None])[
        ..., 0
    ]
    mask = td["response_mask"]
    surrogate = (-td["advantages"] * torch.exp(log_prob - td["old_log_probs"]) * 15.0 * mask).sum() / mask.sum()
    surrogate.backward()
    got = {n: p.detach() - before[n] for n, p in actor.actor_module.named_parameters()}
    for name, p in ref.actor_module.named_parameters():
        torch.testing.assert_close(got[name], -p.grad, atol=1e-11, rtol=1e-9, msg=name)
    assert any(g.abs().max() > 0 for g in got.values())


def test_builtin_losses_read_upstreams_config_argument():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(3, 5, generator=g, dtype=torch.float64)
    new = old + 0.3 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.float64)
    # upstream's ActorConfig sets clip_ratio_low/high to 0.2 themselves; they win over clip_ratio
    config = ActorConfig(clip_ratio=0.5, clip_ratio_low=0.05, clip_ratio_high=0.05, ppo_micro_batch_size_per_gpu=1)
    by_config, m1 = compute_policy_loss_vanilla(
        old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, loss_agg_mode="token-mean", config=config
    )
    by_params, m2 = compute_policy_loss_vanilla(
        old, new, adv, mask, "token-mean", params=PolicyLossParams(clip_ratio=0.05)
    )
    default, _ = compute_policy_loss_vanilla(old, new, adv, mask, "token-mean")
    torch.testing.assert_close(by_config, by_params, atol=0, rtol=0)
    # hand reference: token-mean of max(-A r, -A clip(r, 0.95, 1.05)), dual clip at 3 inactive for |log r| small
    ratio = torch.exp(new - old)
    expected = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.95, 1.05)).mean()
    torch.testing.assert_close(by_config, expected, atol=1e-12, rtol=0)
    assert not torch.equal(by_config, default)  # 0.05 clips more than the default 0.2
    assert float(m1["pg_clipfrac"]) == float(m2["pg_clipfrac"]) > 0
    assert upstream_get_policy_loss_fn("vanilla") is compute_policy_loss_vanilla
