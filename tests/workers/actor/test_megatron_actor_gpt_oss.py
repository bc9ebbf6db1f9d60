"""The megatron actor trains a gpt-oss model (`tiny-gptoss`: attention sinks, a sliding-window then a
full-attention layer, YaRN, biases on attention, router and experts, the clamped SwiGLU) as the FSDP
actor does: at ep=1, with the experts split over 2 expert-parallel ranks and at tp=2 (sequence
parallel, experts whole on each rank: expert_tensor_parallel_size=1) and on 2 pipeline stages, one
PPO update on 2 ranks
gives the single-process FSDP update on the whole batch (its packed, remove-padding forward):
losses, gradient norms and every weight, the sinks and biases included."""

from __future__ import annotations

import pytest

from tests.distributed_helpers import run_distributed
from tests.megatron_helpers import build_loaded_chunks, tiny_gptoss_hf_model
from tests.workers.actor.test_megatron_actor import _training_data
from tests.workers.actor.test_megatron_actor_deepseek import update_and_compare_with_fsdp
from tests.workers.actor.test_megatron_actor_moe import fsdp_reference_update


def _against_fsdp_actor(rank, world_size, ep, tp, pp=1):
    from megatron.core import parallel_state as mpu

    hf_model = tiny_gptoss_hf_model()
    data = _training_data(hf_model)
    reference_model, want_metrics = fsdp_reference_update(hf_model, data)
    start = {name: p.detach().clone() for name, p in hf_model.named_parameters()}
    for name in ("model.layers.0.self_attn.sinks", "model.layers.1.mlp.experts.down_proj_bias"):
        assert (reference_model.state_dict()[name] - start[name]).abs().max() > 1e-4, f"{name} should train"

    chunks = build_loaded_chunks(hf_model, ep=ep, tp=tp, pp=pp, etp=1, sequence_parallel=tp > 1)
    assert mpu.get_data_parallel_world_size() == world_size // (tp * pp)
    assert len(chunks[0].decoder.layers[-1].mlp.experts.local_experts) == 4 // ep
    update_and_compare_with_fsdp(chunks, hf_model, data, reference_model, want_metrics)


@pytest.mark.parametrize("ep,tp,pp", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_megatron_gpt_oss_update_on_two_ranks_equals_the_fsdp_update_on_the_whole_batch(ep, tp, pp):
    """pp=2: the sliding-window layer on the first stage, the full-attention layer on the second."""
    run_distributed(_against_fsdp_actor, 2, ep, tp, pp)
