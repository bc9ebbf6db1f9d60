"""Pieces shared by the SFT datasets and the SFT trainers: the padding modes, the batch collator, the
`max_samples` row choice and the `data.custom_cls` class lookup (upstream's `verl.utils.dataset.dataset_utils`
names `DatasetPadMode` and `SFTTensorCollator`).

Design decisions:
- `SFTTensorCollator` in `no_padding` mode returns every tensor key as a jagged nested tensor
  (`torch.nested.as_nested_tensor(..., layout=torch.jagged)`, one row per item, no padding) and every
  other value as a tensordict `NonTensorStack`, as upstream does, so code that batches upstream's
  no-padding items keeps working. The padded modes are `torch.utils.data.default_collate`.
- `select_max_samples` picks the rows upstream picks for the same `max_samples`, `shuffle` and `seed`
  (numpy's `default_rng(seed).choice` without replacement, in the order drawn), so a seeded subset is
  the same subset here and there.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

import numpy as np
import torch

from verl.utils.import_utils import load_extern_object


class DatasetPadMode(str, Enum):
    """How an SFT item's sequence is laid out: `right` pads every item to `max_length` (all keys [L]),
    `left_right` is the padded layout of upstream's RL batches (collated the same way), `no_padding`
    returns each item at its own length (collated to nested tensors)."""

    RIGHT = "right"
    LEFT_RIGHT = "left_right"
    NO_PADDING = "no_padding"


class SFTTensorCollator:
    """A DataLoader `collate_fn` for SFT items: `default_collate` for the padded modes; for `no_padding`
    a jagged nested tensor per tensor key and a `NonTensorStack` per other key."""

    def __init__(self, pad_mode: DatasetPadMode | str = DatasetPadMode.LEFT_RIGHT):
        try:
            self.pad_mode = DatasetPadMode(pad_mode)
        except ValueError:
            valid = [mode.value for mode in DatasetPadMode]
            raise ValueError(f"pad_mode={pad_mode!r} is not one of {valid}; set data.pad_mode to one of them") from None

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, Any]:
        if self.pad_mode == DatasetPadMode.NO_PADDING:
            return self.collate_variable_batch(batch)
        return torch.utils.data.default_collate(batch)

    def collate_variable_batch(self, batch: list[dict[str, Any]]) -> dict[str, Any]:
        """Items of different lengths -> {key: nested tensor [B, (L_i), ...] or NonTensorStack of B values}."""
        from tensordict.tensorclass import NonTensorData

        keys = sorted(set().union(*(item.keys() for item in batch)))
        collated: dict[str, Any] = {}
        for key in keys:
            values = [item.get(key) for item in batch]
            if all(isinstance(value, torch.Tensor) for value in values):
                collated[key] = torch.nested.as_nested_tensor(values, layout=torch.jagged)
            else:
                collated[key] = torch.stack([NonTensorData(value) for value in values], dim=0)
        return collated


def select_max_samples(total: int, max_samples: int | None, shuffle: bool = False, seed: int | None = None):
    """Row indices to keep out of `total` for upstream's `max_samples` rule, or None to keep every row:
    a count in (0, total) keeps that many rows, the first ones, or with `shuffle` a seeded random choice
    (unseeded when `seed` is None); -1, 0 or a count >= total keeps everything."""
    if max_samples is None or not 0 < int(max_samples) < total:
        return None
    if not shuffle:
        return list(range(int(max_samples)))
    rng = np.random.default_rng(*(() if seed is None else (int(seed),)))
    return rng.choice(total, size=int(max_samples), replace=False).tolist()


def sft_dataset_class(data_config: Mapping, default: type):
    """The dataset class (or factory) `data.custom_cls.path` / `.name` names in a Python file, called with
    the SFT datasets' keyword arguments; `default` when `data.custom_cls.path` is unset."""
    custom = data_config.get("custom_cls") or {}
    if not custom.get("path"):
        return default
    found = load_extern_object(custom["path"], custom.get("name"), config_key="data.custom_cls")
    if not callable(found):
        raise TypeError(
            f"data.custom_cls.name={custom.get('name')!r} in {custom['path']!r} is a {type(found).__name__}, not a "
            "dataset class; name a class taking (parquet_files, tokenizer, config, max_samples)"
        )
    return found
