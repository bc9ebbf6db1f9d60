"""The megatron actor computes what the FSDP actor computes on the plain HF model: the same
log-probs and entropies, and one PPO update gives the same losses, gradient norms and weights, at
tp=1, tp=2, pp=2 and cp=2 and their combinations (so those equal each other too)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed_helpers import make_ppo_batch, run_distributed
from tests.megatron_helpers import assert_metrics_close, build_loaded_chunks, tiny_hf_model
from verl.protocol import DataProto
from verl.workers.actor.dp_actor import DataParallelPPOActor

TEMPERATURE = 0.7
LR = 0.5


def _actor_config(**overrides) -> dict:
    config = {
        "ppo_mini_batch_size": 4,
        "ppo_micro_batch_size_per_gpu": 2,
        "ppo_epochs": 1,
        "clip_ratio": 0.2,
        "loss_agg_mode": "token-mean",
        "policy_loss": {"loss_mode": "vanilla"},
        "entropy_coeff": 0.01,
        "use_kl_loss": True,
        "kl_loss_coef": 0.1,
        "kl_loss_type": "low_var_kl",
    }
    config.update(overrides)
    return config


def _training_data(hf_model) -> DataProto:
    """8 rows, old/ref log-probs near the model's own (so the ratio clips sometimes), random advantages."""
    td = make_ppo_batch(batch_size=8, prompt_length=6, response_length=5, seed=1)
    scorer = DataParallelPPOActor(_actor_config(), hf_model)
    meta = {"temperature": TEMPERATURE, "micro_batch_size": 4}
    log_probs, _ = scorer.compute_log_prob(DataProto.from_dict(tensors=dict(td.items()), meta_info=meta))
    g = torch.Generator().manual_seed(2)
    td["old_log_probs"] = log_probs + 0.3 * torch.randn(log_probs.shape, generator=g)
    td["ref_log_prob"] = log_probs + 0.1 * torch.randn(log_probs.shape, generator=g)
    td["advantages"] = torch.randn(log_probs.shape, generator=g) * td["response_mask"]
    return DataProto.from_dict(tensors=dict(td.items()), meta_info={"temperature": TEMPERATURE})


def _gathered_weights(chunks, hf_config) -> dict[str, torch.Tensor]:
    from verl.models.mcore import mcore_to_hf_named_tensors

    return dict(mcore_to_hf_named_tensors(chunks, hf_config))


def _check_against_fsdp_actor(
    rank, world_size, tp, pp, architecture, tie, vpp=None, micro=2, cp=1, sp=False, tf_overrides=None
):
    from verl.workers.actor.megatron_actor import MegatronPPOActor

    hf_model = tiny_hf_model(architecture, tie_word_embeddings=tie, num_layers=2 * pp * (vpp or 1))
    data = _training_data(hf_model)
    mask = data.batch["response_mask"].bool()

    # reference: the FSDP actor's code path on the plain HF model
    reference_model = copy.deepcopy(hf_model)
    reference = DataParallelPPOActor(
        _actor_config(ppo_micro_batch_size_per_gpu=micro),
        reference_model,
        torch.optim.SGD(reference_model.parameters(), lr=LR),
    )
    chunks = build_loaded_chunks(
        hf_model, tp=tp, pp=pp, vpp=vpp, cp=cp, sequence_parallel=sp, tf_overrides=tf_overrides
    )
    assert chunks[0].config.sequence_parallel == sp
    assert len(chunks) == (vpp or 1)
    params = [p for chunk in chunks for p in chunk.parameters()]
    actor = MegatronPPOActor(
        _actor_config(ppo_micro_batch_size_per_gpu=micro), chunks, hf_model.config, torch.optim.SGD(params, lr=LR)
    )

    if vpp:
        from verl.workers.actor.megatron_actor import _interleavable

        with pytest.raises(ValueError, match="needs at least pipeline_model_parallel_size=2 micro-batches"):
            _interleavable([data.batch[:1]], chunks)

    log_prob_data = copy.deepcopy(data)
    # one micro-batch of all 8 rows when the training micro-batch is the whole mini-batch: the
    # interleaved schedule then splits it (it needs one micro-batch per pipeline stage at least)
    log_prob_data.meta_info.update(micro_batch_size=3 if micro < 4 else 8)
    want_lp, want_ent = reference.compute_log_prob(log_prob_data, calculate_entropy=True)
    got_lp, got_ent = actor.compute_log_prob(log_prob_data, calculate_entropy=True)
    torch.testing.assert_close(got_lp[mask], want_lp[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(got_ent[mask], want_ent[mask], atol=1e-5, rtol=0)

    want_metrics = reference.update_policy(copy.deepcopy(data))
    got_metrics = actor.update_policy(copy.deepcopy(data))
    assert sorted(got_metrics) == sorted(want_metrics)
    assert len(got_metrics["actor/grad_norm"]) == 2  # two mini-batches, two optimizer steps
    # per-micro-batch metrics describe other micro-batches once the schedule has split them
    assert_metrics_close(got_metrics, want_metrics, None if micro < 4 else ["actor/grad_norm"])
    assert max(want_metrics["actor/pg_clipfrac"]) > 0, "the test data should exercise clipping"

    got = _gathered_weights(chunks, hf_model.config)
    want = reference_model.state_dict()
    moved = 0.0
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, want[name], atol=1e-5, rtol=0, msg=name)
        moved = max(moved, float((want[name] - hf_model.state_dict()[name]).abs().max()))
    assert moved > 1e-3, "the update should move the weights"


@pytest.mark.parametrize(
    "tp,pp,vpp,micro,architecture,tie,cp,sp",
    [
        (1, 1, None, 2, "qwen2", True, 1, False),
        (2, 1, None, 2, "qwen2", True, 1, False),
        (2, 1, None, 2, "llama", False, 1, False),
        (1, 2, None, 2, "qwen2", True, 1, False),
        # interleaved (virtual pipeline): each stage holds two chunks of layers
        (1, 2, 2, 2, "llama", False, 1, False),
        (1, 2, 2, 4, "qwen2", True, 1, False),  # one micro-batch per mini-batch: the schedule splits it
        # context parallel: each rank holds a quarter-and-quarter of every sequence
        (1, 1, None, 2, "qwen2", True, 2, False),
        pytest.param(*(2, 1, None, 2, "llama", False, 2, False), marks=pytest.mark.slow),  # four ranks: the slow tier
        pytest.param(*(1, 2, None, 2, "qwen2", True, 2, False), marks=pytest.mark.slow),  # four ranks: the slow tier
        # sequence parallel: outside attention and MLP each tensor-parallel rank holds half the tokens
        (2, 1, None, 2, "qwen2", True, 1, True),
        pytest.param(*(2, 1, None, 2, "llama", False, 2, True), marks=pytest.mark.slow),  # four ranks: the slow tier
    ],
)
def test_megatron_actor_matches_fsdp_actor(tp, pp, vpp, micro, architecture, tie, cp, sp):
    run_distributed(_check_against_fsdp_actor, tp * pp * cp, tp, pp, architecture, tie, vpp, micro, cp, sp)


def _data_parallel_against_fsdp_actor(rank, world_size):
    """dp=2 (tp=1, pp=1): each rank trains its half of every mini-batch; the gradients averaged over
    the data-parallel group give the single-process update on the whole batch."""
    from verl.workers.actor.megatron_actor import MegatronPPOActor

    hf_model = tiny_hf_model("qwen2")
    data = _training_data(hf_model)
    reference_model = copy.deepcopy(hf_model)
    reference = DataParallelPPOActor(
        _actor_config(ppo_mini_batch_size=4), reference_model, torch.optim.SGD(reference_model.parameters(), lr=LR)
    )
    want_metrics = reference.update_policy(copy.deepcopy(data))

    chunks = build_loaded_chunks(hf_model, tp=1, pp=1)
    from megatron.core import parallel_state as mpu

    assert mpu.get_data_parallel_world_size() == 2
    params = [p for chunk in chunks for p in chunk.parameters()]
    actor = MegatronPPOActor(
        _actor_config(ppo_mini_batch_size=2), chunks, hf_model.config, torch.optim.SGD(params, lr=LR)
    )
    # reference mini-batches are rows 0-3 and 4-7; each rank holds half of each
    mine = torch.tensor([0, 1, 4, 5] if rank == 0 else [2, 3, 6, 7])
    got_metrics = actor.update_policy(data.select_idxs(mine))
    torch.testing.assert_close(
        torch.tensor(got_metrics["actor/grad_norm"], dtype=torch.float64),
        torch.tensor(want_metrics["actor/grad_norm"], dtype=torch.float64),
        atol=1e-5,
        rtol=1e-5,
    )
    want = reference_model.state_dict()
    for name, tensor in _gathered_weights(chunks, hf_model.config).items():
        torch.testing.assert_close(tensor, want[name], atol=1e-5, rtol=0, msg=name)


def test_megatron_data_parallel_update_equals_the_single_process_update_on_the_whole_batch():
    run_distributed(_data_parallel_against_fsdp_actor, 2)


def _dynamic_batch_at_cp2(rank, world_size):
    """use_dynamic_bsz at cp=2: ppo_max_token_len_per_gpu counts tokens per rank, and each rank holds
    half of every sequence, so the megatron actor's micro-batches are the FSDP actor's at twice the
    budget: the same per-micro-batch metrics, in the same number."""
    from verl.workers.actor.megatron_actor import MegatronPPOActor

    hf_model = tiny_hf_model("qwen2")
    data = _training_data(hf_model)
    budget = 12  # rows hold up to 11 tokens: 2 rows per micro-batch at 24
    reference_model = copy.deepcopy(hf_model)
    reference = DataParallelPPOActor(
        _actor_config(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=2 * budget),
        reference_model,
        torch.optim.SGD(reference_model.parameters(), lr=LR),
    )
    want = reference.update_policy(copy.deepcopy(data))
    chunks = build_loaded_chunks(hf_model, cp=2)
    params = [p for chunk in chunks for p in chunk.parameters()]
    actor = MegatronPPOActor(
        _actor_config(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=budget),
        chunks,
        hf_model.config,
        torch.optim.SGD(params, lr=LR),
    )
    got = actor.update_policy(copy.deepcopy(data))
    assert len(want["actor/pg_loss"]) > 2, "the budget should split each mini-batch"
    assert_metrics_close(got, want, same_length=True)


def test_megatron_dynamic_batch_budget_is_per_rank_under_context_parallelism():
    run_distributed(_dynamic_batch_at_cp2, 2)


@pytest.mark.parametrize(
    "recompute",
    [
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
        {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
    ],
    ids=["full", "selective"],
)
def test_megatron_actor_with_activation_recompute_matches_fsdp_actor(recompute):
    """megatron.override_transformer_config's activation recomputation (as upstream users set it)
    changes memory, not the update: tp=2 with it equals the FSDP actor."""
    run_distributed(_check_against_fsdp_actor, 2, 2, 1, "qwen2", True, None, 2, 1, False, recompute)
