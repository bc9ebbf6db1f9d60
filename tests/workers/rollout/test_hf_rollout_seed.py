"""The built-in engine's sampling stream: the worker's per-rank stream (saved with checkpoints), reseeded with
rollout.seed + rank under rollout.full_determinism (upstream seeds each vLLM replica with replica_rank + seed),
so replicas given copies of one prompt draw apart; a seed other than upstream's 42 is refused."""

from __future__ import annotations

import pytest
import torch

from tests.config_helpers import engine_config
from tests.workers.rollout.rollout_helpers import left_padded_prompts
from verl.protocol import DataProto
from verl.workers.rollout.hf_rollout import HFRollout

R = 12


def _sample(model, global_seed: int | None, **config) -> torch.Tensor:
    rollout = HFRollout(model, engine_config(response_length=R, **config), device="cpu")
    input_ids, attention_mask = left_padded_prompts([5, 3, 4, 6], seed=0)
    prompts = DataProto.from_dict(
        tensors={
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        },
        meta_info={"eos_token_id": -1, "pad_token_id": 0, "temperature": 1.0},
    )
    if global_seed is not None:
        torch.manual_seed(global_seed)
    return rollout.generate_sequences(prompts).batch["responses"]


def test_sampling_follows_the_workers_stream(qwen2_model):
    """The stream the checkpoints save: the same state draws the same responses, another state others."""
    first = _sample(qwen2_model, global_seed=0)
    assert torch.equal(first, _sample(qwen2_model, global_seed=0))
    assert not torch.equal(first, _sample(qwen2_model, global_seed=1))


def test_rollout_log_probs_are_returned_by_default(qwen2_model):
    """calculate_log_probs is on by default (upstream v0.9.0): the sampler returns them with the tokens."""
    rollout = HFRollout(qwen2_model, engine_config(response_length=4), device="cpu")
    assert rollout.config.calculate_log_probs is True


def _replica_responses(rank, world_size, out_dir):
    from tests.workers.rollout.rollout_helpers import build_model

    # full determinism reseeds the stream with seed + rank: same prompts, model and config on both ranks
    responses = _sample(build_model("qwen2"), global_seed=None, full_determinism=True)
    torch.save(responses, f"{out_dir}/rank{rank}.pt")


def test_replicas_draw_apart_under_full_determinism(tmp_path):
    from tests.distributed_helpers import run_distributed

    run_distributed(_replica_responses, 2, str(tmp_path))
    zero, one = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert not torch.equal(zero, one)


def test_another_seed_is_refused():
    from verl.trainer.config import ConfigError, load_ppo_config

    with pytest.raises(ConfigError, match="actor_rollout_ref.rollout.seed=7 is not implemented"):
        load_ppo_config(["actor_rollout_ref.rollout.seed=7"], config_name="arith_demo")
