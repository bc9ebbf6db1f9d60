"""A synthetic vision-language task that needs no download: name the colour of a solid image.

Each row is in upstream verl's multi-modal RL schema (as ``examples/data_preprocess/geo3k.py`` writes):
``data_source="vl_colors"``, ``prompt=[{"role": "user", "content": "<image>Which color: red, green,
blue or yellow?"}]``, ``images=[{"bytes": <PNG>, "path": None}]`` (the layout ``datasets.Image``
stores), ``ability="vision"``, ``reward_model={"style": "rule", "ground_truth": "red"}``,
``extra_info={"split", "index", "answer", "question"}``. The reward is an exact match of the colour
word (``verl/utils/reward_score/vl_colors.py``).

Design decisions:
- The answer is only in the pixels: the question names every candidate colour in the same order for
  every row, so a policy that ignores the image scores ``1 / len(colors)`` at best, and one that
  reads it scores 1. The candidates in the prompt also let a small character-level model learn to
  copy the word instead of spelling it from nothing, which keeps the task within a few dozen CPU
  steps of RL for the tiny-vl preset.
- Images are 56x56 pixels by default, a multiple of Qwen2-VL's 28-pixel merged patch within the
  pixel budget, so the processor does not resize them: 4 image tokens per prompt. Each image's shade
  is jittered per channel (``jitter``, seeded), so no two images are the same array and a model must
  generalise over shades, not memorise bytes.
- ``answer_style="letter"`` asks for the colour's first letter instead ("Which color: r, g, b or
  y?", ground truth "r"). With ``data.max_response_length=1`` the answer is then one token, which a
  randomly initialised policy (the tiny-vl preset is one) samples by chance often enough for RL to
  find it; a whole word is reachable only from a model that already writes words.
- Colours are balanced within each split (row i has colour i mod k before a seeded shuffle); the
  test split uses its own seed stream, so it does not change with the number of training rows.
"""

from __future__ import annotations

import io
import os
import random

DATA_SOURCE = "vl_colors"
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 70),
    "blue": (40, 70, 220),
    "yellow": (230, 200, 40),
}
DEFAULT_NUM_TRAIN = 512
DEFAULT_NUM_TEST = 64
ANSWER_STYLES = ("word", "letter")


def answer(color: str, answer_style: str = "word") -> str:
    """The expected answer for ``color``: the word, or its first letter."""
    return color[0] if answer_style == "letter" else color


def question(colors: tuple[str, ...], answer_style: str = "word") -> str:
    """The prompt text after the image: "Which color: red, green, blue or yellow?" (or "r, g, b or y")."""
    names = [answer(c, answer_style) for c in colors]
    options = ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]
    return f"Which color: {options}?"


def color_png(rgb: tuple[int, int, int], size: int = 56) -> bytes:
    """A solid ``size`` x ``size`` RGB image of colour ``rgb``, PNG-encoded."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (size, size), tuple(int(c) for c in rgb)).save(buffer, format="PNG")
    return buffer.getvalue()


def _check(colors: tuple[str, ...], image_size: int, jitter: int, answer_style: str) -> None:
    unknown = [c for c in colors if c not in COLORS]
    if unknown or len(colors) < 2 or len(set(colors)) != len(colors):
        raise ValueError(f"colors={list(colors)} must be at least two distinct names out of {sorted(COLORS)}")
    if answer_style not in ANSWER_STYLES:
        raise ValueError(f"answer_style={answer_style!r} is not one of {list(ANSWER_STYLES)}")
    if image_size <= 0:
        raise ValueError(f"image_size={image_size} must be a positive number of pixels")
    if not 0 <= jitter <= 30:
        raise ValueError(f"jitter={jitter} must be within 0..30 so the colours stay apart")


def make_vl_colors_rows(
    num: int,
    split: str,
    seed: int = 0,
    colors: tuple[str, ...] = tuple(COLORS),
    image_size: int = 56,
    jitter: int = 20,
    answer_style: str = "word",
) -> list[dict]:
    """``num`` rows of the colour task for ``split`` (module docstring), deterministic in ``seed``."""
    colors = tuple(colors)
    _check(colors, image_size, jitter, answer_style)
    rng = random.Random(f"vl_colors-{seed}-{split}")
    names = [colors[i % len(colors)] for i in range(num)]
    rng.shuffle(names)
    text = question(colors, answer_style)
    rows = []
    for index, name in enumerate(names):
        rgb = tuple(min(255, max(0, c + rng.randint(-jitter, jitter))) for c in COLORS[name])
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"<image>{text}"}],
                "images": [{"bytes": color_png(rgb, image_size), "path": None}],
                "ability": "vision",
                "reward_model": {"style": "rule", "ground_truth": answer(name, answer_style)},
                "extra_info": {"split": split, "index": index, "answer": answer(name, answer_style), "question": text},
            }
        )
    return rows


def write_vl_colors_parquet(
    out_dir: str,
    num_train: int = DEFAULT_NUM_TRAIN,
    num_test: int = DEFAULT_NUM_TEST,
    seed: int = 0,
    colors: tuple[str, ...] = tuple(COLORS),
    image_size: int = 56,
    jitter: int = 20,
    answer_style: str = "word",
) -> tuple[str, str]:
    """Write ``train.parquet`` and ``test.parquet`` of the colour task into ``out_dir``; their paths."""
    from verl.utils.dataset.files import write_parquet

    out_dir = os.path.expanduser(str(out_dir))
    paths = []
    for split, num in (("train", num_train), ("test", num_test)):
        rows = make_vl_colors_rows(num, split, seed, colors, image_size, jitter, answer_style)
        paths.append(write_parquet(rows, os.path.join(out_dir, f"{split}.parquet")))
    return paths[0], paths[1]
