"""Upstream's `MultiTurnSFTDataset`: multi-turn conversations from parquet, the loss on every assistant turn.

    MultiTurnSFTDataset(parquet_files, tokenizer, config, processor=None, max_samples=-1)

Each row holds a list of chat messages (`messages_key`), optionally the tool schemas the conversation
may call (`tools_key`: a list of OpenAI function schemas, or that list as a JSON string) and a
per-row `enable_thinking` flag (`enable_thinking_key`), both passed to the chat template. Items:

- `pad_mode=right` (default): `input_ids`, `attention_mask`, `position_ids`, `loss_mask`, each [max_length],
  right-padded (pad token, 0, 0, 0).
- `pad_mode=no_padding`: `input_ids`, `position_ids`, `loss_mask`, each at the sequence's own length
  (batch them with `dataset_utils.SFTTensorCollator("no_padding")`).

`loss_mask[t] == 1` for the tokens of assistant messages after the template's assistant header: the
reply, its end-of-turn token and what the template writes after it (Qwen: `<|im_end|>\\n`), as upstream.
The tokenisation (per turn, checked against the whole conversation; `ignore_input_ids_mismatch`) is
`sft_dataset.ConversationTokenizer`'s, shared with `SFTDataset`'s multi-turn layout.

Config keys (upstream's, `data.*`): `messages_key` ("messages"), `tools_key` ("tools"),
`enable_thinking_key` ("enable_thinking"), `pad_mode`, `max_length` (1024), `truncation`
(error | left | right), `apply_chat_template_kwargs` ({}), `shuffle` / `seed` (the `max_samples`
choice) and `ignore_input_ids_mismatch` (False). The three `*_key`s are read at the top of the data
section (the engine trainer's `sft_trainer_engine.yaml`) or under `multiturn.` (main_sft's
`sft_trainer.yaml`, and upstream releases before the engine trainer); a top-level key wins.

Deliberately different from upstream:
- `data.truncation` applies in both pad modes (upstream's `no_padding` cuts the end whatever it says),
  so the default `error` reports an over-long conversation instead of training on part of it.
- Images and videos are refused, row by row when the dataset is built: vision-language SFT (the
  processor's pixel inputs, Qwen-VL's 3-D rope positions) is not implemented, and training on the
  text alone would teach replies about pictures the model never saw. The `processor` argument is
  accepted for upstream's signature.
- Rows are read with pyarrow into Python values and checked when the dataset is built (roles,
  contents, an assistant turn, the tools' type), so bad data fails with its row number before training.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import torch
from omegaconf import OmegaConf
from torch.utils.data import Dataset

from verl.utils.dataset.dataset_utils import DatasetPadMode
from verl.utils.dataset.sft_dataset import (
    ConversationTokenizer,
    _lookup,
    _short,
    check_conversation,
    check_length_config,
    load_sft_tokenizer,
    read_sft_rows,
    truncation_slice,
)

PAD_MODES = (DatasetPadMode.RIGHT, DatasetPadMode.NO_PADDING)


class MultiTurnSFTDataset(Dataset):
    """Multi-turn SFT conversations from one or more parquet files (module docstring).

    Args:
        parquet_files: a path or a list of paths.
        tokenizer: a transformers tokenizer with a chat template and a pad token, or its path.
        config: the `data` config section (a mapping or DictConfig; keys in the module docstring).
        processor: upstream's multi-modal processor argument; images and videos are refused here.
        max_samples: keep at most this many rows (-1: all), the first ones or a seeded choice with `shuffle`.
    """

    def __init__(
        self,
        parquet_files: str | Sequence[str],
        tokenizer,
        config: Mapping | None = None,
        processor=None,
        max_samples: int = -1,
    ):
        config = config or {}
        pad_mode = config.get("pad_mode", DatasetPadMode.RIGHT.value)
        if pad_mode not in [mode.value for mode in PAD_MODES]:
            raise ValueError(
                f"data.pad_mode={pad_mode!r} is not one of {[mode.value for mode in PAD_MODES]} for "
                "MultiTurnSFTDataset; set data.pad_mode=right or no_padding"
            )
        self.pad_mode = DatasetPadMode(pad_mode)
        self.max_length, self.truncation = check_length_config(config)
        self.messages_key, messages_option = _multiturn_key(config, "messages_key", "messages")
        self.tools_key, _ = _multiturn_key(config, "tools_key", "tools")
        self.enable_thinking_key, _ = _multiturn_key(config, "enable_thinking_key", "enable_thinking")
        self.enable_thinking_default = _thinking_default(config.get("enable_thinking_default"))
        self.image_key = config.get("image_key", "images")
        self.video_key = config.get("video_key", "videos")
        self.apply_chat_template_kwargs = _plain(config.get("apply_chat_template_kwargs")) or {}
        self.shuffle = bool(config.get("shuffle", False))
        self.seed = config.get("seed")
        self.max_samples = max_samples
        self.ignore_input_ids_mismatch = bool(config.get("ignore_input_ids_mismatch", False))
        self.parquet_files = [parquet_files] if isinstance(parquet_files, str) else list(parquet_files)
        self.tokenizer = load_sft_tokenizer(tokenizer)
        self.processor = processor

        rows, columns = read_sft_rows(self.parquet_files, max_samples, config)
        files = self.parquet_files
        self.messages = [
            check_conversation(
                _lookup(row, [self.messages_key], i, columns, messages_option), i, self.messages_key, files
            )
            for i, row in enumerate(rows)
        ]
        self.tools = None
        if self.tools_key in columns:
            self.tools = [
                _check_tools(row[self.tools_key], f"row {i} of {files}", self.tools_key) for i, row in enumerate(rows)
            ]
        self.enable_thinking = None
        if self.enable_thinking_key in columns:
            self.enable_thinking = [
                None if row[self.enable_thinking_key] is None else bool(row[self.enable_thinking_key]) for row in rows
            ]
        for i, row in enumerate(rows):
            _refuse_media(row, {self.image_key: "image", self.video_key: "video"}, f"row {i} of {files}")
        self.conversation_tokenizer = ConversationTokenizer(
            self.tokenizer, self.apply_chat_template_kwargs, self.ignore_input_ids_mismatch
        )

    def __len__(self) -> int:
        return len(self.messages)

    def __getitem__(self, item: int) -> dict[str, torch.Tensor]:
        where = f"row {item} of {self.parquet_files}"
        ids, mask = self.conversation_tokenizer(
            self.messages[item],
            tools=self.tools[item] if self.tools is not None else None,
            enable_thinking=self.enable_thinking[item]
            if self.enable_thinking is not None
            else self.enable_thinking_default,
            where=where,
        )
        # positions count from the conversation's start, so a left-truncated item keeps its tokens' positions
        positions = list(range(len(ids)))
        keep = truncation_slice(len(ids), self.max_length, self.truncation, where)
        ids, mask, positions = ids[keep], mask[keep], positions[keep]
        if self.pad_mode == DatasetPadMode.NO_PADDING:
            return {
                "input_ids": torch.tensor(ids, dtype=torch.long),
                "position_ids": torch.tensor(positions, dtype=torch.long),
                "loss_mask": torch.tensor(mask, dtype=torch.long),
            }
        pad = self.max_length - len(ids)
        return {
            "input_ids": torch.tensor(ids + [self.tokenizer.pad_token_id] * pad, dtype=torch.long),
            "attention_mask": torch.tensor([1] * len(ids) + [0] * pad, dtype=torch.long),
            "position_ids": torch.tensor(positions + [0] * pad, dtype=torch.long),
            "loss_mask": torch.tensor(mask + [0] * pad, dtype=torch.long),
        }


def _plain(value):
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _multiturn_key(config: Mapping, name: str, default: str) -> tuple[str, str]:
    """(the column `name` selects, the option it came from): `data.<name>`, else `data.multiturn.<name>`."""
    if config.get(name) is not None:
        return config[name], f"data.{name}"
    nested = config.get("multiturn") or {}
    if nested.get(name) is not None:
        return nested[name], f"data.multiturn.{name}"
    return default, f"data.{name}"


def _check_tools(tools, where: str, key: str) -> list[dict] | None:
    """A row's tool schemas: a list of dicts (or that list as JSON text), or None for a row without tools."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: column {key!r} holds text that is not JSON ({e}): {_short(tools)}") from None
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise TypeError(
            f"{where}: column {key!r} holds {_short(tools)}; tools must be a list of OpenAI function schemas "
            '({"type": "function", "function": {"name", "description", "parameters"}}), or that list as a JSON string'
        )
    return tools


def _refuse_media(row: dict, kinds: dict[str, str], where: str) -> None:
    for key, kind in kinds.items():
        media = row.get(key)
        if media is not None and len(media) > 0:
            raise ValueError(
                f"{where}: column {key!r} holds {len(media)} {kind}(s); vision-language SFT is not implemented here "
                f"(upstream feeds them through the model's processor), and training on the text alone would teach "
                f"replies about {kind}s the model never sees. Remove the {kind}s from the data (or train with a "
                "text-only conversation set)"
            )


def _thinking_default(value) -> bool | None:
    """`data.enable_thinking_default`: the flag of rows when the data has no `enable_thinking_key` column.
    None or "none" (upstream's YAML default, a string) pass no flag to the template; true/false pass it.
    (Upstream's `bool("none")` would turn thinking on for such rows: the string means "no flag" here.)"""
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("none", "null", ""):
        return None
    if text in ("true", "false"):
        return text == "true"
    raise ValueError(f"data.enable_thinking_default={value!r} must be none, true or false")
