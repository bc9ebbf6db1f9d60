"""The actor with Ulysses sequence parallelism (sp=2, dp=1 on 2 gloo ranks) against sp=1.

Both ranks of the sp group get the same rows, as the worker dispatches them; the model is FSDP2
over both ranks, whose gradient average is what `grad_scale=sp` in the actor compensates for.
float64 throughout, so the comparisons are tight: the only differences are summation orders.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed_helpers import make_tiny_causal_lm, one_thread, run_distributed
from tests.workers.actor.test_dp_actor import actor_config, sgd_actor, training_batch
from verl.workers.actor import DataParallelPPOActor

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

SP = "ulysses_sequence_parallel_size"


def _two_heads_lm():
    # the shared tiny Qwen2 has one attention head; sp=2 needs a multiple of 2
    from transformers import AutoModelForCausalLM

    from tests.distributed_helpers import tiny_qwen2_config

    torch.manual_seed(0)
    config = tiny_qwen2_config()
    config.num_attention_heads, config.num_key_value_heads = 4, 2
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(torch.float64)


def _sp2(spelling: str) -> dict:
    """sp=2 in upstream's older spelling (the role's key) or its newer one (the engine section's)."""
    return {"role": {SP: 2}, "engine": {"fsdp_config": {SP: 2}}}[spelling]


def _sp_actor_case(rank, world_size, use_dynamic_bsz, spelling):
    from verl.utils.fsdp_utils import apply_fsdp2, iter_full_params

    data = training_batch(batch_size=8, seed=7)  # uneven prompt and response lengths
    data.meta_info.update(micro_batch_size=4, use_dynamic_bsz=use_dynamic_bsz, max_token_len=40)
    overrides = dict(use_remove_padding=True, ppo_micro_batch_size_per_gpu=4, use_dynamic_bsz=use_dynamic_bsz)
    overrides.update(ppo_max_token_len_per_gpu=40)

    model = apply_fsdp2(_two_heads_lm(), {"fsdp_size": -1})
    actor = DataParallelPPOActor(
        actor_config(**_sp2(spelling), **overrides),
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        ulysses_group=torch.distributed.group.WORLD,
    )
    assert actor.sp_size == 2, f"the {spelling} key must set the size"
    single = sgd_actor(actor_config(**overrides), _two_heads_lm())

    log_probs, entropy = actor.compute_log_prob(data, calculate_entropy=True)
    ref_log_probs, ref_entropy = single.compute_log_prob(data, calculate_entropy=True)
    mask = data.batch["response_mask"].bool()
    err = (log_probs - ref_log_probs)[mask].abs().max().item()
    assert err < 1e-12, f"sp=2 log-probs differ from sp=1 by {err:.3g}"
    err = (entropy - ref_entropy)[mask].abs().max().item()
    assert err < 1e-12, f"sp=2 entropy differs from sp=1 by {err:.3g}"

    metrics = actor.update_policy(data)
    single_metrics = single.update_policy(data)
    full = dict(iter_full_params(model))
    moved = 0.0
    for name, tensor in single.actor_module.state_dict().items():
        torch.testing.assert_close(full[name], tensor, atol=1e-11, rtol=1e-9, msg=name)
        moved = max(moved, (tensor - _two_heads_lm().get_parameter(name)).abs().max().item())
    assert moved > 1e-3, "the update must move the weights for the comparison to mean anything"
    assert metrics["actor/grad_norm"][0] == pytest.approx(single_metrics["actor/grad_norm"][0], rel=1e-9)


@pytest.mark.parametrize(("use_dynamic_bsz", "spelling"), [(False, "role"), (True, "role"), (False, "engine")])
def test_actor_update_with_sp2_equals_sp1(use_dynamic_bsz, spelling):
    run_distributed(_sp_actor_case, 2, use_dynamic_bsz, spelling)


def test_two_different_sizes_in_the_two_spellings_are_refused_naming_both():
    with pytest.raises(ValueError, match=rf"actor.{SP}=2 and actor.fsdp_config.{SP}=4 set two different"):
        DataParallelPPOActor(
            actor_config(use_remove_padding=True, fsdp_config={SP: 4}, **{SP: 2}), _two_heads_lm(), None
        )


def _indivisible_heads_case(rank, world_size):
    # module level: once Ray runs in this session the ranks start from a forkserver, which pickles the function
    with pytest.raises(ValueError, match=r"ulysses_sequence_parallel_size=2.*num_attention_heads=1"):
        DataParallelPPOActor(
            actor_config(ulysses_sequence_parallel_size=2, use_remove_padding=True),
            make_tiny_causal_lm(),
            ulysses_group=torch.distributed.group.WORLD,
        )


def test_heads_not_divisible_by_sp_fail_when_the_actor_is_built():
    run_distributed(_indivisible_heads_case, 2)
