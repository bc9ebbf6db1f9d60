"""Weights saved at tp=2 (or pp=2 with virtual pipeline) load bit-exactly at other layouts.

A megatron checkpoint resumes training exactly, also at another layout. Saved after one PPO update at
tp=2 (or pp=2 x vpp=2, cp=2, ZeRO), loaded at tp=1 x dp=2 and saved again from there, it loads back
at the saving layout, whose next update is bit for bit the one the uninterrupted run makes: the same
arithmetic in the same order, so any difference is the checkpoint's. The Adam moments and step count
travel with the weights (without them the next update differs, which the test also shows).

The update made at tp=1 x dp=2 itself sums the same products in another order. In float32 Adam
amplifies that rounding wherever a gradient nearly cancels: 1e-5 to 2e-4 measured, depending on which
vectorised CPU kernels (AVX-512, AVX2, scalar) ran, against 1e-3 for a lost Adam state, so no float32
tolerance separates them on every machine. The test therefore runs in float64 (see `CROSS_LAYOUT_ATOL`).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed_helpers import make_ppo_batch, run_distributed
from tests.megatron_helpers import build_loaded_chunks, hf_state_dict, tiny_hf_model
from verl.protocol import DataProto

OPTIM = {"lr": 0.02, "weight_decay": 0.01, "betas": [0.9, 0.99], "warmup_style": "constant", "total_training_steps": 4}


def _actor_config(mini_batch: int) -> dict:
    return {
        "ppo_mini_batch_size": mini_batch,
        "ppo_micro_batch_size_per_gpu": 2,
        "ppo_epochs": 1,
        "clip_ratio": 0.2,
        "loss_agg_mode": "token-mean",
        "policy_loss": {"loss_mode": "vanilla"},
    }


def _data(seed: int, dtype: torch.dtype = torch.float32) -> DataProto:
    td = make_ppo_batch(batch_size=8, prompt_length=6, response_length=5, seed=seed)
    g = torch.Generator().manual_seed(seed + 10)
    td["old_log_probs"] = (-3.0 + 0.2 * torch.randn(td["responses"].shape, generator=g)).to(dtype)
    td["advantages"] = (torch.randn(td["responses"].shape, generator=g) * td["response_mask"]).to(dtype)
    return DataProto.from_dict(tensors=dict(td.items()), meta_info={"temperature": 1.0})


def _trainer(hf_model, tp: int, mini_batch: int, pp: int = 1, vpp: int | None = None, zero: bool = False, cp: int = 1):
    """zero: the distributed optimizer (Adam state split over the data-parallel ranks). The chunks
    take the HF model's dtype."""
    from megatron.core import parallel_state as mpu

    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager
    from verl.utils.optim import build_lr_scheduler, build_optimizer
    from verl.workers.actor.megatron_actor import MegatronPPOActor

    chunks = build_loaded_chunks(hf_model, tp=tp, pp=pp, vpp=vpp, cp=cp, dtype=hf_model.dtype)
    shard_over = mpu.get_data_parallel_group() if zero else None
    optimizer = build_optimizer([p for c in chunks for p in c.parameters()], OPTIM, shard_state_over=shard_over)
    scheduler = build_lr_scheduler(optimizer, OPTIM)
    actor = MegatronPPOActor(_actor_config(mini_batch), chunks, hf_model.config, optimizer)
    manager = MegatronCheckpointManager(chunks, optimizer, scheduler, hf_config=hf_model.config)
    return chunks, actor, scheduler, manager


def _weights(chunks, hf_config) -> dict[str, torch.Tensor]:
    from verl.models.mcore import mcore_to_hf_named_tensors

    return {k: v.clone() for k, v in mcore_to_hf_named_tensors(chunks, hf_config)}


def _my_rows(data: DataProto, rank: int, dp: int) -> DataProto:
    return data.chunk(dp)[rank] if dp > 1 else data


# Float64 differences between the update at the saving layout and at tp=1 x dp=2 from the same loaded
# state, measured with AVX-512, AVX2 and scalar ATen kernels: at most 5e-13 (a key bias, whose exact
# gradient is zero, so Adam normalises rounding noise), 0 at dp=2 with ZeRO (the same arithmetic). They
# are the float32 differences scaled by the ratio of the unit roundoffs (2^-53 / 2^-24 = 2e-9), so
# rounding, not the checkpoint. 1e-9 leaves three orders of magnitude for other kernels and six below
# the 1e-3 a lost Adam state makes.
CROSS_LAYOUT_ATOL = 1e-9


def _resume_across_layouts(rank, world_size, ckpt_dir, layout):
    from megatron.core import parallel_state as mpu

    from verl.utils.megatron.parallel_state import destroy_model_parallel

    tp, pp, vpp, zero, cp = layout
    dp = world_size // (tp * pp * cp)
    hf_model = tiny_hf_model("qwen2", tie_word_embeddings=True, num_layers=4 if vpp else 2).double()
    first, second = _data(1, torch.float64), _data(2, torch.float64)
    # the saving layout splits the 8 rows over its dp ranks; tp=1 x dp=world gives each rank its share,
    # with the optimizer's state split over the ranks exactly when the saving run's was not
    saving = {"tp": tp, "pp": pp, "vpp": vpp, "cp": cp, "zero": zero, "mini_batch": 8 // dp}
    elsewhere = {"tp": 1, "zero": not zero, "mini_batch": 8 // world_size}
    saved, resaved = f"{ckpt_dir}/saved", f"{ckpt_dir}/resaved"

    def second_update(actor, dp_size: int) -> None:
        actor.update_policy(copy.deepcopy(_my_rows(second, mpu.get_data_parallel_rank(), dp_size)))

    # uninterrupted: two updates at the saving layout, saving after the first
    chunks, actor, scheduler, manager = _trainer(copy.deepcopy(hf_model), **saving)
    actor.update_policy(copy.deepcopy(_my_rows(first, mpu.get_data_parallel_rank(), dp)))
    scheduler.step()
    manager.save_checkpoint(saved, global_step=1)
    second_update(actor, dp)
    uninterrupted = _weights(chunks, hf_model.config)
    destroy_model_parallel()

    # resumed elsewhere (fresh model and optimizer, then the checkpoint): saves what it loaded, trains on
    chunks, actor, scheduler, manager = _trainer(copy.deepcopy(hf_model), **elsewhere)
    manager.load_checkpoint(saved)
    assert scheduler.last_epoch == 1
    manager.save_checkpoint(resaved, global_step=1)
    second_update(actor, world_size)
    resumed_elsewhere = _weights(chunks, hf_model.config)
    destroy_model_parallel()

    # back at the saving layout from the checkpoint written elsewhere
    chunks, actor, scheduler, manager = _trainer(copy.deepcopy(hf_model), **saving)
    manager.load_checkpoint(resaved)
    assert scheduler.last_epoch == 1
    second_update(actor, dp)
    resumed = _weights(chunks, hf_model.config)
    destroy_model_parallel()

    # control: the saved weights without the saved Adam state give another update
    chunks, actor, scheduler, manager = _trainer(copy.deepcopy(hf_model), **saving)
    manager.load_contents = ["model"]
    manager.load_checkpoint(saved)
    second_update(actor, dp)
    weights_only = _weights(chunks, hf_model.config)
    destroy_model_parallel()

    assert sorted(resumed) == sorted(resumed_elsewhere) == sorted(uninterrupted)
    for name, want in uninterrupted.items():
        assert torch.equal(resumed[name], want), (name, float((resumed[name] - want).abs().max()))
        torch.testing.assert_close(resumed_elsewhere[name], want, atol=CROSS_LAYOUT_ATOL, rtol=0, msg=name)
    gap = max(float((weights_only[n] - uninterrupted[n]).abs().max()) for n in uninterrupted)
    assert gap > 1e-3, f"the Adam state should change the resumed update (weights-only resume moved {gap:.2e})"


@pytest.mark.parametrize(
    "layout,world",
    [
        ((2, 1, None, False, 1), 2),  # the default tier's resume; the other layouts are the slow tier's
        pytest.param((1, 2, 2, False, 1), 2, marks=pytest.mark.slow),
        pytest.param((1, 1, None, True, 1), 2, marks=pytest.mark.slow),
        pytest.param((1, 1, None, False, 2), 2, marks=pytest.mark.slow),
        # context-parallel replicas of a ZeRO owner hold the same Adam state: exactly one writes it
        pytest.param((1, 1, None, True, 2), 4, marks=pytest.mark.slow),
    ],
    ids=["tp2", "pp2_vpp2", "dp2_zero", "cp2", "cp2_dp2_zero"],
)
def test_checkpoint_resumes_training_exactly_at_tp1_and_data_parallel(tmp_path, layout, world):
    run_distributed(_resume_across_layouts, world, str(tmp_path / "actor"), layout)


WEIGHTS_ONLY = {"save_contents": ["model"]}


def _save_weights(hf_model, path, layout) -> None:
    """`hf_model`'s weights, built at `layout` (tp, pp, vpp), saved as a weights-only checkpoint."""
    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager
    from verl.utils.megatron.parallel_state import destroy_model_parallel

    chunks = build_loaded_chunks(hf_model, *layout)
    MegatronCheckpointManager(chunks, checkpoint_config=WEIGHTS_ONLY).save_checkpoint(path)
    destroy_model_parallel()


def _check_loads_bit_exactly(path, other_model, saved_model, layout, what: str) -> None:
    """Chunks of `other_model` at `layout` (tp, pp, vpp), loaded from the checkpoint at `path`,
    hold exactly `saved_model`'s weights."""
    from verl.models.mcore import mcore_to_hf_named_tensors
    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager
    from verl.utils.megatron.parallel_state import destroy_model_parallel

    chunks = build_loaded_chunks(other_model, *layout)
    assert len(chunks) == (layout[2] or 1)
    MegatronCheckpointManager(chunks, checkpoint_config=WEIGHTS_ONLY).load_checkpoint(path)
    got = dict(mcore_to_hf_named_tensors(chunks, saved_model.config))
    want = hf_state_dict(saved_model)
    assert sorted(got) == sorted(want)
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), f"{name} {what}"
    destroy_model_parallel()


def _save_tp2_load_elsewhere(rank, world_size, path):
    saved_model = tiny_hf_model("qwen2", num_layers=2, seed=0)
    other_model = tiny_hf_model("qwen2", num_layers=2, seed=5)  # different weights, overwritten by the load
    _save_weights(saved_model, path, (2, 1, None))
    for tp, pp in ((1, 1), (1, 2)):
        _check_loads_bit_exactly(path, other_model, saved_model, (tp, pp, None), f"at tp={tp}, pp={pp}")


def test_weights_saved_at_tp2_load_bit_exactly_at_tp1_and_pp2(tmp_path):
    run_distributed(_save_tp2_load_elsewhere, 2, str(tmp_path / "actor"))


def _virtual_pipeline_round_trip(rank, world_size, path):
    """Weights saved with two virtual stages per rank (4 layers: ranks hold layers {0, 2} and {1, 3})
    load at pp=1, and a pp=1 checkpoint loads back into the interleaved chunks."""
    first = tiny_hf_model("llama", tie_word_embeddings=False, num_layers=4, seed=0)
    second = tiny_hf_model("llama", tie_word_embeddings=False, num_layers=4, seed=7)
    for saved, other, save_at, load_at in (
        (first, second, (1, 2, 2), (1, 1, None)),
        (second, first, (1, 1, None), (1, 2, 2)),
    ):
        _save_weights(saved, path, save_at)
        _check_loads_bit_exactly(path, other, saved, load_at, f"saved at {save_at}, loaded at {load_at}")


@pytest.mark.slow
def test_virtual_pipeline_checkpoint_loads_bit_exactly_without_it_and_back(tmp_path):
    run_distributed(_virtual_pipeline_round_trip, 2, str(tmp_path / "actor"))


def _zero_equals_adamw(rank, world_size):
    from verl.utils.megatron.parallel_state import destroy_model_parallel
    from verl.utils.optim import local_optimizer

    hf_model = tiny_hf_model("qwen2", tie_word_embeddings=True, num_layers=2)
    results = {}
    for zero in (False, True):
        chunks, actor, scheduler, _ = _trainer(copy.deepcopy(hf_model), tp=1, mini_batch=4, zero=zero)
        for seed in (1, 2):
            actor.update_policy(copy.deepcopy(_my_rows(_data(seed), rank, 2)))
            scheduler.step()
        params = [p for chunk in chunks for p in chunk.parameters()]
        state = local_optimizer(actor.actor_optimizer).state
        held = sum(state[p]["exp_avg"].numel() for p in params if p in state)
        results[zero] = (_weights(chunks, hf_model.config), held, sum(p.numel() for p in params))
        destroy_model_parallel()
    (plain, plain_held, total), (sharded, zero_held, _) = results[False], results[True]
    for name in plain:  # Adam is elementwise: the owner's step is the replicated step, bit for bit
        assert torch.equal(sharded[name], plain[name]), name
    assert plain_held == total
    both = torch.tensor([zero_held])
    torch.distributed.all_reduce(both)
    assert 0 < zero_held < total and int(both) == total, (zero_held, int(both), total)


def test_distributed_optimizer_steps_like_adamw_with_its_state_split_over_dp_ranks():
    run_distributed(_zero_equals_adamw, 2)
