"""The critic keys upstream v0.9 added that change what the critic computes: `critic.loss_scale_factor`
(seq-mean-token-sum-norm's constant length) and the remove-padding default of `critic.model`."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed_helpers import make_tiny_value_model, one_thread
from tests.workers.critic.test_dp_critic import critic_config, delta, sgd_critic, value_batch
from verl.workers.critic import DataParallelPPOCritic

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


def norm_delta(data, length: float) -> dict[str, torch.Tensor]:
    """-grad of 1/2 * sum_{i,t} m_it (V_it - G_it)^2 / (B * length), written out (no clipping: the clip
    range is wide): seq-mean-token-sum-norm over the whole batch with the constant length `length`."""
    model = make_tiny_value_model()
    td = data.batch
    r = td["responses"].shape[1]
    vpreds = model(
        input_ids=td["input_ids"], attention_mask=td["attention_mask"], position_ids=td["position_ids"], use_cache=False
    ).logits[:, -r - 1 : -1, 0]
    mask = td["response_mask"].to(vpreds.dtype)
    loss = 0.5 * (mask * (vpreds - td["returns"]) ** 2).sum() / (len(data) * length)
    loss.backward()
    return {n: -p.grad for n, p in model.named_parameters()}


def critic_delta(data, **overrides):
    critic = sgd_critic(
        critic_config(loss_agg_mode="seq-mean-token-sum-norm", cliprange_value=1e6, ppo_micro_batch_size_per_gpu=3)
        | overrides
    )
    before = copy.deepcopy(critic.critic_module)
    critic.update_critic(data)
    return delta(before, critic.critic_module)


@pytest.mark.parametrize("factor, length", [(7.0, 7.0), (None, 5)])  # None: the padded response length R=5
def test_loss_scale_factor_is_the_constant_length_of_seq_mean_token_sum_norm(factor, length):
    data = value_batch(seed=3)
    assert data.batch["responses"].shape[1] == 5
    expected = norm_delta(data, length)
    got = critic_delta(data, loss_scale_factor=factor)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-11, rtol=1e-9, msg=name)


def test_loss_scale_factor_changes_the_update():
    """Not a no-op: doubling the length halves the step."""
    data = value_batch(seed=4)
    short, long = critic_delta(data, loss_scale_factor=4.0), critic_delta(data, loss_scale_factor=8.0)
    name = next(iter(short))
    assert short[name].abs().sum() > 0
    torch.testing.assert_close(long[name], short[name] / 2, atol=1e-12, rtol=1e-9)


def test_loss_scale_factor_must_be_positive():
    with pytest.raises(ValueError, match=r"critic.loss_scale_factor=-1.0 must be > 0"):
        sgd_critic(critic_config(loss_scale_factor=-1.0))


def test_remove_padding_is_the_default_and_gives_the_padded_values():
    """upstream v0.9's critic.model.use_remove_padding defaults to true; the values are the padded forward's."""
    data = value_batch(seed=5)
    config = critic_config()
    del config["model"]
    model = make_tiny_value_model()
    packed = DataParallelPPOCritic(config, model, None)
    padded = DataParallelPPOCritic(critic_config(model={"use_remove_padding": False}), model, None)
    assert packed.use_remove_padding is True and padded.use_remove_padding is False
    data.meta_info = {"micro_batch_size": 3}
    torch.testing.assert_close(packed.compute_values(data), padded.compute_values(data), atol=1e-12, rtol=0)
