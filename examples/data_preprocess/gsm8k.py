"""Preprocess GSM8K (openai/gsm8k, config "main") into verl's RL parquet schema.

    python examples/data_preprocess/gsm8k.py --local_dir ~/data/gsm8k
    python examples/data_preprocess/gsm8k.py --local_dataset_path /path/to/gsm8k_snapshot --local_dir ~/data/gsm8k

Without ``--local_dataset_path`` the dataset is downloaded with ``datasets.load_dataset`` (needs the
``datasets`` package and network). With it, the folder must hold the original files of each split,
named ``train*`` / ``test*`` (parquet, JSON or JSON lines with ``question`` and ``answer`` columns),
e.g. a snapshot of the Hugging Face repository (``main/train-00000-of-00001.parquet``).

Writes ``train.parquet`` and ``test.parquet`` with: data_source "openai/gsm8k", prompt (one user
message: the question and an instruction to answer after "####"), ability "math", reward_model
{style "rule", ground_truth: the number after "####" without commas}, extra_info {split, index,
answer, question}.
"""

from __future__ import annotations

import argparse
import os
import re

from verl.utils.dataset.files import find_split_files, read_rows, write_parquet

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SPLITS = ("train", "test")


def extract_solution(answer: str) -> str:
    """The final number of a GSM8K reference answer ("... #### 1,000" -> "1000")."""
    match = re.search(r"#### (-?[0-9.,]+)", answer)
    if match is None:
        raise ValueError(f"GSM8K answer without a '#### <number>' line: {answer[-80:]!r}")
    return match.group(1).replace(",", "")


def make_row(example: dict, split: str, index: int) -> dict:
    question, answer = example["question"], example["answer"]
    try:
        ground_truth = extract_solution(answer)
    except ValueError as e:
        raise ValueError(f"{split} example {index}: {e}") from None
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
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
            "downloading GSM8K needs the `datasets` package (pip install datasets); or pass --local_dataset_path"
        ) from None
    return list(datasets.load_dataset(DATA_SOURCE, "main", split=split))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_dir", "--local_save_dir", dest="local_dir", default="~/data/gsm8k")
    parser.add_argument("--local_dataset_path", default=None, help="folder with the original train*/test* files")
    args = parser.parse_args(argv)

    local_dir = os.path.expanduser(args.local_dir)
    for split in SPLITS:
        rows = [make_row(ex, split, i) for i, ex in enumerate(load_split(split, args.local_dataset_path))]
        path = write_parquet(rows, os.path.join(local_dir, f"{split}.parquet"))
        print(f"wrote {len(rows)} {split} rows to {path}")


if __name__ == "__main__":
    main()
