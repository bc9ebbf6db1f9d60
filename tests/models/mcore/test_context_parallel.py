"""Context parallelism on the local layer spec: megatron's load-balanced split of a sequence, the
gather back (with its gradient), and a cp=2 GPTModel computing the HF model's log-probs while each
rank runs only half of every sequence."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_helpers import run_distributed
from tests.megatron_helpers import build_loaded_chunks, tiny_hf_model
from tests.models.mcore.test_mcore_model import RESPONSE_LENGTH, _batch, _hf_response_log_probs
from verl.models.mcore.context_parallel import global_positions, split_sequence
from verl.models.mcore.forward import left_align, response_columns


def test_split_is_megatrons_load_balanced_layout():
    """8 columns, cp=2: four chunks of two; rank 0 holds the first and last, rank 1 the middle two."""
    columns = torch.arange(8)[None]
    assert split_sequence(columns, 1, 2, 0).tolist() == [[0, 1, 6, 7]]
    assert split_sequence(columns, 1, 2, 1).tolist() == [[2, 3, 4, 5]]
    assert global_positions(4, 2, 0).tolist() == [0, 1, 6, 7]
    assert global_positions(4, 2, 1).tolist() == [2, 3, 4, 5]
    # cp=3, 12 columns: six chunks of two, rank r holds chunks r and 5 - r
    assert split_sequence(torch.arange(12), 0, 3, 1).tolist() == [2, 3, 8, 9]
    with pytest.raises(ValueError, match="not divisible by 2 x context_parallel_size=2"):
        split_sequence(torch.arange(6), 0, 2, 0)


def _check_gather_and_its_gradient(rank, world_size):
    """gather_sequence puts the parts back in order; its backward sums every rank's gradient for this
    rank's columns (here: rank s weights column j by (s + 1) * j, so the sum is 3 * j)."""
    import torch.distributed as dist

    from verl.models.mcore.context_parallel import gather_sequence

    full = torch.arange(8, dtype=torch.float64)[None].repeat(2, 1)
    part = split_sequence(full, 1, world_size, rank).clone().requires_grad_(True)
    gathered = gather_sequence(part, 1, dist.group.WORLD)
    assert torch.equal(gathered, full)
    weights = (rank + 1) * torch.arange(8, dtype=torch.float64)
    (gathered * weights).sum().backward()
    assert torch.equal(part.grad, split_sequence(3 * torch.arange(8, dtype=torch.float64), 0, 2, rank).expand(2, 4))


def test_gather_restores_the_order_and_sums_gradients_over_ranks():
    run_distributed(_check_gather_and_its_gradient, 2)


def _check_log_probs(rank, world_size, architecture, tie):
    from verl.models.mcore.context_parallel import context_parallel_group
    from verl.utils.megatron.tensor_parallel import vocab_parallel_log_probs_and_entropy

    hf_model = tiny_hf_model(architecture, tie_word_embeddings=tie)
    batch = _batch()
    chunks = build_loaded_chunks(hf_model, cp=world_size)
    group, size, cp_rank = context_parallel_group()
    assert (size, cp_rank) == (2, rank)
    aligned = left_align(
        batch["input_ids"], batch["attention_mask"], batch["position_ids"], RESPONSE_LENGTH, multiple_of=4
    ).split_for_context_parallel(group, size, cp_rank)
    assert aligned.input_ids.shape[1] % 4 == 0
    seen = []

    def record(module, args, kwargs):
        seen.append((args[0] if args else kwargs["hidden_states"]).shape[0])

    chunks[0].decoder.layers[0].register_forward_pre_hook(record, with_kwargs=True)
    with torch.no_grad():
        logits = chunks[0](aligned.model_input_ids, aligned.model_position_ids, None)
    assert seen == [aligned.input_ids.shape[1] // 2], "each rank should run half of every sequence"
    log_probs, _ = vocab_parallel_log_probs_and_entropy(logits, aligned.model_labels, hf_model.config.vocab_size)
    got = response_columns(log_probs, aligned)
    want = _hf_response_log_probs(hf_model, batch)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(got[mask].double(), want[mask], atol=1e-5, rtol=0)


@pytest.mark.parametrize("architecture,tie", [("qwen2", True), ("llama", False)])
def test_context_parallel_log_probs_equal_hf(architecture, tie):
    run_distributed(_check_log_probs, 2, architecture, tie)
