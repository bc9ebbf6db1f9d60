"""Preprocess the MATH dataset (DigitalLearningGmbH/MATH-lighteval) into verl's RL parquet schema.

    python examples/data_preprocess/math_dataset.py --local_dir ~/data/math
    python examples/data_preprocess/math_dataset.py --local_dataset_path /path/to/math_snapshot --local_dir ~/data/math

Without ``--local_dataset_path`` the dataset is downloaded with ``datasets.load_dataset`` (needs the
``datasets`` package and network). With it, the folder must hold the original files of each split,
named ``train*`` / ``test*`` (parquet, JSON or JSON lines with ``problem`` and ``solution`` columns).

Writes ``train.parquet`` and ``test.parquet`` with: data_source "DigitalLearningGmbH/MATH-lighteval",
prompt (the problem and an instruction to put the answer in \\boxed{}), ability "math", reward_model
{style "rule", ground_truth: the content of the solution's last \\boxed{...}}, extra_info {split, index,
level, type}. A solution without a boxed answer cannot be scored and is skipped (reported).
"""

from __future__ import annotations

import argparse
import os

from verl.utils.dataset.files import find_split_files, read_rows, write_parquet
from verl.utils.reward_score.math_reward import extract_answer

DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
SPLITS = ("train", "test")


def make_row(example: dict, split: str, index: int) -> dict | None:
    answer = extract_answer(example["solution"])
    if answer is None:
        return None
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{example['problem']} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "level": example.get("level"), "type": example.get("type")},
    }


def load_split(split: str, local_dataset_path: str | None) -> list[dict]:
    if local_dataset_path:
        files = find_split_files(local_dataset_path, split)
        if not files:
            raise FileNotFoundError(f"no {split}* parquet/JSON file under --local_dataset_path {local_dataset_path!r}")
        return [row for path in files for row in read_rows(path)]
    try:
        import datasets
    except ImportError:
        raise SystemExit(
            "downloading MATH needs the `datasets` package (pip install datasets); or pass --local_dataset_path"
        ) from None
    return list(datasets.load_dataset(DATA_SOURCE, "default", split=split))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_dir", "--local_save_dir", dest="local_dir", default="~/data/math")
    parser.add_argument("--local_dataset_path", default=None, help="folder with the original train*/test* files")
    args = parser.parse_args(argv)

    local_dir = os.path.expanduser(args.local_dir)
    for split in SPLITS:
        examples = load_split(split, args.local_dataset_path)
        rows = [row for i, ex in enumerate(examples) if (row := make_row(ex, split, i)) is not None]
        path = write_parquet(rows, os.path.join(local_dir, f"{split}.parquet"))
        skipped = len(examples) - len(rows)
        print(
            f"wrote {len(rows)} {split} rows to {path}"
            + (f" (skipped {skipped} without a boxed answer)" if skipped else "")
        )


if __name__ == "__main__":
    main()
