import pytest
import torch

from tests.distributed_helpers import make_ppo_batch, make_tiny_causal_lm, one_thread
from verl.utils.remove_padding import pad_input, unpad_input, unpad_position_ids

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


def test_unpad_then_pad_round_trips_and_positions_restart_per_sequence():
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 0]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]])
    pos = torch.tensor([[0, 0, 0, 1], [0, 1, 2, 2]])
    packed, indices = unpad_input(ids, mask)
    assert packed.tolist() == [[5, 6, 7, 8, 9]]
    assert unpad_position_ids(pos, indices).tolist() == [[0, 1, 0, 1, 2]]
    assert torch.equal(pad_input(packed[0], indices, 2, 4), ids * mask)
    features = torch.randn(2, 4, 3)
    packed_f, _ = unpad_input(features, mask)
    assert torch.equal(pad_input(packed_f[0], indices, 2, 4), features * mask[..., None])


def test_packed_forward_equals_padded_forward_for_qwen2_sdpa():
    model = make_tiny_causal_lm()
    batch = make_ppo_batch(batch_size=6, seed=11)
    ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        packed_ids, indices = unpad_input(ids, mask)
        packed = model(input_ids=packed_ids, position_ids=unpad_position_ids(pos, indices), use_cache=False).logits
    restored = pad_input(packed[0], indices, *ids.shape)
    real = mask.bool()
    torch.testing.assert_close(restored[real], padded[real], atol=1e-12, rtol=0)


def test_packed_forward_equals_padded_forward_for_gpt_oss_sinks_and_sliding_window():
    """transformers' gpt-oss builds its masks without the position ids, so it cannot see the packing
    by itself (the control below: rows then attend to the rows packed before them);
    `packed_model_inputs` gives it the block-diagonal causal and sliding-window masks, and the packed
    forward equals the padded one in float64 on rows longer than the 4-token window."""
    from tests.megatron_helpers import tiny_gptoss_hf_model
    from verl.utils.remove_padding import packed_model_inputs

    model = tiny_gptoss_hf_model().double()
    batch = make_ppo_batch(batch_size=4, prompt_length=8, seed=11, prompt_lengths=[8, 3, 6, 5])
    ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    real = mask.bool()
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        packed_ids, indices = unpad_input(ids, mask)
        packed_pos = unpad_position_ids(pos, indices)
        packed = model(**packed_model_inputs(model, packed_ids, packed_pos), use_cache=False).logits
        unmasked = model(input_ids=packed_ids, position_ids=packed_pos, use_cache=False).logits
    torch.testing.assert_close(pad_input(packed[0], indices, *ids.shape)[real], padded[real], atol=1e-10, rtol=0)
    assert float((pad_input(unmasked[0], indices, *ids.shape)[real] - padded[real]).abs().max()) > 1e-3


def test_packed_model_inputs_leave_models_that_see_the_packing_alone():
    from verl.utils.remove_padding import packed_model_inputs

    model = make_tiny_causal_lm()
    ids, pos = torch.tensor([[5, 6, 7]]), torch.tensor([[0, 1, 0]])
    assert packed_model_inputs(model, ids, pos) == {"input_ids": ids, "position_ids": pos}
