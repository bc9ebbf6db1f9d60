"""A process's own random streams (`register_rng_generator`, the built-in rollout's sampler) travel with the
checkpoint's RNG state: restored, they draw what they drew after the save."""

from __future__ import annotations

import torch

from verl.utils.checkpoint.checkpoint_manager import RNG_GENERATORS, BaseCheckpointManager, register_rng_generator


def test_a_registered_generator_is_saved_and_restored_with_the_rng_state():
    stream = torch.Generator().manual_seed(43)
    register_rng_generator("test_stream", stream)
    try:
        torch.rand(5, generator=stream)  # advance it past its seed
        state = BaseCheckpointManager.get_rng_state()
        after_save = torch.rand(4, generator=stream)
        torch.rand(7, generator=stream)  # the run goes on, then is resumed from the checkpoint
        BaseCheckpointManager.load_rng_state(state)
        assert torch.equal(torch.rand(4, generator=stream), after_save)
        # a checkpoint without the stream (an older one) leaves it where it is
        older = {k: v for k, v in state.items() if k != "generators"}
        before = stream.get_state()
        BaseCheckpointManager.load_rng_state(older)
        assert torch.equal(stream.get_state(), before)
    finally:
        RNG_GENERATORS.pop("test_stream", None)
