"""Preprocess GSM8K into chat conversations for multi-turn SFT (``data.multiturn.enable=true``).

    python examples/data_preprocess/gsm8k_multiturn_sft.py --local_save_dir ~/data/gsm8k_sft
    python examples/data_preprocess/gsm8k_multiturn_sft.py --local_dataset_path /path/to/gsm8k

Reads GSM8K as ``gsm8k.py`` does. Writes ``train.parquet``/``test.parquet`` with one column, upstream's
``messages``: [user: the question and the single-turn instruction (answer after "####"), assistant: the
reference solution, ending in "#### <number>"].
"""

from __future__ import annotations

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
    preprocess.convert_splits(__doc__, "~/data/gsm8k_sft", make_row, load_split, SPLITS, argv)


if __name__ == "__main__":
    main()
