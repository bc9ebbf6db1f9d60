"""The Ulysses all-to-all on 2 real gloo ranks against a single-process reference."""

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen2Config

from tests.distributed_helpers import VOCAB, run_distributed
from verl.utils.ulysses import (
    all_to_all,
    check_heads_divisible,
    gather_and_unpad,
    pad_and_slice_packed,
    patch_sdpa_attention,
    ulysses_forward_kwargs,
)


def _seq_to_head_and_back(rank, world_size):
    torch.manual_seed(0)
    full = torch.randn(2, 6, 4, 3, dtype=torch.float64)  # [batch, seq, heads, dim]
    local = full.chunk(world_size, dim=1)[rank].clone().requires_grad_(True)
    heads = all_to_all(local, scatter_dim=2, gather_dim=1)
    # Full sequence, this rank's heads only.
    torch.testing.assert_close(heads, full.chunk(world_size, dim=2)[rank], rtol=0, atol=0)
    weight = torch.arange(heads.numel(), dtype=torch.float64).reshape(heads.shape)
    (heads * weight).sum().backward()
    # d/d local of sum(all_to_all(local) * w) is the inverse all-to-all of w.
    expected = torch.zeros_like(full)
    expected_heads = list(expected.chunk(world_size, dim=2))
    weights = [torch.empty_like(weight) for _ in range(world_size)]
    dist.all_gather(weights, weight)
    for r, w in enumerate(weights):
        expected_heads[r].copy_(w)
    torch.testing.assert_close(local.grad, expected.chunk(world_size, dim=1)[rank], rtol=0, atol=0)
    back = all_to_all(heads, scatter_dim=1, gather_dim=2)
    torch.testing.assert_close(back, local.detach(), rtol=0, atol=0)


def test_all_to_all_trades_sequence_split_for_head_split_and_backward_inverts_it():
    run_distributed(_seq_to_head_and_back, 2)


# --- packed inputs, gathered outputs and the attention patch --------------------------------

# Three packed sequences of uneven lengths; 5 + 3 + 7 = 15 tokens, so sp=2 pads one token.
LENGTHS = (5, 3, 7)


def _packed_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (1, sum(LENGTHS)), generator=g)
    pos = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    return ids, pos


def _gqa_model(heads: int, kv_heads: int):
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(torch.float64)


def test_pad_and_slice_pads_to_a_multiple_of_sp_and_pads_form_their_own_sequence():
    ids, pos = _packed_batch()
    parts = [pad_and_slice_packed(ids, pos, 2, r) for r in range(2)]
    assert [p[3] for p in parts] == [1, 1]
    assert [p[0].shape for p in parts] == [torch.Size([1, 8])] * 2
    torch.testing.assert_close(
        torch.cat([p[0] for p in parts], 1), torch.cat([ids, torch.zeros(1, 1, dtype=ids.dtype)], 1)
    )
    torch.testing.assert_close(torch.cat([p[1] for p in parts], 1), parts[0][2])
    assert parts[0][2][0, -1].item() == 0  # the pad token starts a sequence of its own
    even_ids, even_pos = ids[:, :14], pos[:, :14]
    assert pad_and_slice_packed(even_ids, even_pos, 2, 1)[3] == 0


def _gather_case(rank, world_size):
    full = torch.arange(15, dtype=torch.float64).reshape(1, 15) * 0.5
    padded = torch.cat([full, torch.full((1, 1), 99.0, dtype=torch.float64)], 1)
    local = padded.chunk(world_size, dim=1)[rank].clone().requires_grad_(True)
    out = gather_and_unpad(local, dim=1, pad=1, grad_scale=3.0)
    torch.testing.assert_close(out, full, rtol=0, atol=0)
    weight = torch.linspace(1, 2, 15, dtype=torch.float64).reshape(1, 15)
    (out * weight).sum().backward()
    # This rank's slice of d/dout, times grad_scale; the pad position gets no gradient.
    expected = torch.cat([weight, torch.zeros(1, 1, dtype=torch.float64)], 1).chunk(world_size, 1)[rank] * 3.0
    torch.testing.assert_close(local.grad, expected, rtol=0, atol=0)


def test_gather_and_unpad_restores_the_full_sequence_and_slices_the_gradient():
    run_distributed(_gather_case, 2)


def _model_case(rank, world_size, heads, kv_heads):
    patch_sdpa_attention()
    ids, pos = _packed_batch()
    weight = torch.randn(1, ids.size(1), VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    reference = _gqa_model(heads, kv_heads)
    ref_logits = reference(input_ids=ids, position_ids=pos, use_cache=False).logits
    (ref_logits * weight).sum().backward()

    model = _gqa_model(heads, kv_heads)
    local_ids, local_pos, full_pos, pad = pad_and_slice_packed(ids, pos, world_size, rank)
    local_logits = model(
        input_ids=local_ids, position_ids=local_pos, use_cache=False, **ulysses_forward_kwargs(full_pos)
    ).logits
    logits = gather_and_unpad(local_logits, dim=1, pad=pad)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-10)
    (logits * weight).sum().backward()
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad)  # the sp ranks' gradients sum to one copy of the loss's
        ref = reference.get_parameter(name).grad
        err = (grad - ref).abs().max().item()
        assert err < 1e-10, f"{name}: sp={world_size} gradient differs from sp=1 by {err:.3g}"


def test_ulysses_forward_and_backward_equal_the_single_rank_packed_forward():
    run_distributed(_model_case, 2, 4, 2)


def test_ulysses_repeats_kv_heads_when_fewer_than_sp():
    run_distributed(_model_case, 2, 4, 1)


def test_heads_not_divisible_by_sp_is_refused_naming_the_key_and_counts():
    check_heads_divisible(Qwen2Config(num_attention_heads=4, num_key_value_heads=2), 2)
    check_heads_divisible(Qwen2Config(num_attention_heads=4, num_key_value_heads=1), 2)
    with pytest.raises(ValueError, match=r"ulysses_sequence_parallel_size=2.*num_attention_heads=3"):
        check_heads_divisible(Qwen2Config(num_attention_heads=3, num_key_value_heads=3, hidden_size=48), 2)
    with pytest.raises(ValueError, match=r"num_key_value_heads=3"):
        check_heads_divisible(Qwen2Config(num_attention_heads=12, num_key_value_heads=3, hidden_size=48), 4)


def test_attention_other_than_sdpa_is_refused_naming_the_key():
    from verl.utils.ulysses import check_attention

    config = Qwen2Config(num_attention_heads=4, num_key_value_heads=2)
    config._attn_implementation = "eager"
    check_attention(config, 1, "engine.ulysses_sequence_parallel_size")  # sp=1 runs any attention
    with pytest.raises(ValueError, match=r"^engine.ulysses_sequence_parallel_size=2 supports .*'eager'; set engine"):
        check_attention(config, 2, "engine.ulysses_sequence_parallel_size")
    config._attn_implementation = "sdpa"
    check_attention(config, 2)


def _upstream_api_case(rank, world_size):
    from verl.utils import ulysses as U

    # no global group: upstream's functions leave everything whole
    assert U.get_ulysses_sequence_parallel_world_size() == 1 and U.get_ulysses_sequence_parallel_rank() == 0
    x = torch.arange(6.0).reshape(1, 6)
    assert U.gather_outputs_and_unpad(x, gather_dim=1, unpad_dim=1, padding_size=1) is x
    U.set_ulysses_sequence_parallel_group(dist.group.WORLD)
    try:
        assert U.get_ulysses_sequence_parallel_world_size() == 2 and U.get_ulysses_sequence_parallel_rank() == rank
        ids = torch.tensor([[11, 12, 13, 14, 15]])
        pos = torch.tensor([[0, 1, 2, 0, 1]])
        padded, padded_pos, pad = U.ulysses_pad(ids, pos, sp_size=2)
        assert pad == 1 and padded.tolist() == [[11, 12, 13, 14, 15, 0]] and padded_pos.tolist() == [[0, 1, 2, 0, 1, 0]]
        mrope = torch.stack([pos, pos + 10, pos + 20])  # [3, 1, 5]
        assert U.ulysses_pad(ids, mrope, sp_size=2)[1][:, 0, -1].tolist() == [0, 0, 0]
        local, local_pos, pad = U.ulysses_pad_and_slice_inputs(ids, pos, sp_size=2)
        assert pad == 1 and local.tolist() == [[[11, 12, 13], [14, 15, 0]][rank]]
        assert local_pos.tolist() == [[[0, 1, 2], [0, 1, 0]][rank]]
        # the padded length's slices gathered back and cut to the 5 real entries; the backward keeps this
        # rank's slice of the gradient, times the group size with grad_scaler (upstream's default), else 1
        for scaler, factor in ((True, 2.0), (False, 1.0)):
            values = (local.double() * 0.5).requires_grad_(True)
            full = U.gather_outputs_and_unpad(values, gather_dim=1, unpad_dim=1, padding_size=pad, grad_scaler=scaler)
            assert full.tolist() == [[5.5, 6.0, 6.5, 7.0, 7.5]]
            weight = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]], dtype=torch.float64)
            (full * weight).sum().backward()
            expected = [[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]][rank]
            assert values.grad.tolist() == [[g * factor for g in expected]]
        # [1, S/sp, H, D] -> [1, S, H/sp, D] is this rank's heads of the whole sequence, and back again
        whole = torch.arange(1 * 4 * 2 * 3, dtype=torch.float64).reshape(1, 4, 2, 3)
        mine = whole[:, 2 * rank : 2 * rank + 2]
        heads = U.gather_seq_scatter_heads(mine, seq_dim=1, head_dim=2)
        torch.testing.assert_close(heads, whole[:, :, rank : rank + 1], rtol=0, atol=0)
        torch.testing.assert_close(U.gather_heads_scatter_seq(heads, head_dim=2, seq_dim=1), mine, rtol=0, atol=0)
    finally:
        U.set_ulysses_sequence_parallel_group(None)


def test_upstreams_ulysses_functions_on_the_global_group_against_hand_worked_values():
    run_distributed(_upstream_api_case, 2)


def test_upstreams_misspelt_gather_is_refused_and_bad_position_ids_are_explained():
    from verl.utils import ulysses as U

    with pytest.raises(RuntimeError, match="gather_outputs_and_unpad"):
        U.gather_outpus_and_unpad(torch.zeros(1))
    with pytest.raises(ValueError, match="do not match the packed ids"):
        U.ulysses_pad(torch.zeros(1, 5, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long), sp_size=2)
    with pytest.raises(ValueError, match="must be divisible"):
        U.validate_ulysses_config(num_heads=6, ulysses_sequence_size=4)
