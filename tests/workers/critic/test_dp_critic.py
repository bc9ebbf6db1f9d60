"""DataParallelPPOCritic: values against per-sequence HF forwards, value-loss updates, FSDP2 on 2 ranks."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed_helpers import make_ppo_batch, make_tiny_value_model, one_thread, run_distributed
from verl.protocol import DataProto
from verl.trainer.ppo.core_algos import compute_value_loss
from verl.workers.critic import DataParallelPPOCritic

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


def critic_config(**overrides):
    config = {
        "ppo_mini_batch_size": 8,
        "ppo_micro_batch_size_per_gpu": 2,
        "use_dynamic_bsz": False,
        "ppo_max_token_len_per_gpu": 24,
        "ppo_epochs": 1,
        "grad_clip": 1e9,
        "cliprange_value": 0.5,
        "loss_agg_mode": "token-mean",
        "model": {"use_remove_padding": False},
    }
    config.update(overrides)
    return config


@torch.no_grad()
def reference_values(model, batch) -> torch.Tensor:
    """Each row's real tokens alone through the model; the value of response token k is read at the
    position before it."""
    response_length = batch["responses"].shape[1]
    prompt_length = batch["input_ids"].shape[1] - response_length
    out = torch.zeros(batch["responses"].shape, dtype=torch.float64)
    for i in range(len(batch)):
        mask = batch["attention_mask"][i].bool()
        num_prompt = int(mask[:prompt_length].sum())
        num_response = int(mask[prompt_length:].sum())
        scores = model(input_ids=batch["input_ids"][i][mask][None], use_cache=False).logits[0, :, 0]
        out[i, :num_response] = scores[num_prompt - 1 : num_prompt - 1 + num_response]
    return out


def value_batch(seed=0, batch_size=8) -> DataProto:
    td = make_ppo_batch(batch_size=batch_size, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    values = reference_values(make_tiny_value_model(), td)
    td["values"] = values
    td["returns"] = (values + torch.randn(values.shape, generator=g, dtype=torch.float64)) * td["response_mask"]
    return DataProto.from_dict(tensors=dict(td.items()))


def reference_delta(data: DataProto) -> dict[str, torch.Tensor]:
    model = make_tiny_value_model()
    td = data.batch
    response_length = td["responses"].shape[1]
    vpreds = model(
        input_ids=td["input_ids"], attention_mask=td["attention_mask"], position_ids=td["position_ids"], use_cache=False
    ).logits[:, -response_length - 1 : -1, 0]
    loss, _ = compute_value_loss(vpreds, td["returns"], td["values"], td["response_mask"], 0.5, "token-mean")
    loss.backward()
    return {n: -p.grad for n, p in model.named_parameters()}


def sgd_critic(config, lr=1.0):
    model = make_tiny_value_model()
    return DataParallelPPOCritic(config, model, torch.optim.SGD(model.parameters(), lr=lr))


def delta(before, after):
    return {n: p.detach() - before.get_parameter(n).detach() for n, p in after.named_parameters()}


@pytest.mark.parametrize("use_remove_padding", [False, True])
def test_values_equal_per_sequence_forward_and_are_zero_at_padding(use_remove_padding):
    data = value_batch()
    model = make_tiny_value_model()
    critic = DataParallelPPOCritic(critic_config(model={"use_remove_padding": use_remove_padding}), model, None)
    expected = reference_values(model, data.batch)
    for meta in ({"micro_batch_size": 3}, {"use_dynamic_bsz": True, "max_token_len": 20}):
        data.meta_info = dict(meta)
        values = critic.compute_values(data)
        torch.testing.assert_close(values, expected, atol=1e-12, rtol=0)


def test_any_micro_batch_split_and_remove_padding_give_the_full_batch_value_gradient():
    data = value_batch(seed=1)
    expected = reference_delta(data)
    for overrides in (
        {"ppo_micro_batch_size_per_gpu": 3},
        {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 22},
        {"model": {"use_remove_padding": True}},
    ):
        critic = sgd_critic(critic_config(**overrides))
        before = copy.deepcopy(critic.critic_module)
        metrics = critic.update_critic(data)
        got = delta(before, critic.critic_module)
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], atol=1e-11, rtol=1e-9, msg=name)
        assert set(metrics) == {
            "critic/vf_loss",
            "critic/vf_clipfrac",
            "critic/vpred_mean",
            "critic/grad_norm",
            "critic/lr",
            "critic/skipped_nonfinite_grad",
        }


def test_repeated_updates_fit_the_returns():
    data = value_batch(seed=2)
    model = make_tiny_value_model()
    critic = DataParallelPPOCritic(
        critic_config(ppo_epochs=10, cliprange_value=100.0), model, torch.optim.Adam(model.parameters(), lr=1e-2)
    )
    metrics = critic.update_critic(data)
    losses = metrics["critic/vf_loss"]
    assert len(losses) == 40 and len(metrics["critic/grad_norm"]) == 10
    assert sum(losses[-4:]) < 0.5 * sum(losses[:4])


def test_missing_returns_is_a_clear_error():
    data = value_batch()
    data.batch = data.batch.exclude("returns")
    with pytest.raises(KeyError, match="returns"):
        sgd_critic(critic_config()).update_critic(data)


def _two_rank_critic(rank, world_size, layout):
    from verl.utils.fsdp_utils import apply_fsdp2, iter_full_params
    from verl.workers.dp_training import replicate_over_ranks

    data = value_batch(seed=3)
    local = data.chunk(world_size)[rank]
    model = apply_fsdp2(make_tiny_value_model()) if layout == "fsdp2" else replicate_over_ranks(make_tiny_value_model())
    critic = DataParallelPPOCritic(
        critic_config(ppo_mini_batch_size=4, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=16),
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
    )
    local.meta_info = {"use_dynamic_bsz": True, "max_token_len": 16}
    torch.testing.assert_close(
        critic.compute_values(local), reference_values(make_tiny_value_model(), local.batch), atol=1e-12, rtol=0
    )
    critic.update_critic(local)
    single = sgd_critic(critic_config(ppo_micro_batch_size_per_gpu=8))
    single.update_critic(data)
    full = dict(iter_full_params(model))
    for name, tensor in single.critic_module.state_dict().items():
        torch.testing.assert_close(full[name], tensor, atol=1e-11, rtol=1e-9, msg=name)


@pytest.mark.parametrize("layout", ["fsdp2", "replicas"])
def test_critic_on_two_ranks_matches_single_process(layout):
    run_distributed(_two_rank_critic, 2, layout)
