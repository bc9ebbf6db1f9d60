"""HFRollout honours `rollout.ignore_eos`: every response runs to `response_length` tokens, past the
end-of-sequence token that stops it by default (load tests and benchmarks need full-length responses)."""

from __future__ import annotations

import torch

from tests.config_helpers import engine_config
from tests.workers.rollout.rollout_helpers import left_padded_prompts
from verl.protocol import DataProto
from verl.workers.rollout.hf_rollout import HFRollout

R = 12


def _prompts(eos: int):
    input_ids, attention_mask = left_padded_prompts([5, 3, 4], seed=1)
    return DataProto.from_dict(
        tensors={"input_ids": input_ids, "attention_mask": attention_mask},
        meta_info={"eos_token_id": eos, "pad_token_id": 0, "do_sample": False},
    )


def test_ignore_eos_generates_full_length_responses_through_the_eos_token(qwen2_model):
    # Use as "eos" the token greedy decoding emits first for row 0, so that row stops at once by default.
    default = HFRollout(qwen2_model, engine_config(response_length=R), device="cpu")
    first = int(default.generate_sequences(_prompts(eos=2)).batch["responses"][0, 0])
    stopped = default.generate_sequences(_prompts(eos=first)).batch
    assert stopped["response_mask"][0].tolist() == [1] + [0] * (R - 1)

    full = HFRollout(qwen2_model, engine_config(response_length=R, ignore_eos=True), device="cpu")
    out = full.generate_sequences(_prompts(eos=first)).batch
    assert torch.equal(out["response_mask"], torch.ones_like(out["response_mask"]))
    assert int(out["responses"][0, 0]) == first  # same greedy tokens, just not cut at the eos
