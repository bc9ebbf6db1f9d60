"""Preprocess Anthropic HH-RLHF as released in Dahoas/full-hh-rlhf, for SFT, reward-model or RL training.

    python examples/data_preprocess/full_hh_rlhf.py --split sft --local_save_dir ~/data/full_hh_rlhf
    python examples/data_preprocess/full_hh_rlhf.py --split rm --local_dataset_path /path/to/full-hh-rlhf

The raw "train" split has columns prompt, response, chosen, rejected (``--local_dataset_path``: a hub
snapshot with ``data/train-*.parquet``). ``--split`` picks what is written under
``<local_save_dir>/<split>/``, as upstream:

- ``sft``: ``train.parquet`` with prompt, response; every example twice, with the chosen and then with
  the rejected response.
- ``rm``: ``train.parquet`` (the first 75% of the examples) and ``test.parquet`` (the last 25%) with
  prompt, chosen, rejected; the boundaries are rounded as ``datasets``' "train[:75%]" / "train[-25%:]".
- ``rl``: ``train.parquet`` with data_source "Dahoas/full-hh-rlhf", prompt [user: the prompt], ability
  "alignment", reward_model {style "model", ground_truth: the dataset's response (a reward model
  scores these rows; it is not read)}, extra_info {split "train", index}.
"""

from __future__ import annotations

import argparse
import os

from verl.utils.dataset import preprocess
from verl.utils.dataset.preprocess import require_columns

DATA_SOURCE = "Dahoas/full-hh-rlhf"


def _checked(raw: list[dict], columns: tuple[str, ...]) -> list[dict]:
    for index, example in enumerate(raw):
        require_columns(example, columns, f"train example {index} of {DATA_SOURCE}")
    return raw


def sft_rows(raw: list[dict]) -> dict[str, list[dict]]:
    rows = []
    for example in _checked(raw, ("prompt", "chosen", "rejected")):
        rows.append({"prompt": example["prompt"], "response": example["chosen"]})
        rows.append({"prompt": example["prompt"], "response": example["rejected"]})
    return {"train": rows}


def rm_rows(raw: list[dict]) -> dict[str, list[dict]]:
    pairs = [
        {"prompt": ex["prompt"], "chosen": ex["chosen"], "rejected": ex["rejected"]}
        for ex in _checked(raw, ("prompt", "chosen", "rejected"))
    ]
    num = len(pairs)
    # datasets' percent slices round each boundary to the closest example
    return {"train": pairs[: int(round(num * 75 / 100))], "test": pairs[num - int(round(num * 25 / 100)) :]}


def rl_rows(raw: list[dict]) -> dict[str, list[dict]]:
    rows = [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": example["prompt"]}],
            "ability": "alignment",
            "reward_model": {"style": "model", "ground_truth": example["response"]},
            "extra_info": {"split": "train", "index": index},
        }
        for index, example in enumerate(_checked(raw, ("prompt", "response")))
    ]
    return {"train": rows}


BUILDERS = {"sft": sft_rows, "rm": rm_rows, "rl": rl_rows}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--split", choices=sorted(BUILDERS), required=True, help="which dataset to write")
    preprocess.add_io_args(parser, default_save_dir="~/data/full_hh_rlhf")
    args = parser.parse_args(argv)
    raw = preprocess.load_split("train", args.local_dataset_path, DATA_SOURCE)
    rows = BUILDERS[args.split](raw)
    preprocess.write_splits(rows, os.path.join(preprocess.save_dir(args), args.split), args.hdfs_dir)


if __name__ == "__main__":
    main()
