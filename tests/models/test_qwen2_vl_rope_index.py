"""Upstream's `verl.models.transformers.qwen2_vl.get_rope_index`: one sequence's M-RoPE positions from
its processor, against transformers' own `get_rope_index` (images) and hand-worked values (videos)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from verl.models.factory import build_tokenizer, make_tiny
from verl.models.transformers.qwen2_vl import get_rope_index


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    return make_tiny("tiny-vl", str(tmp_path_factory.mktemp("tiny-vl")))


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("tiny-vl")


def _processor(tokenizer, merge_size=2):
    """What get_rope_index reads of a processor: its tokenizer and the image processor's merge size."""
    return SimpleNamespace(tokenizer=tokenizer, image_processor=SimpleNamespace(merge_size=merge_size))


def test_image_rows_equal_transformers_get_rope_index_and_padding_is_one(tiny_vl):
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from verl.utils.tokenizer import hf_processor

    processor = hf_processor(tiny_vl)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl)
    two = [{"type": "image"}, {"type": "text", "text": "or"}, {"type": "image"}, {"type": "text", "text": "which?"}]
    texts = [
        processor.apply_chat_template([{"role": "user", "content": two}], add_generation_prompt=True, tokenize=False),
        processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "ok"}]}],
            add_generation_prompt=True,
            tokenize=False,
        ),
    ]
    images = [Image.new("RGB", (28, 112), (9, 9, 9)), Image.new("RGB", (84, 56), (1, 2, 3))]
    images.append(Image.new("RGB", (56, 56), (5, 5, 5)))
    processor.tokenizer.padding_side = "left"
    inputs = processor(text=texts, images=images, padding=True, return_tensors="pt")
    grids = inputs["image_grid_thw"]
    assert grids.tolist() == [[1, 8, 2], [1, 4, 6], [1, 4, 4]]
    expected, _ = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=grids, attention_mask=inputs["attention_mask"]
    )
    mask = inputs["attention_mask"].bool()
    assert not mask[1].all()  # the second row is left-padded
    for row, row_grids in ((0, grids[:2]), (1, grids[2:])):
        ours = get_rope_index(
            processor, inputs["input_ids"][row], image_grid_thw=row_grids, attention_mask=inputs["attention_mask"][row]
        )
        assert ours.shape == (3, inputs["input_ids"].shape[1]) and ours.dtype == torch.long
        assert torch.equal(ours[:, mask[row]], expected[:, row][:, mask[row]])
        assert (ours[:, ~mask[row]] == 1).all()  # upstream's padding value


def test_video_time_index_is_scaled_by_seconds_per_grid_and_two_tokens_per_second(tok):
    start, vstart, video = (tok.convert_tokens_to_ids(t) for t in ("<bos>", "<|vision_start|>", "<|video_pad|>"))
    text = tok("ab")["input_ids"]
    # grid (2, 4, 4) merged 2x2: t=2, h=2, w=2 -> 8 video tokens, after 3 text tokens (positions 0-2)
    ids = torch.tensor([start, *text[:1], vstart] + [video] * 8 + text)
    grid = torch.tensor([[2, 4, 4]])
    pos = get_rope_index(_processor(tok), ids, video_grid_thw=grid, second_per_grid_ts=torch.tensor([1.5]))
    # time index k -> int(k * 1.5 * 2) = 0, 3; the text after starts one past the largest (3 + 3) -> 7
    assert pos[:, 3:11].tolist() == [
        [3, 3, 3, 3, 6, 6, 6, 6],
        [3, 3, 4, 4, 3, 3, 4, 4],
        [3, 4, 3, 4, 3, 4, 3, 4],
    ]
    assert pos[:, 11:].tolist() == [[7, 8]] * 3 and pos[:, :3].tolist() == [[0, 1, 2]] * 3
    # seconds per grid default to 1.0: time indices 0, 2, the text after at 3 + 2 + 1
    default = get_rope_index(_processor(tok), ids, video_grid_thw=grid)
    assert default[0, 3:11].tolist() == [3] * 4 + [5] * 4 and default[:, 11].tolist() == [6, 6, 6]


def test_image_then_video_take_their_grids_in_prompt_order(tok):
    vstart, image, video = (
        tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|video_pad|>")
    )
    # an image of grid (1, 2, 6) -> 3 tokens (h=1, w=3), then a video of grid (1, 2, 2) -> 1 token
    ids = torch.tensor([vstart] + [image] * 3 + [vstart, video, vstart])
    pos = get_rope_index(
        _processor(tok), ids, image_grid_thw=torch.tensor([[1, 2, 6]]), video_grid_thw=torch.tensor([[1, 2, 2]])
    )
    # image at 1: t 1,1,1 h 1,1,1 w 1,2,3; text after at 1 + 2 + 1 = 4; the video at 5; last text at 6
    assert pos.tolist() == [[0, 1, 1, 1, 4, 5, 6], [0, 1, 1, 1, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6]]


def test_without_grids_the_sequence_is_text_in_all_three_rows(tok):
    ids = torch.tensor(tok("hello")["input_ids"])
    mask = torch.tensor([0, 0] + [1] * (len(ids) - 2))
    pos = get_rope_index(_processor(tok), ids, attention_mask=mask)
    assert pos.tolist() == [[1, 1, *range(len(ids) - 2)]] * 3
    assert get_rope_index(_processor(tok), ids).tolist() == [list(range(len(ids)))] * 3


def test_refuses_a_batch_and_grids_that_do_not_match_the_tokens(tok):
    image = tok.convert_tokens_to_ids("<|image_pad|>")
    with pytest.raises(ValueError, match="one sequence"):
        get_rope_index(_processor(tok), torch.tensor([[1, 2]]), image_grid_thw=torch.tensor([[1, 2, 2]]))
    with pytest.raises(ValueError, match="needs 4 consecutive image tokens"):
        get_rope_index(_processor(tok), torch.tensor([5, image, image, 6]), image_grid_thw=torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match="second_per_grid_ts has 2 values for 1 videos"):
        get_rope_index(
            _processor(tok),
            torch.tensor([5, image]),
            image_grid_thw=torch.tensor([[1, 2, 2]]),
            video_grid_thw=torch.tensor([[1, 2, 2]]),
            second_per_grid_ts=torch.tensor([1.0, 2.0]),
        )
