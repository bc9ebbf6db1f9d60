"""The FSDP actor worker with Ulysses sp=2 (dp=1) against sp=1 (dp=2) on 2 gloo ranks, called
directly without Ray, each rank with the chunk DP_COMPUTE_PROTO would send it: log-probs equal and
one update gives the same gradient norm and weights. fp32 (the worker's CPU dtype): the
tolerances allow summation-order differences over a 2-layer model."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_helpers import make_ppo_batch, run_distributed
from verl.models import bundled_model_path
from verl.protocol import DataProto
from verl.trainer.config import load_ppo_config


def _batch() -> DataProto:
    td = make_ppo_batch(batch_size=8, prompt_length=6, response_length=5, seed=3)
    g = torch.Generator().manual_seed(4)
    td["advantages"] = torch.randn(td["responses"].shape, generator=g) * td["response_mask"]
    return DataProto.from_dict(tensors=dict(td.items()), meta_info={"temperature": 1.0})


def _worker_case(rank, world_size, sp, out_path, save_to=None, load_from=None):
    from verl.utils.fsdp_utils import iter_full_params
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    cfg = load_ppo_config(
        [
            f"actor_rollout_ref.model.path={bundled_model_path()}",
            "trainer.n_gpus_per_node=2",
            "data.train_batch_size=8",
            "actor_rollout_ref.rollout.n=1",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32",
            "actor_rollout_ref.model.use_remove_padding=true",
            f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}",
            "actor_rollout_ref.actor.optim.lr=1e-3",
        ],
        config_name="arith_demo",
    )
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor")
    worker.init_model()
    if load_from is not None:  # resume: the loaded weights are those the other layout saved
        worker.load_checkpoint(load_from)
        weights = {name: t.detach().clone() for name, t in iter_full_params(worker.actor.actor_module)}
        if rank == 0:
            torch.save(weights, f"{out_path}.{rank}")
        return
    assert worker.dp_size == world_size // sp
    chunk = _batch().chunk(world_size)[rank]
    if rank == 0 and sp == 1:
        start = {name: t.detach().clone() for name, t in iter_full_params(worker.actor.actor_module)}
        torch.save(start, f"{out_path}.start")
    old = worker.compute_log_prob(chunk)
    chunk.batch["old_log_probs"] = old.batch["old_log_probs"]
    metrics = worker.update_actor(chunk).meta_info["metrics"]
    weights = {name: t.detach().clone() for name, t in iter_full_params(worker.actor.actor_module)}
    if save_to is not None:
        worker.save_checkpoint(save_to, global_step=1)
    if rank == 0 or sp == 1:
        torch.save(
            {
                "log_probs": old.batch["old_log_probs"],
                "weights": weights,
                "grad_norm": metrics["actor/grad_norm"],
                "flops": worker.actor.flops.total(),  # what perf/mfu/actor counts for this rank
            },
            f"{out_path}.{rank}",
        )


@pytest.mark.slow
def test_actor_worker_with_sp2_equals_sp1_and_its_checkpoint_resumes_at_sp1(tmp_path):
    run_distributed(_worker_case, 2, 1, str(tmp_path / "sp1"))
    run_distributed(_worker_case, 2, 2, str(tmp_path / "sp2"), str(tmp_path / "ckpt"))
    for rank in (0,):
        ref = torch.load(f"{tmp_path / 'sp1'}.{rank}")
        got = torch.load(f"{tmp_path / 'sp2'}.{rank}")
        # beyond a response's end the values are unspecified (the next packed row's token)
        mask = _batch().chunk(2)[rank].batch["response_mask"].bool()
        err = (got["log_probs"] - ref["log_probs"])[mask].abs().max().item()
        assert err < 1e-5, f"rank {rank}: sp=2 log-probs differ from sp=1 by {err:.3g}"
        diff = max((ref["weights"][n] - got["weights"][n]).abs().max().item() for n in ref["weights"])
        # AdamW's first step is lr * g / (|g| + eps): scale-free, and on near-zero gradients fp32
        # summation-order noise can move a weight by a fraction of lr; the gradient norm is the
        # exact check (a wrong sp gradient scale would show as a factor of 2 there)
        assert diff < 1e-4, f"sp=2 weights after one update differ from sp=1 by up to {diff:.3g} (lr 1e-3)"
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), (got["grad_norm"], ref["grad_norm"])
        start = torch.load(f"{tmp_path / 'sp1'}.start")
        moved = max((ref["weights"][n] - start[n]).abs().max().item() for n in start)
        assert moved > 1e-4, f"the update moved the weights by at most {moved:.3g}; the comparison needs a real step"
    # MFU at sp=2: each rank of the sequence-parallel group counts the rows of the whole group (the
    # rows it runs a slice of), and mfu_over_ranks divides by the sp ranks (dp_size = world / sp), so
    # the update's FLOPs are the two sp=1 data-parallel ranks' together, not twice them
    sp1 = [torch.load(f"{tmp_path / 'sp1'}.{rank}")["flops"] for rank in (0, 1)]
    sp2 = torch.load(f"{tmp_path / 'sp2'}.0")["flops"]
    assert min(sp1) > 0
    assert sp2 == pytest.approx(sum(sp1), rel=1e-12), (sp2, sp1)

    # a checkpoint saved at sp=2 resumes at sp=1 with the same weights
    run_distributed(_worker_case, 2, 1, str(tmp_path / "resumed"), None, str(tmp_path / "ckpt"))
    saved, resumed = torch.load(f"{tmp_path / 'sp2'}.0")["weights"], torch.load(f"{tmp_path / 'resumed'}.0")
    assert saved.keys() == resumed.keys()
    for name in saved:
        torch.testing.assert_close(resumed[name], saved[name], rtol=0, atol=0, msg=name)


def _critic_case(rank, world_size, sp, out_path, key="critic.ulysses_sequence_parallel_size"):
    from verl.workers.fsdp_workers import CriticWorker

    cfg = load_ppo_config(
        [
            f"actor_rollout_ref.model.path={bundled_model_path()}",
            f"critic.model.path={bundled_model_path()}",
            "algorithm.adv_estimator=gae",
            "trainer.n_gpus_per_node=2",
            "data.train_batch_size=8",
            "actor_rollout_ref.rollout.n=1",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "critic.ppo_mini_batch_size=8",
            "critic.ppo_micro_batch_size_per_gpu=4",
            "critic.model.use_remove_padding=true",
            f"{key}={sp}",
        ],
        config_name="arith_demo",
    )
    worker = CriticWorker(cfg.critic)
    worker.init_model()
    assert worker.dp_size == world_size // sp
    values = worker.compute_values(_batch().chunk(world_size)[rank]).batch["values"]
    torch.save(values, f"{out_path}.{rank}")


@pytest.mark.slow
@pytest.mark.parametrize(
    # upstream's newer spelling too: the worker's critic splits the sequences, the engine's own split stays off
    "key",
    [
        "critic.ulysses_sequence_parallel_size",
        "critic.fsdp.ulysses_sequence_parallel_size",
        "critic.model.fsdp_config.ulysses_sequence_parallel_size",  # upstream's spelling before v0.9
    ],
)
def test_critic_worker_values_with_sp2_equal_sp1(tmp_path, key):
    run_distributed(_critic_case, 2, 1, str(tmp_path / "sp1"))
    run_distributed(_critic_case, 2, 2, str(tmp_path / "sp2"), key)
    for rank in (0, 1):
        mask = _batch().chunk(2)[rank].batch["response_mask"].bool()
        ref, got = torch.load(f"{tmp_path / 'sp1'}.{rank}"), torch.load(f"{tmp_path / 'sp2'}.{rank}")
        err = (got - ref)[mask].abs().max().item()
        assert err < 1e-5, f"rank {rank}: sp=2 values differ from sp=1 by {err:.3g}"
        assert ref[mask].abs().max().item() > 1e-3, "the values must be non-trivial for the comparison to mean anything"
