"""The synthetic colour task: deterministic, balanced, answer only in the pixels, loadable with the
tiny-vl processor."""

import io

import pytest
from PIL import Image

from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.utils.dataset.vl_colors import COLORS, make_vl_colors_rows, write_vl_colors_parquet
from verl.utils.reward_score import default_compute_score


def _nearest_color(png: bytes) -> str:
    pixel = Image.open(io.BytesIO(png)).convert("RGB").getpixel((10, 10))
    return min(COLORS, key=lambda name: sum((a - b) ** 2 for a, b in zip(COLORS[name], pixel, strict=True)))


def test_rows_are_seeded_balanced_and_the_answer_is_in_the_pixels():
    rows = make_vl_colors_rows(40, "train", seed=3)
    assert rows == make_vl_colors_rows(40, "train", seed=3)
    assert rows != make_vl_colors_rows(40, "train", seed=4)
    answers = [r["reward_model"]["ground_truth"] for r in rows]
    assert sorted(answers) == sorted(list(COLORS) * 10)
    # the same question for every row: the image alone tells the colours apart
    assert {r["prompt"][0]["content"] for r in rows} == {"<image>Which color: red, green, blue or yellow?"}
    for row, answer in zip(rows, answers, strict=True):
        (image,) = row["images"]
        assert _nearest_color(image["bytes"]) == answer
        assert Image.open(io.BytesIO(image["bytes"])).size == (56, 56)
        assert row["data_source"] == "vl_colors" and row["extra_info"]["answer"] == answer
    assert len({r["images"][0]["bytes"] for r in rows}) > 30  # shades are jittered
    assert default_compute_score("vl_colors", answers[0], rows[0]["reward_model"]["ground_truth"]) == 1.0


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="at least two distinct names"):
        make_vl_colors_rows(4, "train", colors=("red", "purple"))
    with pytest.raises(ValueError, match="jitter"):
        make_vl_colors_rows(4, "train", jitter=90)


def test_written_parquet_loads_with_the_processor(tmp_path, vl_processor):
    train, test = write_vl_colors_parquet(str(tmp_path), num_train=8, num_test=4, colors=("red", "blue"))
    config = {"max_prompt_length": 40, "filter_overlong_prompts": True, "truncation": "error"}
    dataset = RLHFDataset(train, vl_processor.tokenizer, config, processor=vl_processor)
    assert len(dataset) == 8 and len(RLHFDataset(test, vl_processor.tokenizer, config, processor=vl_processor)) == 4
    item = dataset[0]
    # 56x56: 4 image tokens; "<bos><|user|><|vision_start|>" + 4 + "<|vision_end|>" + the question + "<|assistant|>"
    assert int(item["attention_mask"].sum()) == 3 + 4 + 1 + len("Which color: red or blue?") + 1
    assert item["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert _nearest_color_of_image(item["multi_modal_data"]["images"][0]) == item["reward_model"]["ground_truth"]


def _nearest_color_of_image(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return _nearest_color(buffer.getvalue())


def test_letter_answers():
    rows = make_vl_colors_rows(8, "test", seed=0, answer_style="letter")
    assert {r["prompt"][0]["content"] for r in rows} == {"<image>Which color: r, g, b or y?"}
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        assert truth in "rgby" and len(truth) == 1 and _nearest_color(row["images"][0]["bytes"])[0] == truth
        assert default_compute_score("vl_colors", truth, truth) == 1.0
    with pytest.raises(ValueError, match="answer_style"):
        make_vl_colors_rows(4, "train", answer_style="number")
