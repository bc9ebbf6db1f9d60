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
