"""Plain data-parallel replicas (`replicate_over_ranks`): small models train without FSDP2.

On 2 gloo ranks, a PPO update of replicas equals the single-process update on the whole batch;
gradients missing on one rank count as zero; replica checkpoints load into an FSDP2-sharded model
(and back) exactly; the worker picks replicas only where FSDP2 would not change the computation.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

from tests.distributed_helpers import make_ppo_batch, make_tiny_causal_lm, one_thread, run_distributed
from tests.workers.actor.test_dp_actor import _with_zero_rows, training_batch
from verl.protocol import DataProto
from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
from verl.utils.fsdp_utils import apply_fsdp2, iter_full_params
from verl.workers.actor import DataParallelPPOActor
from verl.workers.config import FSDPEngineConfig
from verl.workers.dp_training import (
    average_gradients,
    average_replica_gradients,
    dp_group_and_size,
    replicate_over_ranks,
)

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

TEMPERATURE = 0.9


def ppo_data(seed: int, batch_size: int = 6) -> DataProto:
    batch = make_ppo_batch(batch_size=batch_size, seed=seed, response_lengths=[5, 2, 4, 1, 3, 5][:batch_size])
    g = torch.Generator().manual_seed(seed)
    mask = batch["response_mask"].double()
    batch["old_log_probs"] = -torch.rand(batch["responses"].shape, generator=g, dtype=torch.float64) * mask
    batch["advantages"] = torch.randn(batch_size, 1, generator=g, dtype=torch.float64) * mask
    return DataProto(batch=batch, meta_info={"temperature": TEMPERATURE})


def actor_config(mini_batch_size: int) -> dict:
    return {
        "ppo_mini_batch_size": mini_batch_size,
        "ppo_micro_batch_size_per_gpu": 2,
        "ppo_epochs": 1,
        "grad_clip": 1.0,
        "clip_ratio": 0.2,
        "loss_agg_mode": "token-mean",
        "entropy_coeff": 0.0,
    }


def _replica_update(rank, world_size):
    model = replicate_over_ranks(make_tiny_causal_lm())
    assert dp_group_and_size(model) == (None, 2)
    parts = [ppo_data(seed=0), ppo_data(seed=1)]
    actor = DataParallelPPOActor(actor_config(6), model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    metrics = actor.update_policy(parts[rank])

    single = make_tiny_causal_lm()
    reference = DataParallelPPOActor(actor_config(12), single, torch.optim.AdamW(single.parameters(), lr=1e-2))
    expected = reference.update_policy(DataProto.concat(parts))
    # the gradient norm is the one of the whole batch's gradient, on both ranks
    assert metrics["actor/grad_norm"] == pytest.approx(expected["actor/grad_norm"], rel=1e-9)
    for name, tensor in single.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor, atol=1e-12, rtol=1e-10, msg=name)


def test_replica_update_on_two_ranks_equals_the_single_process_update():
    run_distributed(_replica_update, 2)


def _missing_gradients(rank, world_size):
    model = replicate_over_ranks(torch.nn.Linear(2, 3).double())
    if rank == 1:  # rank 0 never used the model: no .grad at all
        model.weight.grad = torch.full((3, 2), 4.0, dtype=torch.float64)
        model.bias.grad = torch.tensor([2.0, 4.0, 6.0], dtype=torch.float64)
    average_replica_gradients(model)
    assert torch.equal(model.weight.grad, torch.full((3, 2), 2.0, dtype=torch.float64))
    assert torch.equal(model.bias.grad, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))


def test_gradients_missing_on_one_rank_count_as_zero():
    run_distributed(_missing_gradients, 2)


def _train_one_step(model, optimizer, seed):
    batch = make_ppo_batch(batch_size=4, seed=seed)
    model(input_ids=batch["input_ids"], use_cache=False).logits.square().mean().backward()
    average_replica_gradients(model)
    optimizer.step()
    optimizer.zero_grad()


def _full_state(model, optimizer):
    params = {name: tensor.clone() for name, tensor in iter_full_params(model)}
    moments = {}
    for name, param in model.named_parameters():
        for key, value in optimizer.state[param].items():
            moments[name, key] = value.full_tensor() if hasattr(value, "full_tensor") else value.clone()
    return params, moments


def _replica_checkpoint_loads_sharded(rank, world_size, root):
    replica = replicate_over_ranks(make_tiny_causal_lm())
    optimizer = torch.optim.AdamW(replica.parameters(), lr=1e-2)
    _train_one_step(replica, optimizer, seed=rank)
    path = os.path.join(root, "global_step_1", "actor")
    FSDPCheckpointManager(
        replica, optimizer, checkpoint_config={"save_contents": ["model", "optimizer", "hf_model"]}
    ).save_checkpoint(path, global_step=1)
    saved = _full_state(replica, optimizer)
    if rank == 0:
        torch.save(saved[0], os.path.join(root, "saved_params.pt"))
    # both ranks hold the same replica after the averaged step
    gathered = [None, None]
    dist.all_gather_object(gathered, saved[0]["model.embed_tokens.weight"])
    assert torch.equal(gathered[0], gathered[1])

    sharded = apply_fsdp2(make_tiny_causal_lm(seed=1))
    sharded_optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    _train_one_step(sharded, sharded_optimizer, seed=5)  # state to overwrite
    FSDPCheckpointManager(
        sharded, sharded_optimizer, checkpoint_config={"load_contents": ["model", "optimizer"]}
    ).load_checkpoint(path)
    loaded = _full_state(sharded, sharded_optimizer)
    assert saved[0].keys() == loaded[0].keys() and saved[1].keys() == loaded[1].keys()
    for key in saved[0]:
        assert torch.equal(saved[0][key], loaded[0][key]), key
    for key in saved[1]:
        assert torch.equal(saved[1][key], loaded[1][key]), key

    # and back: the sharded model's next checkpoint loads into fresh replicas
    _train_one_step(sharded, sharded_optimizer, seed=6)
    path2 = os.path.join(root, "global_step_2", "actor")
    FSDPCheckpointManager(
        sharded, sharded_optimizer, checkpoint_config={"save_contents": ["model", "optimizer"]}
    ).save_checkpoint(path2, global_step=2)
    expected = _full_state(sharded, sharded_optimizer)
    fresh = replicate_over_ranks(make_tiny_causal_lm(seed=2))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    _train_one_step(fresh, fresh_optimizer, seed=7)
    FSDPCheckpointManager(
        fresh, fresh_optimizer, checkpoint_config={"load_contents": ["model", "optimizer"]}
    ).load_checkpoint(path2)
    reloaded = _full_state(fresh, fresh_optimizer)
    for key in expected[0]:
        assert torch.equal(expected[0][key], reloaded[0][key]), key
    for key in expected[1]:
        assert torch.equal(expected[1][key], reloaded[1][key]), key


def test_replica_checkpoints_load_into_sharded_models_and_back(tmp_path):
    from transformers import AutoModelForCausalLM

    run_distributed(_replica_checkpoint_loads_sharded, 2, str(tmp_path))
    # the HF export of the replicas is the trained model
    exported = AutoModelForCausalLM.from_pretrained(
        tmp_path / "global_step_1" / "actor" / "huggingface", dtype=torch.float64
    )
    saved = torch.load(tmp_path / "saved_params.pt")
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, saved[name]), name


def test_the_worker_replicates_only_small_models_whose_computation_fsdp_would_not_change():
    from verl.workers.engine.fsdp.transformer_impl import trains_as_plain_replicas

    model = make_tiny_causal_lm(dtype=torch.float32)
    auto = {"dtype": "auto"}  # compute in the weights' own dtype on CPU (arith_demo's setting)
    assert trains_as_plain_replicas({"fsdp_size": -1, **auto}, model)
    assert trains_as_plain_replicas(FSDPEngineConfig(dtype="auto"), model)
    # upstream's default compute dtype (bfloat16) casts an fp32 model: FSDP2 keeps it
    assert not trains_as_plain_replicas(None, model)
    # an explicit layout, FSDP's CPU offload or a mixed-precision cast keep FSDP2
    assert not trains_as_plain_replicas({"fsdp_size": 1, **auto}, model)
    assert not trains_as_plain_replicas({"fsdp_size": -1, "offload_policy": True, **auto}, model)
    assert not trains_as_plain_replicas({"mixed_precision": {"param_dtype": "bf16"}}, model)
    assert trains_as_plain_replicas({"mixed_precision": {"param_dtype": "fp32"}}, model)
    big = copy.deepcopy(model)
    big.extra = torch.nn.Linear(4000, 4000)  # 16M parameters: sharded
    assert not trains_as_plain_replicas(auto, big)


def _bucketed_average(rank, world_size):
    # three float64 tensors of 4, 6 and 3 elements and one float32: with 48-byte buckets (6 float64)
    # the float64 gradients go out as [4], [6], [3] and the float32 one alone
    params = [torch.nn.Parameter(torch.zeros(n, dtype=torch.float64)) for n in (4, 6, 3)]
    params.append(torch.nn.Parameter(torch.zeros(5, dtype=torch.float32)))
    for i, p in enumerate(params):
        p.grad = torch.arange(p.numel(), dtype=p.dtype) * (rank + 1) + 10 * i
    params[1].grad = None if rank == 0 else params[1].grad  # missing on rank 0: counts as zero
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        average_gradients(params, None, 2, bucket_bytes=48)
    finally:
        dist.all_reduce = real_all_reduce
    assert calls == [4, 6, 3, 5]
    for i, p in enumerate(params):
        base = torch.arange(p.numel(), dtype=p.dtype)
        # mean over ranks of base * (rank + 1) + 10 i, with rank 0's missing gradient as zero
        want = (base * 2 + 10 * i) / 2 if i == 1 else (base * 1 + base * 2 + 20 * i) / 2
        assert torch.equal(p.grad, want.to(p.dtype)), i


def test_gradients_are_averaged_in_size_bounded_buckets():
    run_distributed(_bucketed_average, 2)


class _CountingAllReduce:
    """Counts `dist.all_reduce` calls (their element counts) while active; the real call still runs."""

    def __init__(self):
        self.numels: list[int] = []
        self._real = dist.all_reduce

    def __enter__(self):
        def counting(tensor, *args, **kwargs):
            self.numels.append(tensor.numel())
            return self._real(tensor, *args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._real


def _replica_zero_rows(rank, world_size):
    # rank 0 holds 3 rows to train, rank 1 one: both run 2 micro-batches of at most 2 rows, and the
    # update equals the single-process one over all 8 rows with every row trained
    data = _with_zero_rows(training_batch(batch_size=8, seed=10), zero_rows=(1, 4, 5, 6))
    local = data.select_idxs(torch.arange(rank * 4, (rank + 1) * 4))
    model = replicate_over_ranks(make_tiny_causal_lm())
    config = {**actor_config(4), "ppo_micro_batch_size_per_gpu": 2}
    actor = DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=1.0))
    real_all_gather = dist.all_gather
    gathers = []

    def counting_all_gather(tensors, tensor, *args, **kwargs):
        gathers.append(tensor.numel())
        return real_all_gather(tensors, tensor, *args, **kwargs)

    dist.all_gather = counting_all_gather
    try:
        with _CountingAllReduce() as reduces:
            metrics = actor.update_policy(local)
    finally:
        dist.all_gather = real_all_gather
    # the loss normaliser, the ranks with an advantage and the micro-batch count: one collective;
    # besides it only the gradient buckets (no small all-reduce)
    assert gathers == [3]
    assert min(reduces.numels) > 3, reduces.numels
    assert metrics["actor/zero_adv_rows_skipped"] == [0.25 if rank == 0 else 0.5]
    single = make_tiny_causal_lm()
    reference = DataParallelPPOActor(
        {**actor_config(8), "ppo_micro_batch_size_per_gpu": 8, "skip_zero_advantage_rows": False},
        single,
        torch.optim.SGD(single.parameters(), lr=1.0),
    )
    reference.update_policy(data)
    for name, tensor in single.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor, atol=1e-11, rtol=1e-9, msg=name)


def test_replicas_agree_on_the_normaliser_and_micro_batch_count_in_one_collective():
    run_distributed(_replica_zero_rows, 2)
