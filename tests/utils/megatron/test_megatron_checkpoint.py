"""A dist checkpoint written at tp=2 loads at tp=1 (and pp=2) to the same model."""

from __future__ import annotations

import torch

from tests.distributed_helpers import run_distributed
from tests.megatron_helpers import build_loaded_chunks, hf_state_dict, tiny_hf_model


def _save_tp2_load_elsewhere(rank, world_size, path):
    from megatron.core import parallel_state as mpu

    from verl.models.mcore import mcore_to_hf_named_tensors
    from verl.utils.megatron.checkpoint import load_megatron_checkpoint, save_megatron_checkpoint

    saved_model = tiny_hf_model("qwen2", num_layers=2, seed=0)
    other_model = tiny_hf_model("qwen2", num_layers=2, seed=5)  # different weights, overwritten by the load
    chunks = build_loaded_chunks(saved_model, tp=2)
    save_megatron_checkpoint(chunks, path)
    want = hf_state_dict(saved_model)
    for tp, pp in ((1, 1), (1, 2)):
        mpu.destroy_model_parallel()
        chunks = build_loaded_chunks(other_model, tp=tp, pp=pp)
        load_megatron_checkpoint(chunks, path)
        got = dict(mcore_to_hf_named_tensors(chunks, saved_model.config))
        assert sorted(got) == sorted(want)
        for name, tensor in got.items():
            assert torch.equal(tensor, want[name]), f"{name} at tp={tp}, pp={pp}"


def test_checkpoint_saved_at_tp2_loads_at_tp1_and_pp2(tmp_path):
    run_distributed(_save_tp2_load_elsewhere, 2, str(tmp_path / "ckpt"))
