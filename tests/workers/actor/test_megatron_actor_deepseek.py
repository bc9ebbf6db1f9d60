"""The megatron actor trains a DeepSeek-V3 model (`tiny-dsv3`: latent attention, a dense first
layer, sigmoid group-limited routing with a fixed correction bias, a shared expert) as the FSDP
actor does: at ep=1, with the experts split over 2 expert-parallel ranks, at tp=2 (sequence
parallel), at cp=2 (context parallel) and on 2 pipeline stages, one PPO update gives the single-process FSDP update on the
whole batch (losses, gradient norms, every weight, and the correction bias left where it was).

The preset's 3 layers (dense, MoE, MoE) do not split evenly over 2 stages: the stages are sized
as upstream's DeepSeek-V3 scripts size theirs, with `num_layers_in_first_pipeline_stage` or
`num_layers_in_last_pipeline_stage`, so one layout puts the dense layer alone on the first stage
and the other the dense and a MoE layer together."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed_helpers import run_distributed
from tests.megatron_helpers import assert_metrics_close, build_loaded_chunks, tiny_dsv3_hf_model
from tests.workers.actor.test_megatron_actor import LR, _actor_config, _gathered_weights, _training_data
from tests.workers.actor.test_megatron_actor_moe import fsdp_reference_update

# pp=2 stage sizes: (first, last) -> the layer kinds on stage 0 and stage 1
_SPLITS = {
    "first=1": ({"num_layers_in_first_pipeline_stage": 1}, (["dense"], ["moe", "moe"])),
    "last=1": ({"num_layers_in_last_pipeline_stage": 1}, (["dense", "moe"], ["moe"])),
}


def _layer_kinds(chunk) -> list[str]:
    return ["moe" if hasattr(layer.mlp, "router") else "dense" for layer in chunk.decoder.layers]


def _against_fsdp_actor(rank, world_size, ep, tp, pp=1, split=None, cp=1):
    from megatron.core import parallel_state as mpu

    hf_model = tiny_dsv3_hf_model()
    data = _training_data(hf_model)
    reference_model, want_metrics = fsdp_reference_update(hf_model, data)

    overrides, kinds = _SPLITS[split] if split else (None, (["dense", "moe", "moe"],))
    chunks = build_loaded_chunks(hf_model, ep=ep, tp=tp, pp=pp, cp=cp, sequence_parallel=tp > 1, tf_overrides=overrides)
    dp = mpu.get_data_parallel_world_size()
    assert dp == world_size // (tp * pp * cp)
    assert mpu.get_context_parallel_world_size() == cp
    assert _layer_kinds(chunks[0]) == kinds[mpu.get_pipeline_model_parallel_rank()]
    for layer in chunks[0].decoder.layers:
        if hasattr(layer.mlp, "router"):
            assert len(layer.mlp.experts.local_experts) == 8 // ep
    update_and_compare_with_fsdp(chunks, hf_model, data, reference_model, want_metrics)


def update_and_compare_with_fsdp(chunks, hf_model, data, reference_model, want_metrics) -> None:
    """One SGD update of the megatron `chunks` on this data-parallel rank's half of `data` (all of it at
    dp=1): its metrics and every gathered weight equal the FSDP reference update's (1e-5), the routers'
    correction bias stays, and the weights moved."""
    from megatron.core import parallel_state as mpu

    from verl.workers.actor.megatron_actor import MegatronPPOActor

    dp = mpu.get_data_parallel_world_size()
    params = [p for chunk in chunks for p in chunk.parameters()]
    actor = MegatronPPOActor(
        _actor_config(ppo_mini_batch_size=4 // dp), chunks, hf_model.config, torch.optim.SGD(params, lr=LR)
    )
    mine = torch.tensor([0, 1, 4, 5] if mpu.get_data_parallel_rank() == 0 else [2, 3, 6, 7])
    got_metrics = actor.update_policy(data.select_idxs(mine) if dp == 2 else copy.deepcopy(data))
    assert sorted(got_metrics) == sorted(want_metrics)
    assert_metrics_close(got_metrics, want_metrics, ["actor/grad_norm"])
    want = reference_model.state_dict()
    start = hf_model.state_dict()
    moved = 0.0
    for name, tensor in _gathered_weights(chunks, hf_model.config).items():
        torch.testing.assert_close(tensor, want[name], atol=1e-5, rtol=0, msg=name)
        if name.endswith("e_score_correction_bias"):
            assert torch.equal(tensor, start[name]), f"{name} moved: the bias is not trained online"
        moved = max(moved, float((want[name] - start[name]).abs().max()))
    assert moved > 1e-3, "the update should move the weights"


@pytest.mark.parametrize("ep,tp", [(1, 1), (2, 1), (1, 2)])
def test_megatron_deepseek_v3_update_on_two_ranks_equals_the_fsdp_update_on_the_whole_batch(ep, tp):
    run_distributed(_against_fsdp_actor, 2, ep, tp)


@pytest.mark.parametrize(
    "ep,split",
    [
        (1, "first=1"),
        (1, "last=1"),
        pytest.param(2, "first=1", marks=pytest.mark.slow),  # four ranks (pp=2 x ep=2): the slow tier
    ],
)
def test_megatron_deepseek_v3_update_at_pp2_equals_the_fsdp_update(ep, split):
    run_distributed(_against_fsdp_actor, 2 * ep, ep, 1, 2, split)


def test_megatron_deepseek_v3_update_at_cp2_equals_the_fsdp_update():
    """Each rank holds half of every row; the latent attention's gathered keys/values carry the
    other rank's share of the gradient back (one reduce-scatter per layer)."""
    run_distributed(_against_fsdp_actor, 2, 1, 1, 1, None, 2)
