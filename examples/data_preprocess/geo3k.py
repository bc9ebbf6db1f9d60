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

import argparse
import glob
import io
import os

from verl.utils.dataset.files import find_split_files, read_rows, write_parquet

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


def _read_arrow(path: str) -> list[dict]:
    import pyarrow as pa

    with open(path, "rb") as f:
        try:
            return pa.ipc.open_stream(f).read_all().to_pylist()  # what datasets' save_to_disk writes
        except pa.ArrowInvalid:
            f.seek(0)
            return pa.ipc.open_file(f).read_all().to_pylist()


def load_split(split: str, local_dataset_path: str | None) -> list[dict]:
    if local_dataset_path:
        root = os.path.expanduser(local_dataset_path)
        files = find_split_files(root, split)
        if files:
            return [row for path in files for row in read_rows(path)]
        arrow = sorted(glob.glob(os.path.join(root, split, "*.arrow")))
        if not arrow:
            raise FileNotFoundError(
                f"no {split}* parquet/JSON file and no {split}/*.arrow under --local_dataset_path {root!r}"
            )
        return [row for path in arrow for row in _read_arrow(path)]
    try:
        import datasets
    except ImportError:
        raise SystemExit(
            f"downloading {DATA_SOURCE} needs the `datasets` package (pip install datasets) and the Hugging Face "
            "hub; or pass --local_dataset_path with a local copy of the dataset"
        ) from None
    try:
        return list(datasets.load_dataset(DATA_SOURCE, split=split))
    except Exception as e:  # no network, no hub access, ...: say what to do instead
        raise SystemExit(
            f"could not load {DATA_SOURCE} from the Hugging Face hub ({type(e).__name__}: {e}); download it "
            "elsewhere and pass --local_dataset_path"
        ) from None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_dataset_path", default=None, help="local copy of the raw dataset")
    parser.add_argument("--local_save_dir", default="~/data/geo3k", help="where train/test.parquet are written")
    parser.add_argument("--local_dir", default=None, help="deprecated name of --local_save_dir")
    args = parser.parse_args(argv)

    local_save_dir = args.local_save_dir
    if args.local_dir is not None:
        print("Warning: --local_dir is deprecated; use --local_save_dir")
        local_save_dir = args.local_dir
    local_save_dir = os.path.expanduser(local_save_dir)
    for split in SPLITS:
        rows = [make_row(ex, split, i) for i, ex in enumerate(load_split(split, args.local_dataset_path))]
        path = write_parquet(rows, os.path.join(local_save_dir, f"{split}.parquet"))
        print(f"wrote {len(rows)} {split} rows to {path}")


if __name__ == "__main__":
    main()
