"""The critic with Ulysses sequence parallelism (sp=2, dp=1 on 2 gloo ranks) against sp=1:
values and one value-loss update, float64 (differences are summation order only)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_helpers import make_tiny_value_model, one_thread, run_distributed, tiny_qwen2_config
from tests.workers.critic.test_dp_critic import critic_config, value_batch
from verl.workers.critic import DataParallelPPOCritic

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

SP = "ulysses_sequence_parallel_size"


def _four_heads_value_model():
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(0)
    config = tiny_qwen2_config(num_labels=1)
    config.num_attention_heads, config.num_key_value_heads = 4, 2
    return AutoModelForTokenClassification.from_config(config, attn_implementation="sdpa").to(torch.float64)


def _sp_critic_case(rank, world_size, spelling):
    from verl.utils.fsdp_utils import apply_fsdp2, iter_full_params

    data = value_batch(seed=3)  # uneven prompt and response lengths
    data.meta_info = {"micro_batch_size": 4}
    overrides = dict(ppo_micro_batch_size_per_gpu=4, model={"use_remove_padding": True})
    # sp=2 in upstream's older spelling (the role's key) or its newer one (the engine section's)
    sp2 = {"role": {SP: 2}, "engine": {"model": {"use_remove_padding": True, "fsdp_config": {SP: 2}}}}[spelling]
    model = apply_fsdp2(_four_heads_value_model(), {"fsdp_size": -1})
    critic = DataParallelPPOCritic(
        critic_config(**{**overrides, **sp2}),
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        ulysses_group=torch.distributed.group.WORLD,
    )
    assert critic.sp_size == 2, f"the {spelling} key must set the size"
    single_model = _four_heads_value_model()
    single = DataParallelPPOCritic(
        critic_config(**overrides), single_model, torch.optim.SGD(single_model.parameters(), lr=1.0)
    )
    mask = data.batch["response_mask"].bool()
    err = (critic.compute_values(data) - single.compute_values(data))[mask].abs().max().item()
    assert err < 1e-12, f"sp=2 values differ from sp=1 by {err:.3g}"

    critic.update_critic(data)
    single.update_critic(data)
    full = dict(iter_full_params(model))
    for name, tensor in single.critic_module.state_dict().items():
        torch.testing.assert_close(full[name], tensor, atol=1e-11, rtol=1e-9, msg=name)
    moved = max((t - _four_heads_value_model().state_dict()[n]).abs().max().item() for n, t in full.items())
    assert moved > 1e-4, f"the update moved the weights by at most {moved:.3g}; the comparison needs a real step"


@pytest.mark.parametrize("spelling", ["role", "engine"])
def test_critic_values_and_update_with_sp2_equal_sp1(spelling):
    run_distributed(_sp_critic_case, 2, spelling)


def test_critic_sp_without_remove_padding_says_what_to_set():
    with pytest.raises(
        ValueError, match="critic.ulysses_sequence_parallel_size=2 needs critic.model.use_remove_padding=True"
    ):
        DataParallelPPOCritic(critic_config(ulysses_sequence_parallel_size=2), make_tiny_value_model(), None)
