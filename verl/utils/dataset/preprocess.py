"""The command line and the input/output shared by the scripts in ``examples/data_preprocess``.

Every script takes upstream's flags: ``--local_save_dir`` (where the parquet files go; ``--local_dir``
is its deprecated alias), ``--local_dataset_path`` (a local copy of the raw dataset) and ``--hdfs_dir``
(copy the written folder there afterwards, through ``verl.utils.fs``, which runs the Hadoop CLI for
``hdfs://`` paths). The raw dataset is read from ``--local_dataset_path`` when given, in the layouts a
downloaded Hugging Face dataset has: a hub snapshot (``data/train-00000-of-00001.parquet``, ``main/test-*``,
``train.jsonl``: any parquet/JSON file whose name starts with the split) or the output of ``datasets``'
``save_to_disk`` (``train/*.arrow``). Only without it is ``datasets.load_dataset`` asked for the hub
dataset, so the scripts run offline once the files are on disk.

Rows are plain Python dicts (torch-free, quick to start); a missing column or split is an error naming
the file set and what was expected, never a silently empty output.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
from collections.abc import Iterable, Mapping

from verl.utils import fs
from verl.utils.dataset.files import find_split_files, read_rows, write_parquet


def add_io_args(
    parser: argparse.ArgumentParser,
    default_save_dir: str,
    local_dataset: bool = True,
    local_dir_deprecated: bool = True,
) -> None:
    """Upstream's flags: --local_save_dir (alias --local_dir), --local_dataset_path, --hdfs_dir.

    ``local_dir_deprecated=False`` for the scripts whose upstream flag is --local_dir itself (no warning)."""
    parser.set_defaults(local_dir_deprecated=local_dir_deprecated)
    parser.add_argument(
        "--local_save_dir", default=default_save_dir, help="folder the preprocessed parquet files are written to"
    )
    parser.add_argument("--local_dir", default=None, help="deprecated name of --local_save_dir")
    if local_dataset:
        parser.add_argument(
            "--local_dataset_path",
            default=None,
            help="local copy of the raw dataset (hub snapshot or save_to_disk folder); without it the "
            "dataset is downloaded with datasets.load_dataset",
        )
    parser.add_argument("--hdfs_dir", default=None, help="also copy the written folder to this (hdfs://) directory")


def save_dir(args: argparse.Namespace) -> str:
    """The output folder: --local_dir if given (with a deprecation warning, as upstream), else --local_save_dir."""
    if args.local_dir is not None:
        if getattr(args, "local_dir_deprecated", True):
            print("Warning: --local_dir is deprecated; use --local_save_dir")
        return os.path.expanduser(args.local_dir)
    return os.path.expanduser(args.local_save_dir)


def _read_arrow(path: str) -> list[dict]:
    import pyarrow as pa

    with open(path, "rb") as f:
        try:
            return pa.ipc.open_stream(f).read_all().to_pylist()  # what datasets' save_to_disk writes
        except pa.ArrowInvalid:
            f.seek(0)
            return pa.ipc.open_file(f).read_all().to_pylist()


KNOWN_SPLITS = ("train", "validation", "valid", "dev", "test", "eval")


def _split_of(name: str) -> str | None:
    """The split a data file's name names, as the hub reads it: "train-0000.parquet", "hellaswag_val.jsonl"."""
    tokens = re.split(r"[-_.]", name.lower())
    aliases = {"val": "validation", "valid": "validation", "dev": "validation"}
    for token in tokens:
        if token in KNOWN_SPLITS or token in aliases:
            return aliases.get(token, token)
    return None


def _local_split_files(root: str, split: str) -> list[str]:
    """Data files of ``split`` under ``root``: named after it (by the hub's conventions); when no file
    names any split (a single-file dataset such as ``data/dapo-math-17k.parquet``), all files are "train"."""
    files = find_split_files(root, split)
    if files:
        return files
    all_files = find_split_files(root, "")
    named = [path for path in all_files if _split_of(os.path.basename(path))]
    if named:
        return [path for path in named if _split_of(os.path.basename(path)) == _split_of(split)]
    return all_files if split == "train" else []


def load_split(
    split: str, local_dataset_path: str | None, hub_name: str, hub_config: str | None = None, **hub_kwargs
) -> list[dict]:
    """The rows of one split: from the local copy when given, else from the Hugging Face hub."""
    if local_dataset_path:
        root = os.path.expanduser(local_dataset_path)
        if hub_config and os.path.isdir(os.path.join(root, hub_config)):
            root = os.path.join(root, hub_config)  # a snapshot with a folder per configuration (gsm8k: main, socratic)
        files = _local_split_files(root, split)
        if files:
            return [row for path in files for row in read_rows(path)]
        arrow = sorted(glob.glob(os.path.join(root, split, "*.arrow")))
        if not arrow:
            raise FileNotFoundError(
                f"no {split}* parquet/JSON file and no {split}/*.arrow under --local_dataset_path {root!r}, so the "
                f"{split!r} split is missing; give a hub snapshot of {hub_name} or the folder datasets' "
                "save_to_disk wrote"
            )
        return [row for path in arrow for row in _read_arrow(path)]
    try:
        import datasets
    except ImportError:
        raise SystemExit(
            f"downloading {hub_name} needs the `datasets` package (pip install datasets) and the Hugging Face hub; "
            "or pass --local_dataset_path with a local copy of the dataset"
        ) from None
    try:
        return list(datasets.load_dataset(hub_name, hub_config, split=split, **hub_kwargs))
    except Exception as e:  # no network, no hub access, ...: say what to do instead
        raise SystemExit(
            f"could not load {hub_name} from the Hugging Face hub ({type(e).__name__}: {e}); download it elsewhere "
            "and pass --local_dataset_path"
        ) from None


def require_columns(example: Mapping, columns: Iterable[str], where: str) -> None:
    """Raise if ``example`` lacks one of ``columns``; ``where`` names the row ("train example 3 of X")."""
    missing = [c for c in columns if c not in example]
    if missing:
        raise KeyError(
            f"{where} has no column(s) {missing} (it has {sorted(example)}); is --local_dataset_path the right dataset?"
        )


def write_splits(
    rows_by_split: Mapping[str, list[dict]], local_save_dir: str, hdfs_dir: str | None = None, allow_empty: bool = False
) -> None:
    """Write ``<split>.parquet`` per split into ``local_save_dir``; then copy that folder to ``hdfs_dir``.

    An empty split is an error unless ``allow_empty``; then its file has no rows and another split's columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = None
    for split, rows in rows_by_split.items():
        if rows:
            schema = schema or pa.Table.from_pylist(rows).schema
        elif not allow_empty:
            raise ValueError(f"the {split} split produced no rows; nothing to write")
    for split, rows in rows_by_split.items():
        if rows:
            path = write_parquet(rows, os.path.join(local_save_dir, f"{split}.parquet"))
        else:
            if schema is None:
                raise ValueError(f"every split ({', '.join(rows_by_split)}) produced no rows; nothing to write")
            path = os.path.join(local_save_dir, f"{split}.parquet")
            os.makedirs(local_save_dir, exist_ok=True)
            pq.write_table(schema.empty_table(), path)
        print(f"wrote {len(rows)} {split} rows to {path}")
    if hdfs_dir is not None:
        if fs.is_non_local(hdfs_dir):
            fs.makedirs(hdfs_dir, exist_ok=True)
            fs.copy(src=local_save_dir, dst=hdfs_dir)
        else:
            shutil.copytree(local_save_dir, os.path.expanduser(hdfs_dir), dirs_exist_ok=True)
        print(f"copied {local_save_dir} to {hdfs_dir}")


def convert_splits(description: str, default_save_dir: str, make_row, load_split, splits, argv=None) -> None:
    """A preprocessing script's whole command line: upstream's flags (`add_io_args`), each split loaded with
    `load_split(split, local_dataset_path)` and converted row by row with `make_row(example, split, index)`,
    then written (`write_splits`)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_io_args(parser, default_save_dir=default_save_dir)
    args = parser.parse_args(argv)
    rows = {
        split: [make_row(ex, split, i) for i, ex in enumerate(load_split(split, args.local_dataset_path))]
        for split in splits
    }
    write_splits(rows, save_dir(args), args.hdfs_dir)
