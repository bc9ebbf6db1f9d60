"""The megatron GPTModel built from an HF config computes the HF model's function, at tp=1, tp=2 and
pp=2, and HF -> megatron -> HF weight conversion is bit-exact."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed_helpers import make_ppo_batch, run_distributed
from tests.megatron_helpers import assert_hf_round_trip_exact, build_loaded_chunks, tiny_hf_model
from verl.models.mcore.forward import left_align, response_columns

RESPONSE_LENGTH = 5


def _batch():
    return make_ppo_batch(batch_size=4, prompt_length=6, response_length=RESPONSE_LENGTH, seed=3)


@torch.no_grad()
def _hf_response_log_probs(hf_model, batch) -> torch.Tensor:
    logits = hf_model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    ).logits
    logp = torch.log_softmax(logits[:, -RESPONSE_LENGTH - 1 : -1].double(), dim=-1)
    return logp.gather(-1, batch["responses"][..., None])[..., 0]


def _megatron_response_log_probs(chunks, hf_config, batch, multiple_of: int = 1) -> torch.Tensor:
    """Full-vocabulary log-probs from a single-stage model (tp shards all-gathered for the check);
    `multiple_of` pads the aligned length (sequence parallelism needs a multiple of tp)."""
    from megatron.core import parallel_state as mpu

    aligned = left_align(
        batch["input_ids"], batch["attention_mask"], batch["position_ids"], RESPONSE_LENGTH, multiple_of=multiple_of
    )
    with torch.no_grad():
        logits = chunks[0](aligned.input_ids, aligned.position_ids, None)
    parts = [torch.empty_like(logits) for _ in range(mpu.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, logits.contiguous(), group=mpu.get_tensor_model_parallel_group())
    full = torch.cat(parts, dim=-1)[..., : hf_config.vocab_size]
    logp = torch.log_softmax(full.double(), dim=-1).gather(-1, aligned.labels[..., None])[..., 0]
    return response_columns(logp, aligned)


def expert_parallel_rows(batch: dict, rank: int, world_size: int, tp: int, ep: int, etp: int | None = None) -> dict:
    """This rank's rows of `batch`: each expert-parallel rank routes its own rows (they are
    data-parallel ranks), as does each expert-tensor rank beyond the tensor ranks (etp > tp: the
    expert-tensor group spans data-parallel ranks, whose different token counts it gathers); every
    row otherwise."""
    if ep == 1 and (etp or tp) <= tp:
        return batch
    return {k: v.chunk(world_size // tp)[rank // tp] for k, v in batch.items()}


def assert_log_probs_equal_hf(chunks, hf_model, batch, atol: float, multiple_of: int = 1) -> None:
    """The megatron `chunks`' response log-probs equal the HF model's (float64 log-softmax) on the
    response tokens of `batch`, within `atol`."""
    got = _megatron_response_log_probs(chunks, hf_model.config, batch, multiple_of=multiple_of)
    want = _hf_response_log_probs(hf_model, batch)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(got[mask], want[mask], atol=atol, rtol=0)


def assert_context_parallel_log_probs_equal_hf(chunks, hf_model, batch, atol: float) -> None:
    """Like `assert_log_probs_equal_hf` for `chunks` built at context_parallel_size > 1: each rank
    feeds its own chunks of every (left-aligned) row and the per-token log-probs are gathered back."""
    from verl.models.mcore.context_parallel import context_parallel_group
    from verl.utils.megatron.tensor_parallel import vocab_parallel_log_probs_and_entropy

    group, size, cp_rank = context_parallel_group()
    aligned = left_align(
        batch["input_ids"], batch["attention_mask"], batch["position_ids"], RESPONSE_LENGTH, multiple_of=2 * size
    ).split_for_context_parallel(group, size, cp_rank)
    with torch.no_grad():
        logits = chunks[0](aligned.model_input_ids, aligned.model_position_ids, None)
    log_probs, _ = vocab_parallel_log_probs_and_entropy(logits, aligned.model_labels, hf_model.config.vocab_size)
    got = response_columns(log_probs, aligned)
    want = _hf_response_log_probs(hf_model, batch)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(got[mask].double(), want[mask], atol=atol, rtol=0)


def _check_log_probs_match_hf(rank, world_size, architecture, tie):
    hf_model = tiny_hf_model(architecture, tie_word_embeddings=tie)
    batch = _batch()
    chunks = build_loaded_chunks(hf_model, tp=world_size)
    assert_log_probs_equal_hf(chunks, hf_model, batch, atol=1e-5)


@pytest.mark.parametrize("architecture,tie,tp", [("qwen2", True, 1), ("qwen2", True, 2), ("llama", False, 2)])
def test_megatron_log_probs_equal_hf(architecture, tie, tp):
    run_distributed(_check_log_probs_match_hf, tp, architecture, tie)


def _check_round_trip(rank, world_size, architecture, tie, tp, pp):
    hf_model = tiny_hf_model(architecture, tie_word_embeddings=tie, num_layers=4)
    chunks = build_loaded_chunks(hf_model, tp=tp, pp=pp)
    assert_hf_round_trip_exact(chunks, hf_model)


@pytest.mark.parametrize(
    "architecture,tie,tp,pp",
    [("qwen2", True, 2, 1), ("llama", False, 2, 1), ("qwen2", True, 1, 2), ("llama", False, 1, 2)],
)
def test_hf_to_megatron_to_hf_round_trip_is_bit_exact(architecture, tie, tp, pp):
    run_distributed(_check_round_trip, tp * pp, architecture, tie, tp, pp)


def _pipeline_logits(chunks, aligned):
    """Two-stage forward by hand: stage 0 sends its hidden states [S, B, H] to stage 1."""
    from megatron.core import parallel_state as mpu

    model = chunks[0]
    with torch.no_grad():
        if mpu.is_pipeline_first_stage():
            hidden = model(aligned.input_ids, aligned.position_ids, None)
            dist.send(hidden.contiguous(), dst=1)
            return None
        seq, batch = aligned.input_ids.shape[1], aligned.input_ids.shape[0]
        hidden = torch.empty(seq, batch, model.config.hidden_size)
        dist.recv(hidden, src=0)
        model.set_input_tensor(hidden)
        return model(aligned.input_ids, aligned.position_ids, None)


def _check_pipeline(rank, world_size, architecture, tie):
    hf_model = tiny_hf_model(architecture, tie_word_embeddings=tie, num_layers=4)
    batch = _batch()
    aligned = left_align(batch["input_ids"], batch["attention_mask"], batch["position_ids"], RESPONSE_LENGTH)
    logits = _pipeline_logits(build_loaded_chunks(hf_model, pp=2), aligned)
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()  # every rank rebuilds the single-stage layout (group creation is collective)
    single = build_loaded_chunks(hf_model, pp=1)[0]
    with torch.no_grad():
        reference = single(aligned.input_ids, aligned.position_ids, None)
    if rank == 1:
        torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)


def test_pipeline_parallel_forward_equals_single_stage():
    run_distributed(_check_pipeline, 2, "qwen2", True)


def _check_bf16(rank, world_size):
    """megatron.dtype=bf16: every parameter, norms included, is bfloat16 (as TransformerEngine's and
    apex's norms are), and the log-probs are the HF model's within bfloat16 rounding."""
    hf_model = tiny_hf_model("qwen2")
    batch = _batch()
    chunks = build_loaded_chunks(hf_model, tp=world_size, dtype=torch.bfloat16)
    assert {p.dtype for chunk in chunks for p in chunk.parameters()} == {torch.bfloat16}
    got = _megatron_response_log_probs(chunks, hf_model.config, batch)
    want = _hf_response_log_probs(hf_model.to(torch.bfloat16).double(), batch)
    mask = batch["response_mask"].bool()
    # log-probs near -5.6 (263 tokens) carry bf16's 2^-8 relative rounding of the logits, ~0.02 at
    # most; measured 4.5e-3 (a dropped norm or a swapped weight moves them by far more than 0.02)
    error = float((got[mask] - want[mask]).abs().max())
    assert error < 2e-2, error


def test_bf16_megatron_model_matches_hf_within_bf16_rounding():
    run_distributed(_check_bf16, 2)
