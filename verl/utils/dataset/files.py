"""Data files as plain Python rows: read parquet / JSON / JSON lines, write parquet, find split files.

Kept free of torch so the preprocessing scripts in ``examples/data_preprocess`` start quickly. A
``.json`` file may hold a list of row objects or one object per line (as Hugging Face's json loader
accepts); parquet is read with pyarrow, so struct columns become dicts and list columns lists.
"""

from __future__ import annotations

import json
import os

SUPPORTED_SUFFIXES = (".parquet", ".json", ".jsonl")


def _read_json_rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text.strip():
        return []
    if not path.endswith(".jsonl"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None  # a ".json" file holding JSON lines: parse it line by line below
        if isinstance(data, list):
            return data
        if isinstance(data, dict):
            raise ValueError(
                f"{path}: a JSON data file must hold a list of row objects (or one object per line), "
                "found a single object"
            )
    rows = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {line_number}: not valid JSON ({e})") from None
    return rows


def read_rows(path: str) -> list[dict]:
    """All rows of one parquet / JSON / JSON-lines file as plain Python dicts."""
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"data file {path!r} does not exist (working directory {os.getcwd()!r}); check data.train_files / "
            "data.val_files, or create it with a script in examples/data_preprocess/"
        )
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    elif path.endswith((".json", ".jsonl")):
        rows = _read_json_rows(path)
    else:
        raise ValueError(f"data file {path!r} has an unsupported format; use one of {list(SUPPORTED_SUFFIXES)}")
    bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
    if bad is not None:
        raise TypeError(f"{path}, row {bad}: each row must be an object with named columns, got {type(rows[bad])}")
    return rows


def write_parquet(rows: list[dict], path: str) -> str:
    """Write rows (dicts with the same columns) to a parquet file, creating its directory."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = os.path.expanduser(str(path))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def find_split_files(root: str, split: str) -> list[str]:
    """Data files of one split under ``root``: names starting with the split ("train-00000-of-00001.parquet",
    "test.jsonl"), searched recursively as in a Hugging Face dataset snapshot."""
    root = os.path.expanduser(str(root))
    if not os.path.isdir(root):
        raise FileNotFoundError(
            f"--local_dataset_path {root!r} is not a directory (working directory {os.getcwd()!r}); give the folder "
            "of a downloaded dataset snapshot holding train*/test* parquet or JSON files"
        )
    found = []
    for directory, _, names in os.walk(root):
        found.extend(
            os.path.join(directory, name)
            for name in names
            if name.startswith(split) and name.endswith(SUPPORTED_SUFFIXES)
        )
    return sorted(found)
