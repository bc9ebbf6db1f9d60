"""The vision-language preset: an ordinary Qwen2.5-VL directory with its processor, loaded offline."""

from __future__ import annotations

import pytest
import torch

from verl.models import tokenizer as char_tokenizer
from verl.models.factory import build_config, build_tokenizer, make_tiny


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    return make_tiny("tiny-vl", str(tmp_path_factory.mktemp("tiny-vl")))


def _positions(model, inputs):
    """(our M-RoPE positions, transformers' own get_rope_index, the attention mask) of a processed batch."""
    from verl.utils.vision import vl_position_ids

    expected, _ = model.model.get_rope_index(
        inputs["input_ids"],
        inputs["mm_token_type_ids"],
        image_grid_thw=inputs["image_grid_thw"],
        attention_mask=inputs["attention_mask"],
    )
    ours = vl_position_ids(model.config, inputs["input_ids"], inputs["attention_mask"], inputs["image_grid_thw"])
    return ours, expected, inputs["attention_mask"].bool()


def test_text_ids_are_the_text_tokenizers():
    text, vision = build_tokenizer("tiny"), build_tokenizer("tiny-vl")
    sample = "<bos><|user|>What is 37+48?<|assistant|>85<eos>"
    assert vision(sample)["input_ids"] == text(sample)["input_ids"]
    base = char_tokenizer.base_vocab_size()
    assert vision.convert_tokens_to_ids(list(char_tokenizer.VISION_TOKENS)) == list(range(base, base + 4))
    config = build_config("tiny-vl", vision)
    assert config.image_token_id == vision.convert_tokens_to_ids("<|image_pad|>")
    assert config.vision_start_token_id == base and config.text_config.vocab_size == len(vision)
    assert config.vision_config.out_hidden_size == config.text_config.hidden_size
    # the config built without a tokenizer names the same ids
    assert build_config("tiny-vl").image_token_id == config.image_token_id


def test_chat_template_renders_parts_and_plain_strings():
    tok = build_tokenizer("tiny-vl")
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which color?"}]}]
    plain = [{"role": "user", "content": "Which color?"}]
    assert (
        tok.apply_chat_template(parts, add_generation_prompt=True, tokenize=False)
        == "<bos><|user|><|vision_start|><|image_pad|><|vision_end|>Which color?<|assistant|>"
    )
    assert tok.apply_chat_template(plain, add_generation_prompt=True, tokenize=False) == (
        build_tokenizer("tiny").apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    )


def test_directory_loads_processor_and_model_offline(tiny_vl):
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from verl.utils.tokenizer import hf_processor

    processor = hf_processor(tiny_vl)
    assert processor is not None and processor.image_token == "<|image_pad|>"
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    # a 40x70 image resizes to 28x56 pixels: a 2x4 grid of 14-pixel patches, merged 2x2 into 2 tokens
    image = Image.new("RGB", (40, 70), (0, 200, 0))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Color?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 2]]
    assert inputs["pixel_values"].shape == (8, 3 * 2 * 14 * 14)
    assert (inputs["input_ids"] == model.config.image_token_id).sum().item() == 2
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], model.config.text_config.vocab_size)
    # the image reaches the logits: another image changes them
    other = processor(text=[text], images=[Image.new("RGB", (40, 70), (200, 0, 0))], return_tensors="pt")
    with torch.no_grad():
        assert not torch.allclose(model(**other).logits, logits)
    if type(processor).__name__ == "ImageOnlyQwen2_5_VLProcessor":  # no torchvision here
        with pytest.raises(ValueError, match="torchvision"):
            processor(text=[text], videos=[[image]])


def test_mrope_positions_equal_transformers_get_rope_index(tiny_vl):
    """Two left-padded rows, one with two images of different grids and text between and after them,
    one text-only, against the model's own `get_rope_index`."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from verl.utils.tokenizer import hf_processor

    processor = hf_processor(tiny_vl)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl)
    two = [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}, {"type": "text", "text": "same?"}]
    texts = [
        processor.apply_chat_template([{"role": "user", "content": two}], add_generation_prompt=True, tokenize=False),
        processor.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False),
    ]
    images = [Image.new("RGB", (56, 112), (9, 9, 9)), Image.new("RGB", (84, 28), (1, 2, 3))]
    processor.tokenizer.padding_side = "left"
    inputs = processor(text=texts, images=images, padding=True, return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 8, 4], [1, 2, 6]]
    ours, expected, mask = _positions(model, inputs)
    assert ours.shape == (2, 4, inputs["input_ids"].shape[1])
    for row in range(2):
        assert torch.equal(ours[row, 1:][:, mask[row]], expected[:, row][:, mask[row]])
        assert ours[row, 0][mask[row]].tolist() == list(range(int(mask[row].sum())))
    # the text-only row's M-RoPE rows are its text positions
    assert torch.equal(ours[1, 1][mask[1]], ours[1, 0][mask[1]])
    # hand-worked: the first image (grid 1x8x4, merged 4x2) starts after `<bos><|user|><|vision_start|>`
    start = 3
    first = ours[0, 1:, mask[0]][:, start : start + 8]
    assert first.tolist() == [[3] * 8, [3, 3, 4, 4, 5, 5, 6, 6], [3, 4, 3, 4, 3, 4, 3, 4]]


@pytest.fixture(scope="module")
def tiny_qwen3_vl(tmp_path_factory):
    return make_tiny("tiny-qwen3-vl", str(tmp_path_factory.mktemp("tiny-qwen3-vl")))


def test_qwen3_vl_directory_loads_processor_and_model_offline(tiny_qwen3_vl):
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from verl.utils.tokenizer import hf_processor

    processor = hf_processor(tiny_qwen3_vl)
    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen3_vl)
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert type(processor).__name__ in ("Qwen3VLProcessor", "ImageOnlyQwen3VLProcessor")
    config = model.config
    assert config.text_config.rope_parameters["mrope_interleaved"] is True
    assert (
        config.vision_config.deepstack_visual_indexes == [0, 1] and len(model.model.visual.deepstack_merger_list) == 2
    )
    # the same 40x70 image as tiny-vl's: with 16-pixel patches it resizes to 32x64, a 2x4 grid, merged into 2 tokens
    image = Image.new("RGB", (40, 70), (0, 200, 0))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Color?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 2]]
    assert inputs["pixel_values"].shape == (8, 3 * 2 * 16 * 16)
    # Qwen3-VL normalises to [-1, 1]: (200/255 - 0.5) / 0.5 on the green channel
    assert inputs["pixel_values"].max().item() == pytest.approx(200 / 255 * 2 - 1, abs=1e-6)
    with torch.no_grad():
        logits = model(**inputs).logits
        other = processor(text=[text], images=[Image.new("RGB", (40, 70), (200, 0, 0))], return_tensors="pt")
        assert not torch.allclose(model(**other).logits, logits)
    if type(processor).__name__ == "ImageOnlyQwen3VLProcessor":  # no torchvision here
        with pytest.raises(ValueError, match="torchvision"):
            processor(text=[text], videos=[[image]])


def test_qwen3_vl_mrope_positions_equal_transformers_get_rope_index(tiny_qwen3_vl):
    """Three left-padded rows (two images with text between them; none; one image at the very end of the
    prompt's content) against Qwen3-VL's own `get_rope_index`; the images' grids all differ."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from verl.utils.tokenizer import hf_processor

    processor = hf_processor(tiny_qwen3_vl)
    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen3_vl)
    two = [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}, {"type": "text", "text": "same?"}]
    last = [{"type": "text", "text": "look:"}, {"type": "image"}]
    texts = [
        processor.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False)
        for c in (two, "hi", last)
    ]
    sizes = [(64, 128), (96, 32), (128, 64)]  # (width, height)
    images = [Image.new("RGB", size, (9 * i, 9, 9)) for i, size in enumerate(sizes)]
    processor.tokenizer.padding_side = "left"
    inputs = processor(text=texts, images=images, padding=True, return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 8, 4], [1, 2, 6], [1, 4, 8]]
    ours, expected, mask = _positions(model, inputs)
    assert ours.shape == (3, 4, inputs["input_ids"].shape[1]) and not mask.all()
    for row in range(3):
        assert torch.equal(ours[row, 1:][:, mask[row]], expected[:, row][:, mask[row]])
        assert ours[row, 0][mask[row]].tolist() == list(range(int(mask[row].sum())))
    # hand-worked: row 0's second image (grid 1x2x6, merged 1x3) starts after the first (8 tokens at 3..,
    # advancing max(4, 2) = 4 to 7), `<|vision_end|>and<|vision_start|>` (7..11): at 12
    second = ours[0, 1:, mask[0]][:, 3 + 8 + 5 : 3 + 8 + 5 + 3]
    assert second.tolist() == [[12, 12, 12], [12, 12, 12], [12, 13, 14]]


def test_image_only_processors_pickle_by_name_and_equal_the_processor_they_stand_for(tiny_vl, tiny_qwen3_vl):
    """Datasets holding a processor travel to dataloader workers and Ray actors by pickle; the image-only
    classes are importable from verl.utils.vision, and give the ids and pixels of the directory's processor."""
    import pickle

    from PIL import Image

    import verl.utils.vision as vision
    from verl.utils.tokenizer import hf_processor

    image = Image.new("RGB", (70, 40), (10, 120, 240))
    checked = 0
    for path, name in ((tiny_vl, "ImageOnlyQwen2_5_VLProcessor"), (tiny_qwen3_vl, "ImageOnlyQwen3VLProcessor")):
        processor = hf_processor(path)
        if type(processor).__name__ != name:
            continue  # torchvision is installed: transformers' own processor loaded
        assert getattr(vision, name) is type(processor)
        copy = pickle.loads(pickle.dumps(processor))
        assert type(copy) is type(processor)
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Color?"}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        a, b = (
            processor(text=[text], images=[image], return_tensors="pt"),
            copy(text=[text], images=[image], return_tensors="pt"),
        )
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert copy.vision_start_token_id == processor.tokenizer.convert_tokens_to_ids("<|vision_start|>")
        checked += 1
    if not checked:
        pytest.skip("torchvision is installed: transformers' own processors loaded, no image-only class in use")
    with pytest.raises(AttributeError):
        vision.ImageOnlyGlm4vProcessor  # noqa: B018
