"""Preprocess llamafactory/pokemon-gpt4o-captions into image-chat conversations for multi-modal SFT.

    python examples/data_preprocess/pokemon.py --local_save_dir ~/data/pokemon-gpt4o-captions
    python examples/data_preprocess/pokemon.py --local_dataset_path /path/to/pokemon-gpt4o-captions

The raw "train" split has ``conversations`` (ShareGPT turns {from: "human" | "gpt", value}) and
``images``. Each row keeps its other columns and gets ``messages`` (role "user" / "assistant", content)
in place of ``conversations``. 10% of the rows (rounded up) go to ``test.parquet``, the rest to
``train.parquet``; the split is random as upstream's ``train_test_split(test_size=0.1)``, drawn from
``--seed`` here so that it can be repeated.
"""

from __future__ import annotations

import argparse
import math
import random

from verl.utils.dataset import preprocess
from verl.utils.dataset.preprocess import require_columns

DATA_SOURCE = "llamafactory/pokemon-gpt4o-captions"
ROLES = {"human": "user", "gpt": "assistant"}
TEST_FRACTION = 0.1


def make_row(example: dict, index: int) -> dict:
    require_columns(example, ("conversations",), f"train example {index} of {DATA_SOURCE}")
    row = {key: value for key, value in example.items() if key != "conversations"}
    messages = []
    for turn in example["conversations"]:
        if turn.get("from") not in ROLES:
            raise ValueError(
                f"train example {index}: a turn from {turn.get('from')!r}; ShareGPT turns are from one of {sorted(ROLES)}"
            )
        messages.append({"role": ROLES[turn["from"]], "content": turn["value"]})
    row["messages"] = messages
    return row


def split_train_test(rows: list[dict], seed: int) -> dict[str, list[dict]]:
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    num_test = math.ceil(TEST_FRACTION * len(rows))
    if num_test >= len(rows):
        raise ValueError(f"{len(rows)} example(s) cannot be split into train and test; the dataset needs at least 2")
    return {"train": [rows[i] for i in order[num_test:]], "test": [rows[i] for i in order[:num_test]]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    preprocess.add_io_args(parser, default_save_dir="~/data/pokemon-gpt4o-captions")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random train/test split")
    args = parser.parse_args(argv)
    raw = preprocess.load_split("train", args.local_dataset_path, DATA_SOURCE)
    rows = [make_row(example, index) for index, example in enumerate(raw)]
    preprocess.write_splits(split_train_test(rows, args.seed), preprocess.save_dir(args), args.hdfs_dir)


if __name__ == "__main__":
    main()
