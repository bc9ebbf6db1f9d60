"""The megatron actor trains a GLM-4.5 model (`tiny-glm4moe`: grouped-query attention with q/k/v
bias and half rotary, a dense first layer, sigmoid routing with a fixed correction bias, a shared
expert) as the FSDP actor does: at ep=1, with the experts split over 2 expert-parallel ranks and at
tp=2 (sequence parallel, with per-head q/k norms), one PPO update on 2 ranks gives the
single-process FSDP update on the whole batch (losses, gradient norms, every weight, and the
correction bias left where it was)."""

from __future__ import annotations

import pytest

from tests.distributed_helpers import run_distributed
from tests.megatron_helpers import build_loaded_chunks, tiny_glm4moe_hf_model
from tests.workers.actor.test_megatron_actor import _training_data
from tests.workers.actor.test_megatron_actor_deepseek import update_and_compare_with_fsdp
from tests.workers.actor.test_megatron_actor_moe import fsdp_reference_update


def _against_fsdp_actor(rank, world_size, ep, tp, use_qk_norm):
    from megatron.core import parallel_state as mpu

    hf_model = tiny_glm4moe_hf_model(use_qk_norm=use_qk_norm)
    data = _training_data(hf_model)
    reference_model, want_metrics = fsdp_reference_update(hf_model, data)

    chunks = build_loaded_chunks(hf_model, ep=ep, tp=tp, sequence_parallel=tp > 1)
    dp = mpu.get_data_parallel_world_size()
    assert dp == world_size // tp
    assert len(chunks[0].decoder.layers[1].mlp.experts.local_experts) == 8 // ep
    update_and_compare_with_fsdp(chunks, hf_model, data, reference_model, want_metrics)


@pytest.mark.parametrize("ep,tp,use_qk_norm", [(1, 1, False), (2, 1, False), (1, 2, True)])
def test_megatron_glm4_moe_update_on_two_ranks_equals_the_fsdp_update_on_the_whole_batch(ep, tp, use_qk_norm):
    run_distributed(_against_fsdp_actor, 2, ep, tp, use_qk_norm)
