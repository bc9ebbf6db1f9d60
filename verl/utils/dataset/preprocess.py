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
import shutil
from collections.abc import Iterable, Mapping

from verl.utils.dataset.files import find_split_files, read_rows, write_parquet


def add_io_args(parser: argparse.ArgumentParser, default_save_dir: str, local_dataset: bool = True) -> None:
    """Upstream's flags: --local_save_dir (alias --local_dir), --local_dataset_path, --hdfs_dir."""
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


def load_split(
    split: str, local_dataset_path: str | None, hub_name: str, hub_config: str | None = None, **hub_kwargs
) -> list[dict]:
    """The rows of one split: from the local copy when given, else from the Hugging Face hub."""
    if local_dataset_path:
        root = os.path.expanduser(local_dataset_path)
        files = find_split_files(root, split)
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
            f"{where} has no column(s) {missing} (it has {sorted(example)}); is --local_dataset_path the "
            "right dataset?"
        )


def write_splits(rows_by_split: Mapping[str, list[dict]], local_save_dir: str, hdfs_dir: str | None = None) -> None:
    """Write ``<split>.parquet`` per split into ``local_save_dir``; then copy that folder to ``hdfs_dir``."""
    for split, rows in rows_by_split.items():
        if not rows:
            raise ValueError(f"the {split} split produced no rows; nothing to write")
        path = write_parquet(rows, os.path.join(local_save_dir, f"{split}.parquet"))
        print(f"wrote {len(rows)} {split} rows to {path}")
    if hdfs_dir is not None:
        from verl.utils import fs

        if fs.is_non_local(hdfs_dir):
            fs.makedirs(hdfs_dir, exist_ok=True)
            fs.copy(src=local_save_dir, dst=hdfs_dir)
        else:
            shutil.copytree(local_save_dir, os.path.expanduser(hdfs_dir), dirs_exist_ok=True)
        print(f"copied {local_save_dir} to {hdfs_dir}")
