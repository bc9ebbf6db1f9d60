"""The CPU shim lets megatron-core's accelerator calls run on CPU, touching nothing outside megatron."""

from __future__ import annotations

import torch

from tests.distributed_helpers import run_distributed


def _check_shim(rank, world_size):
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    from verl.utils.megatron import cpu_compat
    from verl.utils.megatron.parallel_state import initialize_model_parallel

    real_cuda = torch.cuda
    sizes = initialize_model_parallel(tensor_model_parallel_size=2)
    assert (sizes.tp, sizes.pp, sizes.dp) == (2, 1, 1)
    assert cpu_compat.is_cpu_compat_enabled()
    # megatron's own view of the device is the CPU ...
    assert schedules.torch.cuda.current_device() == torch.device("cpu")
    p2p_communication.torch.cuda.synchronize()
    accelerator = real_cuda.__name__.split(".")[-1]  # the accelerator's device string, without spelling it
    assert schedules.torch.zeros([], device=accelerator).device.type == "cpu"
    # ... the global memory buffer (local attention's scratch space) allocates on CPU ...
    buffer = mpu.get_global_memory_buffer().get_tensor((2, 3), torch.float32, "mpu")
    assert buffer.device.type == "cpu"
    # ... while torch itself keeps its real accelerator module
    assert torch.cuda is real_cuda
    # enabling twice is harmless
    cpu_compat.enable_cpu_compat()


def test_cpu_shim_makes_megatron_allocate_on_cpu_and_leaves_torch_alone():
    run_distributed(_check_shim, 2)


def test_cpu_shim_is_a_no_op_when_cuda_is_available(monkeypatch):
    from verl.utils.megatron import cpu_compat

    monkeypatch.setattr(cpu_compat, "is_cuda_available", lambda: True)
    monkeypatch.setattr(cpu_compat, "_enabled", False)
    cpu_compat.enable_cpu_compat()
    assert not cpu_compat.is_cpu_compat_enabled()


def _check_sizes(rank, world_size):
    import pytest

    from verl.utils.megatron.parallel_state import initialize_model_parallel

    with pytest.raises(ValueError, match="must divide the world size"):
        initialize_model_parallel(tensor_model_parallel_size=3)
    with pytest.raises(ValueError, match="virtual_pipeline_model_parallel_size"):
        initialize_model_parallel(pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match="context_parallel_size=3: the product must divide"):
        initialize_model_parallel(context_parallel_size=3)
    initialize_model_parallel(pipeline_model_parallel_size=2)
    with pytest.raises(RuntimeError, match="already exist"):
        initialize_model_parallel(tensor_model_parallel_size=2)


def test_parallel_sizes_that_do_not_fit_the_world_are_clear_errors():
    run_distributed(_check_sizes, 2)


def _check_rotary_slice(rank, world_size):
    """Megatron's rotary embedding under context parallelism (cp=2, 8 positions in 4 chunks of 2):
    rank 0 gets positions 0, 1, 6, 7 and rank 1 gets 2, 3, 4, 5, through the CPU stand-in for its
    pinned-memory slicing."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from verl.utils.megatron.parallel_state import initialize_model_parallel

    initialize_model_parallel(context_parallel_size=2)
    rotary = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, rotary_base=10000)
    emb = rotary(8)  # [s, 1, 1, dim]: position x inverse frequency
    inv_freq_1 = 1.0 / 10000 ** (2 / 8)
    positions = (emb[:, 0, 0, 1] / inv_freq_1).round().long().tolist()
    assert positions == ([0, 1, 6, 7] if rank == 0 else [2, 3, 4, 5]), positions


def test_rotary_positions_are_sliced_for_context_parallel_ranks_on_cpu():
    run_distributed(_check_rotary_slice, 2)
