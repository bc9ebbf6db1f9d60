"""Expert parallelism of the built-in engine (`rollout.expert_parallel_size`) on tiny-moe.

Two gloo ranks split the 4 experts of every layer (2 each); each generates its own prompts, and
its tokens, responses and log-probs must equal what one rank holding every expert (ep=1, the
unmodified transformers model) produces for the same prompts. The ranks' batches differ in size
and finish at different steps, so the lock-step (the group-wide stop check, the dummy chunks) is
exercised; a weight sync must leave each rank exactly its own experts of the trainer's tensors.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed_helpers import run_distributed
from tests.workers.rollout.rollout_helpers import left_padded_prompts
from tests.workers.rollout.test_generation_engine_moe import moe_model
from verl.workers.rollout.native.engine import GenerationEngine
from verl.workers.rollout.native.expert_parallel import ExpertParallelExperts, shard_experts
from verl.workers.rollout.sampling import SamplingParams

GREEDY = SamplingParams(do_sample=False)
R = 10
# each rank's prompt lengths: rank 1 has more rows and must keep decoding after rank 0 is done
LENGTHS = {0: [5, 3], 1: [7, 2, 6, 4, 5]}


def _prompts(rank: int):
    return left_padded_prompts(LENGTHS[rank], seed=11 + rank)


def _generate(engine, rank: int, eos):
    ids, mask = _prompts(rank)
    return engine.generate(ids, mask, R, GREEDY, eos_token_id=eos, pad_token_id=0, return_logprobs=True)


def _stop_tokens(reference) -> list[int]:
    """Tokens that end each of rank 0's rows at its second column: rank 0 finishes early."""
    out = _generate(reference, 0, None)
    return sorted({int(t) for t in out.responses[:, 1]})


def _engine_rank(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    from verl.workers.rollout.native.expert_parallel import expert_parallel_group

    group, group_rank = expert_parallel_group(2)
    assert group_rank == rank
    for seed in (0, 1):  # built from seed 0, then seed 1's weights synced in the trainer's names
        model = moe_model(seed)
        reference = GenerationEngine.from_model(model, device="cpu")
        eos = _stop_tokens(reference)
        expected = _generate(reference, rank, eos)
        if seed == 0:
            engine = GenerationEngine.from_model(model, device="cpu", expert_parallel=(group, rank, 2))
        else:
            engine.sleep()
            engine.wake_up()
            engine.update_weights(model.state_dict().items())
        experts = [m for m in engine.decoder.model.modules() if isinstance(m, ExpertParallelExperts)]
        assert len(experts) == model.config.num_hidden_layers
        full = dict(model.named_parameters())
        for name, param in engine.decoder.model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                torch.testing.assert_close(param, full[name][2 * rank : 2 * rank + 2], rtol=0, atol=0)
        got = _generate(engine, rank, eos)
        lengths = torch.tensor([int(expected.response_mask[i].sum()) for i in range(len(LENGTHS[rank]))])
        if rank == 0:
            assert (lengths <= 2).all(), lengths
        else:
            assert (lengths > 2).any(), "rank 1 must outlive rank 0 for the lock-step to be tested"
        torch.testing.assert_close(got.responses, expected.responses, rtol=0, atol=0)
        torch.testing.assert_close(got.response_mask, expected.response_mask, rtol=0, atol=0)
        torch.testing.assert_close(got.logprobs, expected.logprobs, rtol=0, atol=1e-5)
    dist.barrier(group)


def test_expert_parallel_greedy_generation_and_weight_sync_equal_one_rank_with_every_expert():
    run_distributed(_engine_rank, 2)


def _rollout_rank(rank: int, world_size: int) -> None:
    import numpy as np

    from verl.protocol import DataProto
    from verl.workers.rollout.hf_rollout import HFRollout

    model = moe_model(0)
    config = {
        "expert_parallel_size": 2,
        "tensor_model_parallel_size": 2,
        "max_num_seqs": 2,  # rank 0: 1 chunk, rank 1: 3 chunks; rank 0 runs 2 dummy ones
        "response_length": R,
        "prompt_length": 8,
        "dtype": "float32",
        "calculate_log_probs": True,
    }
    ids, mask = _prompts(rank)
    prompts = DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
        non_tensors={"uid": np.array([f"u{i}" for i in range(len(ids))], dtype=object)},
        meta_info={"eos_token_id": 1, "pad_token_id": 0, "do_sample": False},
    )
    got = HFRollout(model, config={**config}, device="cpu").generate_sequences(prompts)
    single = HFRollout(model, config={**config, "expert_parallel_size": 1}, device="cpu")
    expected = single.generate_sequences(prompts)
    for key in ("responses", "response_mask", "attention_mask", "position_ids"):
        torch.testing.assert_close(got.batch[key], expected.batch[key], rtol=0, atol=0)
    torch.testing.assert_close(got.batch["rollout_log_probs"], expected.batch["rollout_log_probs"], atol=1e-5, rtol=0)


def test_expert_parallel_rollout_runs_dummy_chunks_where_a_rank_has_fewer_rows():
    run_distributed(_rollout_rank, 2)


def test_expert_parallel_size_must_divide_the_experts_and_the_model_must_have_fused_experts():
    with pytest.raises(ValueError, match="expert_parallel_size=3 does not divide the 4 experts"):
        shard_experts(moe_model(0), None, 0, 3)
    from tests.workers.rollout.rollout_helpers import build_model

    with pytest.raises(ValueError, match="has no routed-experts module"):
        shard_experts(build_model("qwen2"), None, 0, 2)
