"""RLHFDataset with a vision-language processor (the tiny-vl preset: transformers' Qwen2.5-VL processor).

Items are held to the processor called directly on the hand-written rendered text and the decoded
images; positions are hand-worked in one case."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn, create_rl_dataset

COLOR_Q = "<|vision_start|><|image_pad|><|vision_end|>What color?"


@pytest.fixture
def processor(vl_processor):
    return vl_processor


def _png(size, color, mode="RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def _row(content, images, index=0):
    return {
        "data_source": "vl_test",
        "prompt": [{"role": "user", "content": content}],
        "images": images,
        "reward_model": {"style": "rule", "ground_truth": "red"},
        "extra_info": {"split": "train", "index": index},
    }


def _write(tmp_path, rows, name="d.parquet"):
    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _dataset(path, processor, **config):
    base = {"max_prompt_length": 32, "filter_overlong_prompts": False, "truncation": "error"}
    return RLHFDataset(path, processor.tokenizer, {**base, **config}, processor=processor)


def _reference(processor, text, images):
    """The processor called directly: the expanded ids and the pixel inputs."""
    out = processor(text=[text], images=images, return_tensors="pt")
    return out["input_ids"][0], out.get("pixel_values"), out.get("image_grid_thw")


def test_image_row_equals_the_processor_and_hand_worked_positions(tmp_path, processor):
    red = _png((56, 56), (255, 0, 0))
    item = _dataset(_write(tmp_path, [_row("<image>What color?", [{"bytes": red, "path": "red.png"}])]), processor)[0]
    text = f"<bos><|user|>{COLOR_Q}<|assistant|>"
    ids, pixels, grid = _reference(processor, text, [Image.open(io.BytesIO(red)).convert("RGB")])
    # 56x56 pixels: a 4x4 grid of 14-pixel patches, merged 2x2 into 4 image tokens
    assert grid.tolist() == [[1, 4, 4]] and len(ids) == 20
    pad = processor.tokenizer.pad_token_id
    assert item["input_ids"].tolist() == [pad] * 12 + ids.tolist()
    assert item["attention_mask"].tolist() == [0] * 12 + [1] * 20
    assert torch.equal(item["multi_modal_inputs"]["pixel_values"], pixels)
    assert item["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert set(item["multi_modal_inputs"]) == {"pixel_values", "image_grid_thw"}
    # raw_prompt_ids: one pad token for the image (vLLM expands it), i.e. 3 fewer than the 20 expanded ids
    image_pad = processor.image_token_id
    assert item["raw_prompt_ids"] == processor.tokenizer.encode(text, add_special_tokens=False)
    assert len(item["raw_prompt_ids"]) == 17 and item["raw_prompt_ids"].count(image_pad) == 1
    (image,) = item["multi_modal_data"]["images"]
    assert image.mode == "RGB" and image.size == (56, 56) and image.getpixel((3, 3)) == (255, 0, 0)
    # hand-worked positions: <bos> <|user|> <|vision_start|> take 0 1 2; the image's 2x2 merged grid
    # takes t=3, h=3+row, w=3+col; text resumes at 3 + max(1, 2, 2) = 5: <|vision_end|>, 11 characters
    # and <|assistant|> take 5 .. 17
    pos = item["position_ids"]
    assert pos.shape == (4, 32) and pos.dtype == torch.long
    assert pos[0].tolist() == [0] * 12 + list(range(20))
    after = list(range(5, 18))
    assert pos[1].tolist() == [0] * 12 + [0, 1, 2, 3, 3, 3, 3] + after
    assert pos[2].tolist() == [0] * 12 + [0, 1, 2, 3, 3, 4, 4] + after
    assert pos[3].tolist() == [0] * 12 + [0, 1, 2, 3, 4, 3, 4] + after
    assert "images" not in item and "prompt" not in item and item["index"] == 0


def test_two_images_and_a_text_row_in_one_file(tmp_path, processor):
    tall, wide = _png((56, 112), (0, 0, 255)), _png((112, 28), (0, 255, 0))
    rows = [
        _row("<image> and <image> same?", [{"bytes": tall}, {"bytes": wide}]),
        _row("Say red.", None, index=1),
        _row("Say blue.", [], index=2),
    ]
    dataset = _dataset(_write(tmp_path, rows), processor, max_prompt_length=48, return_raw_chat=True)
    two = dataset[0]
    text = (
        "<bos><|user|><|vision_start|><|image_pad|><|vision_end|> and "
        "<|vision_start|><|image_pad|><|vision_end|> same?<|assistant|>"
    )
    images = [Image.open(io.BytesIO(b)).convert("RGB") for b in (tall, wide)]
    ids, pixels, grid = _reference(processor, text, images)
    assert grid.tolist() == [[1, 8, 4], [1, 2, 8]]
    assert two["input_ids"][48 - len(ids) :].tolist() == ids.tolist()
    assert torch.equal(two["multi_modal_inputs"]["pixel_values"], pixels)
    assert two["multi_modal_inputs"]["image_grid_thw"].tolist() == grid.tolist()
    assert [im.size for im in two["multi_modal_data"]["images"]] == [(56, 112), (112, 28)]
    assert two["raw_prompt"][0]["content"] == [
        {"type": "image"},
        {"type": "text", "text": " and "},
        {"type": "image"},
        {"type": "text", "text": " same?"},
    ]
    from verl.utils.vision import vl_position_ids

    expected = vl_position_ids(processor_config(processor), two["input_ids"][None], two["attention_mask"][None], grid)
    assert torch.equal(two["position_ids"], expected[0])
    for index, question in ((1, "Say red."), (2, "Say blue.")):
        text_row = dataset[index]
        text = f"<bos><|user|>{question}<|assistant|>"
        expected_ids = processor.tokenizer.encode(text, add_special_tokens=False)
        assert text_row["input_ids"][48 - len(expected_ids) :].tolist() == expected_ids
        assert text_row["raw_prompt_ids"] == expected_ids
        assert text_row["multi_modal_data"] == {} and text_row["multi_modal_inputs"] == {}
        # a text row's M-RoPE rows are its text positions
        assert text_row["position_ids"].shape == (4, 48)
        assert all(torch.equal(text_row["position_ids"][k], text_row["position_ids"][0]) for k in (1, 2, 3))
        assert text_row["raw_prompt"] == [{"role": "user", "content": question}]


def processor_config(processor):
    from types import SimpleNamespace

    return SimpleNamespace(
        image_token_id=processor.image_token_id,
        video_token_id=processor.video_token_id,
        vision_config=SimpleNamespace(spatial_merge_size=2),
    )


def test_path_and_resized_dict_images(tmp_path, processor):
    """A dict with only a path opens the file; a dict image is resized to multiples of 28 pixels within
    the pixel budget (30x70 -> 56x112, hand-worked in test_vision_utils)."""
    path = tmp_path / "odd.png"
    path.write_bytes(_png((30, 70), (10, 20, 30)))
    item = _dataset(_write(tmp_path, [_row("<image>What color?", [{"bytes": None, "path": str(path)}])]), processor)[0]
    assert item["multi_modal_data"]["images"][0].size == (56, 112)
    # 56x112 -> a 4x8 patch grid, 8 merged tokens
    assert item["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 8, 4]]
    assert int((item["input_ids"] == processor.image_token_id).sum()) == 8


def test_placeholder_count_must_equal_image_count(tmp_path, processor):
    red = {"bytes": _png((56, 56), (255, 0, 0))}
    path = _write(tmp_path, [_row("<image>ok", [red]), _row("<image> vs <image>?", [red])])
    with pytest.raises(
        ValueError, match=r"d\.parquet, row 1: the prompt has 2 <image> placeholder\(s\) but .* 1 image"
    ):
        _dataset(path, processor)
    path = _write(tmp_path, [_row("no placeholder", [red])], name="e.parquet")
    with pytest.raises(ValueError, match=r"row 0: the prompt has 0 <image>"):
        _dataset(path, processor)


def test_videos_and_images_without_a_processor_are_refused(tmp_path, processor):
    row = _row("<video>What happens?", None)
    row["videos"] = [{"video": "file:///clip.mp4"}]
    with pytest.raises(NotImplementedError, match="'videos' .*torchvision"):
        _dataset(_write(tmp_path, [row]), processor)
    path = _write(tmp_path, [_row("<image>What color?", [{"bytes": _png((56, 56), (1, 2, 3))}])], name="i.parquet")
    with pytest.raises(ValueError, match="holds 1 image.*no processor"):
        RLHFDataset(path, processor.tokenizer, {"max_prompt_length": 32})


def test_audio_is_refused_naming_the_column_and_an_empty_audio_column_is_not(tmp_path, processor):
    row = _row("What do you hear?", None)
    row["audios"] = [{"path": "clip.wav"}]
    with pytest.raises(NotImplementedError, match=r"row 0: column 'audios' \(data.audio_key\) holds audio"):
        _dataset(_write(tmp_path, [row]), processor)
    row["sound"] = row.pop("audios")  # another column, named by data.audio_key
    with pytest.raises(NotImplementedError, match="column 'sound'"):
        _dataset(_write(tmp_path, [row], name="s.parquet"), processor, audio_key="sound")
    row["sound"] = []
    assert len(_dataset(_write(tmp_path, [row], name="e.parquet"), processor, audio_key="sound")) == 1


def test_lengths_count_image_tokens_and_truncation_never_cuts_an_image(tmp_path, processor):
    red = {"bytes": _png((56, 56), (255, 0, 0))}
    # 20 expanded tokens (17 unexpanded) and a 19-token text row
    rows = [_row("<image>What color?", [red]), _row("What color, red?", None, index=1)]
    path = _write(tmp_path, rows)
    kept = _dataset(path, processor, max_prompt_length=19, filter_overlong_prompts=True)
    assert len(kept) == 1 and kept[0]["multi_modal_data"] == {}
    with pytest.raises(
        ValueError, match=r"1 prompts are longer than .*=19 tokens \(image tokens included\).*row 0 with 20"
    ):
        _dataset(path, processor, max_prompt_length=19)
    # left truncation to 17 would drop <bos> <|user|> <|vision_start|>: an error, at the item
    left = _dataset(path, processor, max_prompt_length=17, truncation="left")
    with pytest.raises(ValueError, match="row 0: .*20 tokens .*cut through an image"):
        left[0]
    # text before the image may go: 3 tokens of "Look: " are dropped from both id lists
    path = _write(tmp_path, [_row("Look: <image>What color?", [red])], name="t.parquet")
    item = _dataset(path, processor, max_prompt_length=23, truncation="left")[0]
    text = f"<bos><|user|>Look: {COLOR_Q}<|assistant|>"
    full_ids, _, _ = _reference(processor, text, [Image.new("RGB", (56, 56), (255, 0, 0))])
    assert len(full_ids) == 26
    assert item["input_ids"].tolist() == full_ids[3:].tolist()
    assert item["raw_prompt_ids"] == processor.tokenizer.encode(text, add_special_tokens=False)[3:]
    # the right end: "?" and <|assistant|> go, the image stays whole
    item = _dataset(path, processor, max_prompt_length=24, truncation="right")[0]
    assert item["input_ids"].tolist() == full_ids[:24].tolist()
    assert item["raw_prompt_ids"] == processor.tokenizer.encode(text, add_special_tokens=False)[:-2]


def test_collate_and_dataproto_round_trip(tmp_path, processor):
    from verl import DataProto
    from verl.utils.model import extract_multi_modal_inputs

    red, blue = _png((56, 56), (255, 0, 0)), _png((28, 56), (0, 0, 255))
    rows = [_row("<image>What color?", [{"bytes": red}]), _row("Hi", []), _row("<image>Color?", [{"bytes": blue}])]
    dataset = create_rl_dataset(
        _write(tmp_path, rows),
        {"max_prompt_length": 32, "filter_overlong_prompts": True},
        processor.tokenizer,
        processor,
    )
    batch = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(3)]))
    assert batch.batch["position_ids"].shape == (3, 4, 32) and batch.batch["input_ids"].shape == (3, 32)
    mm = batch.non_tensor_batch["multi_modal_inputs"]
    assert mm.dtype == object and mm.shape == (3,) and mm[1] == {}
    assert batch.non_tensor_batch["multi_modal_data"][0]["images"][0].size == (56, 56)
    merged = extract_multi_modal_inputs(list(mm))
    # 16 patches of the 56x56 image, then the 28x56 one: below the 4-token minimum (3136 pixels), scaled
    # by sqrt(2) and rounded up to multiples of 28: 56x84, a 6x4 grid of 24 patches
    assert merged["pixel_values"].shape == (40, 1176)
    assert merged["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 4]]
    repeated = batch.repeat(2, interleave=True)
    assert repeated.non_tensor_batch["multi_modal_inputs"][1] is mm[0]


def test_return_multi_modal_inputs_false_leaves_them_out(tmp_path, processor):
    path = _write(tmp_path, [_row("<image>What color?", [{"bytes": _png((56, 56), (255, 0, 0))}])])
    item = _dataset(path, processor, return_multi_modal_inputs=False)[0]
    assert "multi_modal_inputs" not in item and len(item["multi_modal_data"]["images"]) == 1
    assert np.asarray(item["position_ids"]).shape == (4, 32)
