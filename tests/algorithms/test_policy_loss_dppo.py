"""DPPO's binary trust-region losses (`dppo_tv`, `dppo_kl`) on hand-worked tokens, in float64: which
tokens each keeps (worked out below by hand), the truncated-IS REINFORCE loss on the kept ones, its
gradient and the metrics."""

from __future__ import annotations

import math

import pytest
import torch

from verl.algorithms.policy_losses import PolicyLossParams, get_policy_loss_fn

D = torch.float64
# token: (advantage, old prob, new prob)
TOKENS = [
    (+1.0, 0.5, 0.6),  # TV +0.1 (kept); binary KL 0.0204 (kept)
    (+1.0, 0.3, 0.6),  # TV +0.3 > 0.2 (dropped); binary KL 0.1838 <= 0.2 (kept)
    (-1.0, 0.5, 0.2),  # TV -0.3 < -0.2 (dropped); KL 0.2231 > 0.2 and the probability fell (dropped)
    (-1.0, 0.5, 0.4),  # TV -0.1 (kept); KL 0.0204 (kept)
    (+1.0, 0.05, 0.2),  # TV +0.15 (kept); KL 0.0939 (kept); ratio 4 > clip_ratio_c = 3: weight 3
    (+1.0, 0.8, 0.2),  # a positive advantage whose probability fell: kept by both whatever the divergence
]
KEPT = {"dppo_tv": [1, 0, 0, 1, 1, 1], "dppo_kl": [1, 1, 0, 1, 1, 1]}


def _binary_kl(p, q):
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def test_the_hand_worked_divergences():
    assert _binary_kl(0.3, 0.6) == pytest.approx(0.18379, abs=1e-5)
    assert _binary_kl(0.5, 0.2) == pytest.approx(0.22314, abs=1e-5)
    assert _binary_kl(0.05, 0.2) == pytest.approx(0.09394, abs=1e-5)


@pytest.mark.parametrize("mode", ["dppo_tv", "dppo_kl"])
def test_kept_tokens_loss_gradient_and_metrics(mode):
    adv = torch.tensor([[a for a, _, _ in TOKENS]], dtype=D)
    old = torch.log(torch.tensor([[p for _, p, _ in TOKENS]], dtype=D))
    new = torch.log(torch.tensor([[q for _, _, q in TOKENS]], dtype=D)).requires_grad_(True)
    mask = torch.ones_like(adv)
    params = PolicyLossParams(clip_ratio=0.2, clip_ratio_c=3.0)
    loss, metrics = get_policy_loss_fn(mode)(old, new, adv, mask, "token-mean", params=params)

    weights = [min(q / p, 3.0) for _, p, q in TOKENS]
    per_token = [-a * w * math.log(q) * k for (a, _, q), w, k in zip(TOKENS, weights, KEPT[mode], strict=True)]
    assert loss.item() == pytest.approx(sum(per_token) / 6, rel=1e-12)
    loss.backward()  # d/d log pi of -A sg(w) log pi is -A w on kept tokens, 0 on dropped ones
    expected_grad = [-a * w * k / 6 for (a, _, _), w, k in zip(TOKENS, weights, KEPT[mode], strict=True)]
    torch.testing.assert_close(new.grad, torch.tensor([expected_grad], dtype=D))
    assert metrics["pg_clipfrac"].item() == pytest.approx(KEPT[mode].count(0) / 6)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 6)  # token 5, kept with ratio 4 > 3
    assert metrics["ppo_kl"].item() == pytest.approx(sum(math.log(p / q) for _, p, q in TOKENS) / 6)


def test_the_thresholds_are_clip_ratio_low_and_high():
    adv = torch.tensor([[1.0, -1.0]], dtype=D)
    old = torch.log(torch.tensor([[0.5, 0.5]], dtype=D))
    new = torch.log(torch.tensor([[0.75, 0.25]], dtype=D))  # +0.25 with A > 0, -0.25 with A < 0
    mask = torch.ones_like(adv)
    loss_fn = get_policy_loss_fn("dppo_tv")
    _, m = loss_fn(old, new, adv, mask, params=PolicyLossParams(clip_ratio_low=0.3, clip_ratio_high=0.2))
    assert m["pg_clipfrac"].item() == pytest.approx(0.5)  # the rise beyond 0.2 is dropped, the fall within 0.3 kept
    _, m = loss_fn(old, new, adv, mask, params=PolicyLossParams(clip_ratio_low=0.2, clip_ratio_high=0.3))
    assert m["pg_clipfrac"].item() == pytest.approx(0.5)
    _, m = loss_fn(old, new, adv, mask, params=PolicyLossParams(clip_ratio=0.3))
    assert m["pg_clipfrac"].item() == 0.0
