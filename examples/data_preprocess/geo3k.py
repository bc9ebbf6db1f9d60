"""Preprocess Geometry3K (hiyouga/geometry3k) into verl's multi-modal RL parquet schema.

    python examples/data_preprocess/geo3k.py --local_save_dir ~/data/geo3k
    python examples/data_preprocess/geo3k.py --local_dataset_path /path/to/geometry3k --local_save_dir ~/data/geo3k

Without ``--local_dataset_path`` the dataset is downloaded with ``datasets.load_dataset`` (needs the
``datasets`` package and the Hugging Face hub). With it, the folder is a local copy: a snapshot of the
hub repository (``data/train-00000-of-00001.parquet``, ``data/test-...``; parquet or JSON files named
``train*`` / ``test*``) or the output of ``datasets``' ``save_to_disk`` (``train/*.arrow``, ``test/*.arrow``).
Each example has ``problem`` (text with one ``<image>`` placeholder per image), ``answer`` and ``images``.

Writes ``train.parquet`` and ``test.parquet`` with upstream's rows: data_source "hiyouga/geometry3k",
prompt (one user message: the problem, a space and the instruction to think inside <think> </think>
and put the final answer in \\boxed{}), images (the list of ``{"bytes", "path"}`` images, as
``datasets.Image`` stores them), ability "math", reward_model {style "rule", ground_truth: the
answer}, extra_info {split, index, answer, question}. Scored by ``verl.utils.reward_score.geo3k``.
"""

from __future__ import annotations

import io

from verl.utils.dataset import preprocess
from verl.utils.dataset.preprocess import require_columns

DATA_SOURCE = "hiyouga/geometry3k"
INSTRUCTION = (
    r"You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
    r"The reasoning process MUST BE enclosed within <think> </think> tags. "
    r"The final answer MUST BE put in \boxed{}."
)
SPLITS = ("train", "test")


def _image_record(image) -> dict:
    """An image as parquet stores it: {"bytes", "path"} (a decoded PIL image is PNG-encoded)."""
    if isinstance(image, dict):
        return {"bytes": image.get("bytes"), "path": image.get("path")}
    if hasattr(image, "save"):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return {"bytes": buffer.getvalue(), "path": None}
    raise TypeError(f"an image must be a {{'bytes', 'path'}} dict or a PIL image, got {type(image).__name__}")


def make_row(example: dict, split: str, index: int) -> dict:
    require_columns(example, ("problem", "answer"), f"{split} example {index} of {DATA_SOURCE}")
    problem, answer = example["problem"], example["answer"]
    images = [_image_record(image) for image in example.get("images") or []]
    if problem.count("<image>") != len(images):
        raise ValueError(
            f"{split} example {index}: the problem has {problem.count('<image>')} <image> placeholder(s) but "
            f"{len(images)} image(s); each image needs one <image> in the text"
        )
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": problem + " " + INSTRUCTION}],
        "images": images,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": problem},
    }


def load_split(split: str, local_dataset_path: str | None) -> list[dict]:
    """One split of Geometry3K (a local snapshot or save_to_disk folder, or the hub)."""
    return preprocess.load_split(split, local_dataset_path, DATA_SOURCE)


def main(argv=None) -> None:
    preprocess.convert_splits(__doc__, "~/data/geo3k", make_row, load_split, SPLITS, argv)


if __name__ == "__main__":
    main()
