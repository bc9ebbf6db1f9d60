"""rollout.seed / rollout.full_determinism (upstream v0.9.0): the built-in engine samples from its own random
stream, seeded once when it is built, so the same seed gives the same responses whatever the global RNG holds,
and another seed other responses."""

from __future__ import annotations

import torch

from tests.config_helpers import engine_config
from tests.workers.rollout.rollout_helpers import left_padded_prompts
from verl.protocol import DataProto
from verl.workers.rollout.hf_rollout import HFRollout

R = 12


def _sample(model, seed: int, global_seed: int) -> torch.Tensor:
    rollout = HFRollout(model, engine_config(response_length=R, seed=seed), device="cpu")
    input_ids, attention_mask = left_padded_prompts([5, 3, 4, 6], seed=0)
    prompts = DataProto.from_dict(
        tensors={
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        },
        meta_info={"eos_token_id": -1, "pad_token_id": 0, "temperature": 1.0},
    )
    torch.manual_seed(global_seed)  # the sampler must not read the global stream
    return rollout.generate_sequences(prompts).batch["responses"]


def test_same_seed_same_responses_other_seed_other_responses(qwen2_model):
    first = _sample(qwen2_model, seed=42, global_seed=0)
    assert torch.equal(first, _sample(qwen2_model, seed=42, global_seed=123))
    assert not torch.equal(first, _sample(qwen2_model, seed=7, global_seed=0))


def test_rollout_log_probs_are_returned_by_default(qwen2_model):
    """calculate_log_probs is on by default (upstream v0.9.0): the sampler returns them with the tokens."""
    rollout = HFRollout(qwen2_model, engine_config(response_length=4), device="cpu")
    assert rollout.config.calculate_log_probs is True


def _replica_responses(rank, world_size, out_dir):
    from tests.workers.rollout.rollout_helpers import build_model

    model = build_model("qwen2")
    responses = _sample(model, seed=42, global_seed=0)  # same prompts, same model, same config on each rank
    torch.save(responses, f"{out_dir}/rank{rank}.pt")


def test_replicas_draw_apart_with_the_same_seed(tmp_path):
    """Each engine's stream is seeded with rollout.seed + its rank (upstream's vLLM replicas: replica_rank +
    seed): copies of one prompt given to two ranks are sampled independently, not identically."""
    from tests.distributed_helpers import run_distributed

    run_distributed(_replica_responses, 2, str(tmp_path))
    zero, one = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert not torch.equal(zero, one)
