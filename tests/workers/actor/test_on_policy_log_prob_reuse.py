"""A strictly on-policy update without old_log_probs equals the update with recomputed ones."""

import pytest
import torch
from distributed_helpers import make_ppo_batch, make_tiny_causal_lm

from verl.protocol import DataProto
from verl.workers.actor.dp_actor import DataParallelPPOActor

CFG = dict(
    ppo_mini_batch_size=8,
    ppo_micro_batch_size_per_gpu=4,
    ppo_epochs=1,
    clip_ratio=0.2,
    grad_clip=1.0,
    loss_agg_mode="token-mean",
    entropy_coeff=0.0,
    use_kl_loss=False,
    policy_loss={"loss_mode": "vanilla"},
)


def _update(with_old_log_probs: bool, cfg=CFG):
    model = make_tiny_causal_lm(seed=0)
    actor = DataParallelPPOActor(cfg, model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    batch = make_ppo_batch(batch_size=8, seed=1)
    batch["advantages"] = torch.randn(8, batch["responses"].shape[1], generator=torch.Generator().manual_seed(2))
    data = DataProto(batch=batch, meta_info={"temperature": 0.8, "micro_batch_size": 4})
    if with_old_log_probs:
        data.batch["old_log_probs"], _ = actor.compute_log_prob(data)
    metrics = actor.update_policy(data)
    return model, metrics


def test_reusing_current_log_probs_gives_the_same_update_as_recomputing_them():
    recomputed, m1 = _update(with_old_log_probs=True)
    reused, m2 = _update(with_old_log_probs=False)
    for (name, a), (_, b) in zip(recomputed.named_parameters(), reused.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)
    assert m2["actor/pg_clipfrac"] == [0.0, 0.0] and "actor/entropy" in m2
    assert m1["actor/grad_norm"] == pytest.approx(m2["actor/grad_norm"])


def test_missing_old_log_probs_with_several_mini_batches_is_an_error():
    with pytest.raises(KeyError, match="strictly on-policy"):
        _update(with_old_log_probs=False, cfg={**CFG, "ppo_mini_batch_size": 4})
