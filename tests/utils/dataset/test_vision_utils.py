"""process_image: upstream's image rule (qwen_vl_utils.fetch_image for dicts, RGB only for PIL images)."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from verl.utils.dataset.vision_utils import process_image, process_video, smart_resize


def _png(size, color, mode="RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def test_smart_resize_hand_worked():
    # already multiples of 28 within budget: unchanged
    assert smart_resize(56, 112, 28) == (56, 112)
    # 70x30: rounds to 56x28 = 1568 < 4*28*28 = 3136, so scaled by sqrt(3136/2100) = 1.222 and rounded
    # up: 70*1.222/28 = 3.06 -> 4 (112), 30*1.222/28 = 1.31 -> 2 (56)
    assert smart_resize(70, 30, 28) == (112, 56)
    # 42 / 28 = 1.5 rounds to 2 (Python rounds halves to even), 98 / 28 = 3.5 -> 4
    assert smart_resize(42, 98, 28) == (56, 112)
    # over max_pixels=2*28*28: scaled by sqrt(112*112/1568) = 2.83, floored: 112/2.83/28 = 1.41 -> 1
    assert smart_resize(112, 112, 28, min_pixels=28 * 28, max_pixels=2 * 28 * 28) == (28, 28)
    with pytest.raises(ValueError, match="smaller than min_pixels"):
        smart_resize(112, 112, 28, max_pixels=2 * 28 * 28)
    # patch 16: one merged patch is 32 pixels, the minimum 4*32*32
    assert smart_resize(32, 32, 32) == (64, 64)
    with pytest.raises(ValueError, match="aspect ratio over 200"):
        smart_resize(1, 201, 28)


def test_pil_images_are_only_converted(tmp_path):
    rgba = Image.new("RGBA", (30, 70), (255, 0, 0, 0))
    out = process_image(rgba)
    assert out.mode == "RGB" and out.size == (30, 70) and out.getpixel((0, 0)) == (255, 0, 0)


def test_dict_images_bytes_path_image_and_data_url(tmp_path):
    raw = _png((30, 70), (10, 20, 30))
    from_bytes = process_image({"bytes": raw, "path": "not-a-file.png"})
    assert from_bytes.mode == "RGB" and from_bytes.size == (56, 112) and from_bytes.getpixel((5, 5)) == (10, 20, 30)
    path = tmp_path / "a.png"
    path.write_bytes(raw)
    assert process_image({"bytes": None, "path": str(path)}).size == (56, 112)
    assert process_image({"image": f"file://{path}"}).size == (56, 112)
    assert process_image({"image": Image.open(path)}).size == (56, 112)
    data_url = "data:image/png;base64," + base64.b64encode(raw).decode()
    assert process_image({"image": data_url}).size == (56, 112)
    # a row may fix the size; it is still rounded to whole merged patches: 60/28 -> 2, 100/28 -> 4
    assert process_image({"bytes": raw, "resized_height": 60, "resized_width": 100}).size == (112, 56)
    # patch size 16: 32-pixel merged patches, minimum 4*32*32 = 4096 pixels: 70x30 scaled by
    # sqrt(4096/2100) = 1.397 and rounded up: 70*1.397/32 = 3.06 -> 4 (128), 30*1.397/32 = 1.31 -> 2 (64)
    assert process_image({"bytes": raw}, image_patch_size=16).size == (64, 128)


def test_rgba_dict_image_goes_over_white():
    out = process_image({"bytes": _png((56, 56), (255, 0, 0, 0), mode="RGBA")})
    assert out.getpixel((0, 0)) == (255, 255, 255)


def test_bad_images_say_what_is_wrong(tmp_path):
    with pytest.raises(TypeError, match="PIL image or a dict"):
        process_image("a.png")
    with pytest.raises(ValueError, match="needs 'bytes', 'image' or 'path'"):
        process_image({"bytes": None, "path": None})
    with pytest.raises(ValueError, match="is a URL"):
        process_image({"image": "https://example.com/a.png"})
    with pytest.raises(FileNotFoundError, match="missing.png"):
        process_image({"path": str(tmp_path / "missing.png")})
    with pytest.raises(ValueError, match="both 'bytes' and 'image'"):
        process_image({"bytes": b"x", "image": "a.png"})
    with pytest.raises(NotImplementedError, match="torchvision"):
        process_video({"video": "file:///a.mp4"})


def test_minicpmo_inputs_shift_image_bounds_into_the_packed_sequence():
    import torch

    from verl.utils.dataset.vision_utils import process_multi_modal_inputs_for_minicpmo

    attention_mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]])  # left padding 1 and 2; packed lengths 3 and 2
    cu_seqlens = torch.tensor([0, 3, 5])
    images = [torch.full((1,), float(i)) for i in range(3)]
    inputs = {
        "image_bound": [torch.tensor([[1, 2], [2, 3]]), torch.tensor([[2, 3]])],
        "pixel_values": [[images[0], images[1]], [images[2]]],
        "tgt_sizes": [torch.tensor([[2, 2], [1, 1]]), torch.tensor([[3, 3]])],
        "other": "kept",
    }
    ids, pos = torch.arange(5)[None], torch.tensor([[0, 1, 2, 0, 1]])
    out = process_multi_modal_inputs_for_minicpmo(ids, attention_mask, pos, cu_seqlens, inputs)["data"]
    # row 0: bound - 1 + 0; row 1: bound - 2 + 3
    assert out["image_bound"][0].tolist() == [[0, 1], [1, 2], [3, 4]]
    assert out["pixel_values"] == [images]
    assert out["tgt_sizes"][0].tolist() == [[2, 2], [1, 1], [3, 3]]
    assert out["input_ids"] is ids and out["position_ids"] is pos and out["attention_mask"] is attention_mask
    assert out["other"] == "kept"
