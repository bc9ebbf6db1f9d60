"""The megatron actor trains a Qwen3-MoE model as the FSDP actor does, with the router
load-balancing loss on: at ep=1, with the experts split over 2 expert-parallel ranks (tokens
dispatched by megatron's all-to-all over gloo), at tp=2, and with the layers on 2 pipeline stages
or the sequences over 2 context-parallel ranks (the loss's statistics summed over them, see
`verl.models.mcore.moe`), one PPO update on 2 ranks gives the single-process FSDP update on the
whole batch (losses, `actor/load_balancing_loss`, gradient norms, weights)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed_helpers import run_distributed
from tests.megatron_helpers import assert_metrics_close, build_loaded_chunks, tiny_moe_hf_model
from tests.workers.actor.test_megatron_actor import LR, _actor_config, _gathered_weights, _training_data
from verl.workers.actor.dp_actor import DataParallelPPOActor

COEF = 0.1  # large, so the load-balancing gradient shows in the weights


def _moe_model(num_layers: int = 2):
    model = tiny_moe_hf_model(num_layers=num_layers)
    model.config.output_router_logits = True
    model.config.router_aux_loss_coef = COEF
    return model


def fsdp_reference_update(hf_model, data):
    """(the updated copy of `hf_model`, its metrics): the single-process FSDP actor's update of the whole
    batch in one mini-batch, with SGD, that the megatron layouts must equal."""
    reference_model = copy.deepcopy(hf_model)
    reference = DataParallelPPOActor(
        _actor_config(ppo_mini_batch_size=4, use_remove_padding=True, share_prompt_forward=False),
        reference_model,
        torch.optim.SGD(reference_model.parameters(), lr=LR),
    )
    return reference_model, reference.update_policy(copy.deepcopy(data))


def _ep_against_fsdp_actor(
    rank, world_size, ep, aux, tp=1, pp=1, cp=1, vpp=None, stage_local=False, etp=None, zero=False
):
    """`stage_local`: the statistics are not summed over the pipeline x context ranks (each rank's loss
    from its own layers and tokens), which the comparison must catch. `zero`: SGD as the distributed
    optimizer builds it (`build_optimizer` split over `optimizer_state_shard_group`)."""
    from megatron.core import parallel_state as mpu

    from verl.models.mcore import moe
    from verl.workers.actor.megatron_actor import MegatronPPOActor

    hf_model = _moe_model(num_layers=2 * pp * (vpp or 1))
    data = _training_data(hf_model)  # its scorer (an FSDP actor) takes the flag over: set it again
    hf_model.config.output_router_logits = aux
    reference_model, want_metrics = fsdp_reference_update(hf_model, data)

    chunks = build_loaded_chunks(hf_model, ep=ep, etp=etp, tp=tp, pp=pp, cp=cp, vpp=vpp, sequence_parallel=tp > 1)
    dp = mpu.get_data_parallel_world_size()
    assert dp == world_size // (tp * pp * cp)
    assert mpu.get_expert_model_parallel_world_size() == ep
    assert len(chunks[0].decoder.layers[0].mlp.experts.local_experts) == 4 // ep
    params = [p for chunk in chunks for p in chunk.parameters()]
    if zero:
        from verl.utils.optim import build_optimizer

        sgd = {"optimizer": "sgd", "lr": LR, "weight_decay": 0.0}
        optimizer = build_optimizer(params, sgd, shard_state_over=moe.optimizer_state_shard_group())
    else:
        optimizer = torch.optim.SGD(params, lr=LR)
    actor = MegatronPPOActor(_actor_config(ppo_mini_batch_size=4 // dp), chunks, hf_model.config, optimizer)
    if stage_local:
        exchange = moe._RouterStats.exchange
        moe._RouterStats.exchange = lambda stats, group: exchange(stats, None)
        try:
            with pytest.raises(AssertionError):
                _update_and_compare(actor, chunks, hf_model, data, want_metrics, reference_model, dp, aux)
        finally:
            moe._RouterStats.exchange = exchange
        return
    _update_and_compare(actor, chunks, hf_model, data, want_metrics, reference_model, dp, aux)


def _update_and_compare(actor, chunks, hf_model, data, want_metrics, reference_model, dp, aux):
    from megatron.core import parallel_state as mpu

    # the reference's mini-batches are rows 0-3 and 4-7, its micro-batches pairs: at dp=2 each rank
    # holds one pair of each mini-batch, so both compute the load-balancing loss over the same
    # micro-batches (at dp=1, tp=2: both ranks train on the whole batch, as the reference does; at
    # dp=4 each rank one row of each, micro-batches the reference does not have: no load-balancing loss)
    assert dp in (1, 2) or not aux
    share, dp_rank = 4 // dp, mpu.get_data_parallel_rank()
    mine = torch.tensor([first + dp_rank * share + i for first in (0, 4) for i in range(share)])
    got_metrics = actor.update_policy(data.select_idxs(mine) if dp > 1 else copy.deepcopy(data))
    assert ("actor/load_balancing_loss" in got_metrics) == aux
    assert sorted(got_metrics) == sorted(want_metrics)
    assert_metrics_close(got_metrics, want_metrics, ["actor/grad_norm"])
    if aux:  # this rank's micro-batches are the reference's 1st and 3rd (dp rank 0) or 2nd and 4th
        want_lb = want_metrics["actor/load_balancing_loss"][mpu.get_data_parallel_rank() :: dp]
        torch.testing.assert_close(
            torch.tensor(got_metrics["actor/load_balancing_loss"], dtype=torch.float64),
            torch.tensor(want_lb, dtype=torch.float64),
            atol=1e-6,
            rtol=1e-6,
        )
    want = reference_model.state_dict()
    start = hf_model.state_dict()
    moved = 0.0
    for name, tensor in _gathered_weights(chunks, hf_model.config).items():
        torch.testing.assert_close(tensor, want[name], atol=1e-5, rtol=0, msg=name)
        moved = max(moved, float((want[name] - start[name]).abs().max()))
    assert moved > 1e-3, "the update should move the weights"


@pytest.mark.parametrize(
    "ep,aux,tp",
    [
        (1, True, 1),
        (2, True, 1),
        (2, False, 1),
        # tp=2 with sequence parallelism: the per-head q/k norms' and the router's gradients are summed
        # over the tensor ranks, and the load-balancing loss gathers the router logits of both halves
        (1, True, 2),
    ],
)
def test_megatron_moe_update_on_two_ranks_equals_the_fsdp_update_on_the_whole_batch(ep, aux, tp):
    run_distributed(_ep_against_fsdp_actor, 2, ep, aux, tp)


@pytest.mark.parametrize(
    "pp,cp,vpp",
    [
        (2, 1, None),  # one layer a stage: the loss couples the two stages' routers
        (1, 2, None),  # each rank routes two of the four chunks of every sequence, padding masked
    ],
)
def test_megatron_moe_load_balancing_loss_over_pipeline_or_context_ranks_equals_the_fsdp_update(pp, cp, vpp):
    run_distributed(_ep_against_fsdp_actor, pp * cp, 1, True, 1, pp, cp, vpp)


@pytest.mark.slow
@pytest.mark.parametrize(
    "pp,cp,vpp,ep,tp",
    [
        (2, 1, 2, 1, 1),  # interleaved: two chunks of one layer on each stage
        (2, 2, None, 1, 1),  # four ranks: statistics summed over both stages and both context ranks
        (2, 1, None, 2, 1),  # four ranks: pp=2 x dp=2, the experts split over the data-parallel pair
        (2, 1, None, 1, 2),  # four ranks: pp=2 x tp=2 with sequence parallelism (logits gathered first)
    ],
)
def test_megatron_moe_load_balancing_loss_on_pipeline_layouts_equals_the_fsdp_update_slow(pp, cp, vpp, ep, tp):
    world = pp * cp * tp * (2 if ep > 1 else 1)
    run_distributed(_ep_against_fsdp_actor, world, ep, True, tp, pp, cp, vpp)


@pytest.mark.parametrize("pp,cp", [(2, 1), (1, 2)])
def test_stage_local_load_balancing_statistics_fail_the_comparison(pp, cp):
    """The comparison above is sensitive: each rank's loss from its own layers (pp) or tokens (cp)
    alone, the statistics not summed, gives another metric and other weights."""
    run_distributed(_ep_against_fsdp_actor, pp * cp, 1, True, 1, pp, cp, None, True)


def _recomputing_the_routers_is_refused(rank, world_size, overrides):
    from verl.workers.actor.megatron_actor import MegatronPPOActor

    hf_model = _moe_model()
    chunks = build_loaded_chunks(hf_model, tf_overrides=overrides)
    params = [p for chunk in chunks for p in chunk.parameters()]
    with pytest.raises(ValueError, match="recomputation of the routers.*recompute_modules=\\[core_attn\\]"):
        MegatronPPOActor(_actor_config(), chunks, hf_model.config, torch.optim.SGD(params, lr=LR))


@pytest.mark.parametrize(
    "overrides",
    [
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
        {"recompute_granularity": "selective", "recompute_modules": ["moe"]},
    ],
)
def test_the_load_balancing_loss_refuses_recomputing_the_routers(overrides):
    run_distributed(_recomputing_the_routers_is_refused, 1, overrides)


@pytest.mark.slow  # 4 CPU ranks
def test_megatron_moe_update_at_ep2_etp2_tp2_on_four_ranks_equals_the_fsdp_update_on_the_whole_batch():
    """tp=2 x dp=2 with the experts over 2 expert-parallel ranks and each expert's MLP over 2
    expert-tensor ranks: the token dispatcher's uneven gather and reduce-scatter over the
    expert-tensor group run on gloo (forward and backward), and the update equals ep=1, etp=1."""
    run_distributed(_ep_against_fsdp_actor, 4, 2, True, 2)


@pytest.mark.parametrize(
    "world,ep,aux,zero",
    [
        # tp=1, etp=2 on 2 ranks (about 1.5 s): the dense layers whole on both data-parallel ranks, each expert's MLP
        # split over them (the expert-tensor group spans the data-parallel ranks, each with its own rows)
        (2, 1, True, False),
        # ... with the distributed optimizer: split over the data-parallel group, it broadcast the owner's
        # expert half over the other rank's after the step (issue #27)
        (2, 1, True, True),
        # ... and the experts over 2 expert-parallel ranks too (4 data-parallel ranks, one row of each
        # mini-batch each: micro-batches the reference does not have, so no load-balancing loss)
        pytest.param(4, 2, False, False, marks=pytest.mark.slow),  # 4 CPU ranks, about 3 s
    ],
    ids=["etp2", "etp2_zero", "etp2_ep2"],
)
def test_megatron_moe_update_with_experts_split_over_more_ranks_than_the_dense_layers_equals_the_fsdp_update(
    world, ep, aux, zero
):
    """tp=1 with expert_tensor_parallel_size=2 (issue #27): the update equals the single-process FSDP update."""
    run_distributed(_ep_against_fsdp_actor, world, ep, aux, 1, 1, 1, None, False, 2, zero)


def _frozen_routers_against_fsdp(rank, world_size, ep):
    """`freeze_moe_router` (upstream's override_mcore_model_config.moe_config option): with the
    load-balancing loss on (whose gradient enters at the routers), the update equals the FSDP
    update of the same model with every `mlp.gate` frozen, and the routers keep their weights."""
    from megatron.core import parallel_state as mpu

    from verl.models.mcore.moe import freeze_routers
    from verl.workers.actor.megatron_actor import MegatronPPOActor

    hf_model = _moe_model()
    data = _training_data(hf_model)
    hf_model.config.output_router_logits = True
    start = {k: v.clone() for k, v in hf_model.state_dict().items()}
    for layer in hf_model.model.layers:
        layer.mlp.gate.weight.requires_grad_(False)
    reference_model, want_metrics = fsdp_reference_update(hf_model, data)

    chunks = build_loaded_chunks(hf_model, ep=ep)
    assert freeze_routers(chunks) == 2
    dp = mpu.get_data_parallel_world_size()
    params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
    actor = MegatronPPOActor(
        _actor_config(ppo_mini_batch_size=4 // dp), chunks, hf_model.config, torch.optim.SGD(params, lr=LR)
    )
    _update_and_compare(actor, chunks, hf_model, data, want_metrics, reference_model, dp, True)
    gates = {k: v for k, v in _gathered_weights(chunks, hf_model.config).items() if k.endswith("mlp.gate.weight")}
    assert len(gates) == 2 and all(torch.equal(v, start[k]) for k, v in gates.items())


@pytest.mark.slow  # one PPO update on 2 ranks plus the FSDP reference
def test_frozen_moe_routers_keep_their_weights_and_the_update_equals_fsdp_with_frozen_gates():
    run_distributed(_frozen_routers_against_fsdp, 2, 2)
