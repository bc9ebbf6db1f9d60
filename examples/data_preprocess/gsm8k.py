"""Preprocess GSM8K (openai/gsm8k, config "main") into verl's RL parquet schema.

    python examples/data_preprocess/gsm8k.py --local_save_dir ~/data/gsm8k
    python examples/data_preprocess/gsm8k.py --local_dataset_path /path/to/gsm8k_snapshot --local_save_dir ~/data/gsm8k

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

import re

from verl.utils.dataset import preprocess
from verl.utils.dataset.preprocess import require_columns

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SPLITS = ("train", "test")


def extract_solution(answer: str) -> str:
    """The final number of a GSM8K reference answer ("... #### 1,000" -> "1000")."""
    match = re.search(r"#### (-?[0-9.,]+)", answer)
    if match is None:
        raise ValueError(f"GSM8K answer without a '#### <number>' line: {answer[-80:]!r}")
    return match.group(1).replace(",", "")


def read_example(example: dict, split: str, index: int) -> tuple[str, str, str]:
    """(question, answer, ground truth) of one raw GSM8K example, with clear errors for bad rows."""
    require_columns(example, ("question", "answer"), f"{split} example {index} of {DATA_SOURCE}")
    question, answer = example["question"], example["answer"]
    try:
        return question, answer, extract_solution(answer)
    except ValueError as e:
        raise ValueError(f"{split} example {index}: {e}") from None


def make_row(example: dict, split: str, index: int) -> dict:
    question, answer, ground_truth = read_example(example, split, index)
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def load_split(split: str, local_dataset_path: str | None) -> list[dict]:
    """One split of GSM8K's "main" configuration (a local snapshot, or the hub)."""
    return preprocess.load_split(split, local_dataset_path, DATA_SOURCE, "main")


def main(argv=None) -> None:
    preprocess.convert_splits(__doc__, "~/data/gsm8k", make_row, load_split, SPLITS, argv)


if __name__ == "__main__":
    main()
