"""The megatron actor trains a GLM-4.5 model (`tiny-glm4moe`: grouped-query attention with q/k/v
bias and half rotary, a dense first layer, sigmoid routing with a fixed correction bias, a shared
expert) as the FSDP actor does: one PPO update on 2 ranks gives the single-process FSDP update on
the whole batch (losses, gradient norms, every weight, and the correction bias left where it was)
at ep=1, with the experts split over 2 expert-parallel ranks, at tp=2 (sequence parallel, with
per-head q/k norms), on 2 pipeline stages and with each sequence split over 2 context-parallel ranks
(upstream's GLM-4.5-Air recipe runs cp=4; the half rotary is applied to each rank's positions).

Pipeline stages: the preset's 3 layers (dense, MoE, MoE) split unevenly, sized with
`num_layers_in_first_pipeline_stage` or `num_layers_in_last_pipeline_stage` as upstream's scripts
size theirs; a 4-layer model (dense + MoE, MoE + MoE) splits evenly."""

from __future__ import annotations

import pytest

from tests.distributed_helpers import run_distributed
from tests.megatron_helpers import build_loaded_chunks, tiny_glm4moe_hf_model
from tests.workers.actor.test_megatron_actor import _training_data
from tests.workers.actor.test_megatron_actor_deepseek import _layer_kinds, update_and_compare_with_fsdp
from tests.workers.actor.test_megatron_actor_moe import fsdp_reference_update

# pp=2 stages: name -> (number of layers, stage sizes, the layer kinds on stage 0 and stage 1)
_PP2_STAGES = {
    "first=1": (3, {"num_layers_in_first_pipeline_stage": 1}, (["dense"], ["moe", "moe"])),
    "last=1": (3, {"num_layers_in_last_pipeline_stage": 1}, (["dense", "moe"], ["moe"])),
    "even": (4, None, (["dense", "moe"], ["moe", "moe"])),
}


def _against_fsdp_actor(rank, world_size, ep, tp, use_qk_norm, cp=1, stages=None):
    from megatron.core import parallel_state as mpu

    num_layers, overrides, kinds = _PP2_STAGES[stages] if stages else (None, None, None)
    pp = 2 if stages else 1
    hf_model = tiny_glm4moe_hf_model(use_qk_norm=use_qk_norm, num_layers=num_layers)
    data = _training_data(hf_model)
    reference_model, want_metrics = fsdp_reference_update(hf_model, data)

    chunks = build_loaded_chunks(hf_model, ep=ep, tp=tp, pp=pp, cp=cp, sequence_parallel=tp > 1, tf_overrides=overrides)
    assert mpu.get_data_parallel_world_size() == world_size // (tp * pp * cp)
    assert mpu.get_context_parallel_world_size() == cp
    if stages:
        assert _layer_kinds(chunks[0]) == kinds[mpu.get_pipeline_model_parallel_rank()]
    for layer in chunks[0].decoder.layers:
        if hasattr(layer.mlp, "router"):
            assert len(layer.mlp.experts.local_experts) == 8 // ep
    update_and_compare_with_fsdp(chunks, hf_model, data, reference_model, want_metrics)


@pytest.mark.parametrize("ep,tp,use_qk_norm", [(1, 1, False), (2, 1, False), (1, 2, True)])
def test_megatron_glm4_moe_update_on_two_ranks_equals_the_fsdp_update_on_the_whole_batch(ep, tp, use_qk_norm):
    run_distributed(_against_fsdp_actor, 2, ep, tp, use_qk_norm)


@pytest.mark.parametrize(
    "ep,stages",
    [
        *[(1, stages) for stages in sorted(_PP2_STAGES)],
        pytest.param(2, "first=1", marks=pytest.mark.slow),  # four ranks (pp=2 x ep=2): the slow tier
    ],
)
def test_megatron_glm4_moe_update_on_two_pipeline_stages_equals_the_fsdp_update(ep, stages):
    run_distributed(_against_fsdp_actor, 2 * ep, ep, 1, True, 1, stages)


def test_megatron_glm4_moe_update_at_cp2_equals_the_fsdp_update():
    run_distributed(_against_fsdp_actor, 2, 1, 1, True, 2)
