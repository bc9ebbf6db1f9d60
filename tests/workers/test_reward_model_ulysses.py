"""The FSDP reward model's packed forward (`reward_model.model.use_remove_padding`) and its Ulysses split
(`reward_model.ulysses_sequence_parallel_size=2`) score what the padded forward scores, on 2 gloo ranks.

Each rank is sent an uneven share of rows of uneven lengths (3 and 5 rows), as a data-parallel chunk; with
sp=2 both ranks form one group that scores all 8 rows together, each returning its own. The reference is
the HF classifier in float64, one row at a time without padding (tests/workers/test_reward_model_worker.py).
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from tests.distributed_helpers import run_distributed
from tests.workers.test_reward_model_worker import _check, _config, _data, _make_reward_model, _reference
from verl.protocol import DataProto

SP = "ulysses_sequence_parallel_size"


def _worker(path, remove_padding: bool, sp: int = 1):
    from verl.workers import fsdp_workers

    cfg = OmegaConf.merge(
        _config(path, "fsdp", False), {"model": {"use_remove_padding": remove_padding}, SP: sp}
    )  # micro_batch_size_per_gpu=3: uneven micro-batches
    worker = fsdp_workers.RewardModelWorker(cfg)
    worker.init_model()
    return worker


def _packed_and_split_scores(rank, world_size, path):
    data = DataProto.from_dict(tensors=dict(_data().batch.items()))
    lengths = data.batch["attention_mask"].sum(-1)
    assert len(set(lengths.tolist())) > 1, "the rows must differ in length for packing to mean anything"
    rows = slice(0, 3) if rank == 0 else slice(3, 8)  # uneven chunks
    mine = data.slice(rows.start, rows.stop)
    expected = _reference(path, data, False)[rows]

    padded = _worker(path, False).compute_rm_score(mine)
    packed_worker = _worker(path, True)
    assert packed_worker.speed_paths()[0]["active"], "the packed path must be the one that ran"
    packed = packed_worker.compute_rm_score(mine)
    _check(padded, mine, expected, "padded")
    _check(packed, mine, expected, "packed")
    err = (packed.batch["rm_scores"] - padded.batch["rm_scores"]).abs().max().item()
    assert err < 2e-5, f"packed scores differ from padded by {err:.3g}"

    split_worker = _worker(path, True, sp=2)
    assert split_worker.sp == 2 and split_worker.ulysses.sp == 2
    split = split_worker.compute_rm_score(mine)
    assert split.batch["rm_scores"].shape == mine.batch["response_mask"].shape, "each rank returns its own rows"
    _check(split, mine, expected, "sp=2")
    err = (split.batch["rm_scores"] - packed.batch["rm_scores"]).abs().max().item()
    assert err < 2e-5, f"sp=2 scores differ from sp=1 by {err:.3g}"

    with pytest.raises(ValueError, match=rf"^reward_model.{SP}=2 needs reward_model.model.use_remove_padding=True"):
        _worker(path, False, sp=2)


def test_packed_and_ulysses_reward_scores_equal_the_padded_ones(tmp_path):
    _make_reward_model(tmp_path / "rm")
    run_distributed(_packed_and_split_scores, 2, str(tmp_path / "rm"))


def test_a_backend_without_a_ulysses_forward_refuses_sp_before_joining_the_group(tmp_path):
    from verl.workers import megatron_workers

    # the megatron composition has no such key (upstream's neither): the section as a user could pass it directly
    cfg = OmegaConf.merge(_config(tmp_path / "rm", "fsdp", False), {"strategy": "megatron", SP: 2})
    with pytest.raises(ValueError, match=rf"^reward_model.{SP}=2: RewardModelWorker has no Ulysses forward"):
        megatron_workers.RewardModelWorker(cfg)
