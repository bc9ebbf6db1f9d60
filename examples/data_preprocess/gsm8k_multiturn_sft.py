"""Preprocess GSM8K into chat conversations for multi-turn SFT (``data.multiturn.enable=true``).

    python examples/data_preprocess/gsm8k_multiturn_sft.py --local_save_dir ~/data/gsm8k_sft
    python examples/data_preprocess/gsm8k_multiturn_sft.py --local_dataset_path /path/to/gsm8k

Reads GSM8K as ``gsm8k.py`` does. Writes ``train.parquet``/``test.parquet`` with one column, upstream's
``messages``: [user: the question and the single-turn instruction (answer after "####"), assistant: the
reference solution, ending in "#### <number>"].
"""

from __future__ import annotations

import argparse

from gsm8k import INSTRUCTION, SPLITS, load_split, read_example

from verl.utils.dataset import preprocess


def make_row(example: dict, split: str, index: int) -> dict:
    question, answer, _ = read_example(example, split, index)
    return {
        "messages": [
            {"role": "user", "content": f"{question} {INSTRUCTION}"},
            {"role": "assistant", "content": answer},
        ]
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    preprocess.add_io_args(parser, default_save_dir="~/data/gsm8k_sft")
    args = parser.parse_args(argv)
    rows = {
        split: [make_row(ex, split, i) for i, ex in enumerate(load_split(split, args.local_dataset_path))]
        for split in SPLITS
    }
    preprocess.write_splits(rows, preprocess.save_dir(args), args.hdfs_dir)


if __name__ == "__main__":
    main()
