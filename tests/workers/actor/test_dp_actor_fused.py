"""DataParallelPPOActor with `use_fused_kernels`: log-probs and entropy from the hidden states equal the
per-sequence HF forward, a PPO update equals the unfused one (padded and remove-padding, entropy bonus,
tied and untied heads, FSDP2 on two ranks), and what the fused path does not cover is refused or reported."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed_helpers import make_tiny_causal_lm, one_thread, reference_response_log_probs, run_distributed
from tests.workers.actor.test_dp_actor import TEMPERATURE, actor_config, param_delta, training_batch
from tests.workers.actor.test_shared_prompt_forward import actor_config as shared_actor_config
from tests.workers.actor.test_shared_prompt_forward import (
    float64_rms_norm,  # noqa: F401 (a fixture)
    repeated_prompt_batch,
    sgd_update_delta,
    shared_calls,  # noqa: F401 (a fixture)
)
from verl.workers.actor import DataParallelPPOActor

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


@pytest.mark.parametrize("use_remove_padding", [False, True])
def test_fused_log_probs_and_entropy_equal_per_sequence_hf_forward(use_remove_padding):
    data = training_batch()
    model = make_tiny_causal_lm()  # float64: the fused path is then exact to rounding
    actor = DataParallelPPOActor(
        actor_config(use_remove_padding=use_remove_padding, use_fused_kernels=True, share_prompt_forward=False), model
    )
    assert actor.use_fused_kernels
    expected_lp, expected_ent = reference_response_log_probs(model, data.batch, TEMPERATURE)
    mask = data.batch["response_mask"].bool()
    data.meta_info.update(micro_batch_size=3)
    log_probs, entropy = actor.compute_log_prob(data, calculate_entropy=True)
    assert log_probs.shape == entropy.shape == data.batch["responses"].shape
    torch.testing.assert_close(log_probs[mask], expected_lp[mask], atol=1e-12, rtol=0)
    torch.testing.assert_close(entropy[mask], expected_ent[mask], atol=1e-12, rtol=0)


def _fp32_update(data, tie: bool, **overrides):
    model = make_tiny_causal_lm(dtype=torch.float32, tie_word_embeddings=tie)
    config = actor_config(entropy_coeff=0.01, calculate_entropy=True, **overrides)
    actor = DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=1.0))
    before = copy.deepcopy(model)
    metrics = actor.update_policy(data)
    return param_delta(before, model), metrics


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("use_remove_padding", [False, True])
def test_fused_ppo_update_equals_the_unfused_update_in_fp32(use_remove_padding, tie):
    """The whole update (policy loss and entropy bonus, at temperature 0.7) through the fused head gives
    the unfused update's weight change to 1e-5, the head's (or tied embedding's) included."""
    data = training_batch(seed=4)
    for key in ("old_log_probs", "advantages"):
        data.batch[key] = data.batch[key].float()
    common = {"use_remove_padding": use_remove_padding, "share_prompt_forward": False}
    unfused, unfused_metrics = _fp32_update(data, tie, **common)
    fused, fused_metrics = _fp32_update(data, tie, use_fused_kernels=True, **common)
    assert unfused.keys() == fused.keys()
    head = "model.embed_tokens.weight" if tie else "lm_head.weight"
    assert unfused[head].abs().max() > 1e-3, "the update must move the head for the comparison to mean anything"
    for name in unfused:
        torch.testing.assert_close(fused[name], unfused[name], atol=1e-5, rtol=1e-5, msg=name)
    for key in ("actor/pg_loss", "actor/entropy"):
        assert fused_metrics[key] == pytest.approx(unfused_metrics[key], abs=1e-5), key


def test_micro_batches_that_share_prompts_take_that_path_and_give_the_fully_fused_update(
    shared_calls,  # noqa: F811 (the imported fixture)
    float64_rms_norm,  # noqa: F811
):
    """Both keys on: the shared-prompt forward runs where prompts repeat (GRPO), the fused head elsewhere;
    the update equals the one with every micro-batch fused (float64: to rounding)."""
    data = repeated_prompt_batch()
    fused_everywhere = sgd_update_delta(shared_actor_config(use_fused_kernels=True, share_prompt_forward=False), data)
    assert not shared_calls
    both = sgd_update_delta(shared_actor_config(use_fused_kernels=True, share_prompt_forward=True), data)
    assert shared_calls, "the repeated prompts should take the shared-prompt forward"
    for name in both:
        torch.testing.assert_close(both[name], fused_everywhere[name], atol=1e-10, rtol=1e-8, msg=name)
    actor = DataParallelPPOActor(shared_actor_config(use_fused_kernels=True), make_tiny_causal_lm())
    assert actor.shared_prompt_path.active and "shared-prompt forward compute" in actor.fused_kernels_note


def test_statistics_other_than_the_entropy_are_refused_with_the_fix():
    actor = DataParallelPPOActor(actor_config(use_fused_kernels=True), make_tiny_causal_lm())
    data = training_batch()
    data.meta_info.update(micro_batch_size=8)
    with pytest.raises(ValueError, match=r"log-probs and entropy only, not \['sum_pi_squared'\]"):
        actor.compute_log_prob_and_stats(data, ("sum_pi_squared",))


def test_a_model_whose_head_the_fused_path_would_get_wrong_is_refused_when_the_actor_is_built():
    model = make_tiny_causal_lm(tie_word_embeddings=False)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        DataParallelPPOActor(actor_config(use_fused_kernels=True), model)


def _two_rank_fused(rank, world_size):
    from verl.utils.fsdp_utils import apply_fsdp2, iter_full_params

    data = training_batch(batch_size=8, seed=7)
    for key in ("old_log_probs", "advantages"):
        data.batch[key] = data.batch[key].float()
    local = data.select_idxs(torch.arange(rank * 4, (rank + 1) * 4))
    fsdp_model = apply_fsdp2(make_tiny_causal_lm(dtype=torch.float32), {"fsdp_size": -1})
    config = actor_config(ppo_mini_batch_size=4, use_fused_kernels=True, entropy_coeff=0.01, share_prompt_forward=False)
    actor = DataParallelPPOActor(config, fsdp_model, torch.optim.SGD(fsdp_model.parameters(), lr=1.0))
    actor.update_policy(local)
    single = make_tiny_causal_lm(dtype=torch.float32)
    unfused = actor_config(ppo_mini_batch_size=8, entropy_coeff=0.01, share_prompt_forward=False)
    DataParallelPPOActor(unfused, single, torch.optim.SGD(single.parameters(), lr=1.0)).update_policy(data)
    full = dict(iter_full_params(fsdp_model))
    for name, tensor in single.state_dict().items():
        torch.testing.assert_close(full[name], tensor, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.slow  # two processes: about 7 s on 2 cores
def test_fused_update_on_two_fsdp2_ranks_equals_the_single_process_unfused_update():
    """FSDP2 shards the head weight: the fused head must run inside the model's call, where it is gathered."""
    run_distributed(_two_rank_fused, 2)
