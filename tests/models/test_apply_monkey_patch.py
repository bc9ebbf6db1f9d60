"""Upstream's `verl.models.transformers.monkey_patch.apply_monkey_patch` as a recipe worker uses it: a
packed batch sliced with `ulysses_pad_and_slice_inputs` over the global sequence-parallel group, the
model's own forward, `gather_outputs_and_unpad`: logits and gradients equal the whole packed forward
on one rank (float64), on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_helpers import run_distributed


def _model():
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=40,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(torch.float64)


def _packed():
    g = torch.Generator().manual_seed(1)
    lengths = [5, 8, 4]  # 17 tokens: padded to 18 for two ranks
    ids = torch.randint(1, 40, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return ids, pos


def _sp2_equals_whole(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils import ulysses

    ids, pos = _packed()
    reference = _model()
    whole = reference(input_ids=ids, position_ids=pos, use_cache=False).logits
    whole.pow(2).sum().backward()

    model = _model()
    ulysses.set_ulysses_sequence_parallel_group(dist.group.WORLD)
    try:
        apply_monkey_patch(model, ulysses_sp_size=world_size, use_remove_padding=True)
        local_ids, local_pos, pad = ulysses.ulysses_pad_and_slice_inputs(ids, pos, sp_size=world_size)
        assert (local_ids.shape[1], pad) == (9, 1)
        local = model(input_ids=local_ids, position_ids=local_pos, use_cache=False).logits
        logits = ulysses.gather_outputs_and_unpad(local, gather_dim=1, unpad_dim=1, padding_size=pad)
        torch.testing.assert_close(logits, whole, atol=1e-10, rtol=0)
        # each rank's loss is its slice's; summed over ranks it is the whole loss, so are the gradients
        local[:, : local.shape[1] - (pad if rank == world_size - 1 else 0)].pow(2).sum().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            grad = p.grad.clone()
            dist.all_reduce(grad)
            torch.testing.assert_close(grad, q.grad, atol=1e-9, rtol=1e-9, msg=name)
    finally:
        ulysses.set_ulysses_sequence_parallel_group(None)


def test_ulysses_through_apply_monkey_patch_equals_the_whole_packed_forward():
    run_distributed(_sp2_equals_whole, 2)


def test_remove_padding_alone_needs_no_patch_and_unbuilt_options_are_refused():
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    model = _model()
    apply_monkey_patch(model, ulysses_sp_size=1, use_remove_padding=True)  # transformers packs by itself
    ids, pos = _packed()
    packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    start = 0
    for n in (5, 8, 4):  # each packed sequence equals its own forward
        alone = model(input_ids=ids[:, start : start + n], use_cache=False).logits[0]
        torch.testing.assert_close(packed[start : start + n], alone, atol=1e-10, rtol=0)
        start += n
    for option in ("use_fused_kernels", "use_prefix_grouper"):  # use_tiled_mlp: tests/models/test_tiled_mlp.py
        with pytest.raises(NotImplementedError, match=option):
            apply_monkey_patch(model, **{option: True})
    with pytest.raises(ValueError, match="cannot split this model.s attention heads"):
        apply_monkey_patch(model, ulysses_sp_size=3)
