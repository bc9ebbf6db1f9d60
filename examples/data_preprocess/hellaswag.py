"""Preprocess HellaSwag (Rowan/hellaswag) into multiple-choice rows scored by log-likelihood.

    python examples/data_preprocess/hellaswag.py --local_save_dir ~/data/hellaswag
    python examples/data_preprocess/hellaswag.py --local_dataset_path /path/to/hellaswag

``--local_dataset_path`` holds the raw splits train/validation/test (a hub snapshot's
``data/train-*.parquet``, or the original ``hellaswag_train.jsonl``, ``hellaswag_val.jsonl``,
``hellaswag_test.jsonl``) with columns activity_label, ctx_a, ctx_b, endings, label. Examples without a
label (all of the public test split) are dropped, as upstream.

Writes ``train.parquet``, ``validation.parquet`` and ``test.parquet`` with upstream's rows: data_source
"Rowan/hellaswag", prompt [user: "<activity>: <ctx_a> <Ctx_b>" cleaned of WikiHow markup], ability "nlp",
reward_model {style "model", eval "multiple_choice", ground_truth: the index of the right ending (int),
choices: the cleaned endings}, extra_info {split, index}. ``index`` counts the kept rows.
"""

from __future__ import annotations

import argparse
import re

from verl.utils.dataset import preprocess
from verl.utils.dataset.preprocess import require_columns

DATA_SOURCE = "Rowan/hellaswag"
SPLITS = ("train", "validation", "test")
COLUMNS = ("activity_label", "ctx_a", "ctx_b", "endings", "label")


def clean(text: str) -> str:
    """Drop WikiHow's bracketed markup ("[title]" becomes a sentence break, "[step]" etc. vanish)."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def has_label(example: dict) -> bool:
    return str(example.get("label", "")) != ""


def make_row(example: dict, split: str, index: int) -> dict:
    require_columns(example, COLUMNS, f"{split} example {index} of {DATA_SOURCE}")
    context = example["ctx_a"] + " " + example["ctx_b"].capitalize()
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": clean(example["activity_label"] + ": " + context)}],
        "ability": "nlp",
        "reward_model": {
            "style": "model",
            "eval": "multiple_choice",
            "ground_truth": int(example["label"]),
            "choices": [clean(ending) for ending in example["endings"]],
        },
        "extra_info": {"split": split, "index": index},
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    preprocess.add_io_args(parser, default_save_dir="~/data/hellaswag")
    args = parser.parse_args(argv)
    rows = {}
    for split in SPLITS:
        raw = preprocess.load_split(split, args.local_dataset_path, DATA_SOURCE)
        labelled = [example for example in raw if has_label(example)]
        rows[split] = [make_row(ex, split, i) for i, ex in enumerate(labelled)]
    # The public test split has no labels: its file is empty, as upstream's.
    preprocess.write_splits(rows, preprocess.save_dir(args), args.hdfs_dir, allow_empty=True)


if __name__ == "__main__":
    main()
