"""Prompt dataset for RL: parquet/JSON rows in upstream verl's schema -> left-padded prompt tensors.

Each row holds ``prompt`` (a list of chat messages), ``data_source``, ``ability``, ``reward_model``
({style, ground_truth}) and ``extra_info`` ({split, index, ...}); see ``examples/data_preprocess``.
``RLHFDataset[i]`` renders the messages with the tokenizer's chat template (generation prompt added),
tokenizes without extra special tokens, applies ``truncation`` and left-pads to ``max_prompt_length``.
Every other column passes through untouched, so ``collate_fn`` + ``DataProto.from_single_dict`` carry
them to the reward function.

Design decisions:

- Rows are read once into plain Python dicts (pyarrow for parquet, ``json`` for JSON/JSON lines). No
  ``datasets`` dependency and no cache directory: prompt sets are small, and upstream also reads all
  files into memory. A column missing from some files is None in their rows, so every batch has the
  same keys.
- Subclass hooks, upstream's: ``__init__`` sets ``self.data_files`` (and ``original_data_files``,
  ``config``, ``shuffle``, ``seed``) and calls ``self._read_files_and_tokenize()``, which must set
  ``self.dataframe``: the base sets a list of the files' row dicts; an override may read the files its
  own way and set a ``datasets.Dataset`` (``load_dataset(...)["train"]``, ``.map``,
  ``concatenate_datasets``: verl-recipe's ReTool) or a list of row dicts. Its rows are then what the
  dataset serves, checked like the files' rows, and ``max_samples`` (seeded subset with ``shuffle``) and
  the overlong-prompt check (``filter_overlong_prompts`` / ``truncation="error"``) apply to them
  as to the files' rows. Upstream's base hook does those two inside itself, so there an override that
  does not call them skips them; here the configured checks always hold (running them twice, when an
  override also calls ``maybe_filter_out_long_prompts``, keeps the same rows). Afterwards
  ``self.dataframe`` holds the rows kept (a ``Dataset`` through ``.select``), so ``self.dataframe[i]`` is
  item i's row, as upstream's ``__getitem__`` reads it.
- Mistakes surface when the dataset is built, not at step 500: a missing prompt column, an empty
  file, a prompt that is not a list of ``{"role", "content"}`` messages, and (with
  ``truncation="error"``) an overlong prompt all raise here, naming the file and row. Checking lengths
  up front costs one batched tokenization of the prompt set; it is done only when
  ``filter_overlong_prompts`` is on or ``truncation="error"``.
- Each prompt is rendered and tokenised once, not once per epoch: the ids the length check computes
  at start-up are kept (one int64 array per row), and a row whose ids were not computed there is
  tokenised on its first ``__getitem__`` and kept from then on. The driver draws the next batch while
  every worker waits, so the template and tokeniser work per step was pure idle time for them (~4 ms
  of a ~150 ms CPU step on the default run). The cached ids are the ones the per-row path gives (the
  batched call of a Hugging Face tokenizer encodes each text as the single call does; the tests hold
  both to an independent per-row reference), so items are unchanged. The rendered text is kept only
  when ``return_full_prompt`` asks for it. Each entry also keeps the messages it was computed from and
  is used only while the row's messages still equal them: a subclass that rewrites, filters or
  reorders ``self.rows`` after ``__init__`` (docs/howto.md's custom dataset) gets its own rows
  tokenised, never another row's ids (comparing a few short messages costs about a microsecond). With ``dataloader_num_workers > 0`` the lazily filled
  entries live in each loader worker's copy; the start-up ids are shared by all.
- Each item gets its own copy of the row (a reward function may write into ``extra_info``, and must
  not change what the next epoch reads). The rows are plain JSON-like values (dicts, lists, strings,
  numbers), so ``_copy_row`` copies those directly and hands anything else to ``copy.deepcopy``:
  the same result at a third of ``deepcopy``'s cost (2.7 against 8.1 us for an arith row, under
  load), which was half of a cached item's time.
- A tokenizer without a pad token pads with its eos token (the tokenizer is not modified); the pad
  positions are masked out, so the value does not matter.
- A tokenizer without a chat template is an error by default (a silent fallback would train on a
  format the model never saw). ``data.use_chat_template=False`` opts into joining the message contents
  with newlines instead, for base models prompted with plain text.
- ``max_samples`` (upstream's ``data.train_max_samples``/``val_max_samples``, passed by
  ``create_rl_dataset``) keeps the first N rows, or a seeded random subset when ``data.shuffle`` is on.
- Multi-modal rows (a ``processor`` is given, e.g. ``verl.utils.hf_processor`` of a Qwen2-VL family
  model): the ``<image>`` placeholders of a message's text become ``{"type": "image"}`` parts (upstream's
  rule), one per entry of the row's ``data.image_key`` column, in order; a count mismatch is an error
  naming the row. Images go through ``vision_utils.process_image``, the text through the processor's
  chat template, then the processor expands each image's pad token to its patch count. An item then
  holds the expanded, left-padded ``input_ids``, ``position_ids`` of shape (4, max_prompt_length)
  (``verl.utils.vision.vl_position_ids``: text positions, then M-RoPE's t/h/w), ``raw_prompt_ids``
  with one pad token per image (what vLLM expands itself), ``multi_modal_data`` ``{"images": [...]}``
  and, with ``data.return_multi_modal_inputs`` (default True), ``multi_modal_inputs``
  ``{"pixel_values", "image_grid_thw"}``; a row without images gets empty dicts. The image and video
  columns themselves are not passed on. Lengths (``filter_overlong_prompts``, ``truncation``) count the
  expanded tokens, and a truncation that would remove any vision token is an error, never a prompt
  with half an image. These rows bypass the token cache: pixel values are far larger than ids (a
  cached dataset would hold every image decoded), and the image decoding dominates anyway.
- Videos are refused (a row with a non-empty ``data.video_key`` value or a ``<video>`` placeholder):
  reading frames needs torchvision, which this build does not have. Rows with images but no
  processor (a text-only model) are an error too, rather than silently dropping the images.
"""

from __future__ import annotations

import copy
import os
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from verl.utils.dataset.files import read_rows
from verl.utils.dataset.vision_utils import process_image
from verl.utils.logging_utils import get_logger

logger = get_logger(__name__)

TRUNCATIONS = ("error", "left", "right", "middle")


def collate_fn(data_list: list[dict]) -> dict:
    """Stack the tensor fields of a list of items; every other field becomes a numpy object array [B].

    The result is what ``DataProto.from_single_dict`` takes: tensors go to ``batch``, arrays to
    ``non_tensor_batch``.
    """
    tensors: dict[str, list] = defaultdict(list)
    non_tensors: dict[str, list] = defaultdict(list)
    for item in data_list:
        for key, value in item.items():
            (tensors if isinstance(value, torch.Tensor) else non_tensors)[key].append(value)
    batch: dict[str, Any] = {key: torch.stack(values, dim=0) for key, values in tensors.items()}
    for key, values in non_tensors.items():
        # Fill element by element: np.array(values) would turn equal-length lists into a 2-D array.
        array = np.empty(len(values), dtype=object)
        for i, value in enumerate(values):
            array[i] = value
        batch[key] = array
    return batch


_IMMUTABLE_SCALARS = (str, int, float, bool, bytes, type(None))


def _copy_row(value):
    """A deep copy of a row's value: dicts and lists rebuilt, immutable scalars shared, anything else
    (a tuple, a numpy array, a user's object) through ``copy.deepcopy``."""
    if type(value) is dict:
        return {key: _copy_row(item) for key, item in value.items()}
    if type(value) is list:
        return [_copy_row(item) for item in value]
    if isinstance(value, _IMMUTABLE_SCALARS):
        return value
    return copy.deepcopy(value)


def _messages_key(messages) -> list:
    """A private copy of a prompt's messages to compare the row against later (`_tokenized`)."""
    return [_copy_row(dict(message)) for message in messages]


def _same_messages(cached: list, messages) -> bool:
    """Whether a row's messages still equal the copy its cached ids came from (no copy made)."""
    try:
        return bool(cached == list(messages))
    except ValueError:  # a value whose == is elementwise (a numpy array): treat as changed
        return False


def _to_plain_config(config) -> dict:
    from omegaconf import DictConfig, OmegaConf

    if isinstance(config, DictConfig):
        return OmegaConf.to_container(config, resolve=True)
    if isinstance(config, Mapping):
        return {
            k: OmegaConf.to_container(v, resolve=True) if isinstance(v, DictConfig) else v for k, v in config.items()
        }
    raise TypeError(f"the data config must be a dict or an omegaconf DictConfig, got {type(config).__name__}")


def _check_messages(messages, prompt_key: str, where: str) -> None:
    example = "[{'role': 'user', 'content': 'What is 37+48?'}]"
    if isinstance(messages, str) or not isinstance(messages, Sequence) or len(messages) == 0:
        raise TypeError(
            f"{where}: column {prompt_key!r} must be a non-empty list of chat messages like {example}, "
            f"got {type(messages).__name__} {str(messages)[:80]!r}; rewrite the file with the scripts in "
            "examples/data_preprocess/ or wrap each prompt as a one-message list"
        )
    for message in messages:
        if (
            not isinstance(message, Mapping)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise TypeError(
                f"{where}: every message in column {prompt_key!r} must be a dict with string 'role' and "
                f"'content' keys like {example}, got {str(message)[:80]!r}"
            )


_PLACEHOLDER_RE = re.compile("(<image>|<video>)")


def _processor_token_layout(processor, tokenizer):
    """(the M-RoPE config `vl_position_ids` needs, the ids of the vision tokens) of a Qwen2-VL family
    processor; other processors are refused (their position ids follow other rules)."""
    from types import SimpleNamespace

    image_token_id = getattr(processor, "image_token_id", None)
    merge_size = getattr(getattr(processor, "image_processor", None), "merge_size", None)
    if image_token_id is None or merge_size is None:
        raise NotImplementedError(
            f"multi-modal prompts are supported for Qwen2-VL family processors (an image token and a merge "
            f"size, for M-RoPE positions); {type(processor).__name__} is not one. Use a Qwen2-VL / Qwen2.5-VL "
            "model, or pass processor=None for text prompts"
        )
    video_token_id = getattr(processor, "video_token_id", None)
    config = SimpleNamespace(
        image_token_id=image_token_id,
        video_token_id=video_token_id,
        vision_config=SimpleNamespace(spatial_merge_size=merge_size),
    )
    vision_ids = {image_token_id} | ({video_token_id} if video_token_id is not None else set())
    for token in ("<|vision_start|>", "<|vision_end|>"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is not None and token_id != tokenizer.unk_token_id:
            vision_ids.add(token_id)
    return config, np.asarray(sorted(vision_ids), dtype=np.int64)


def _count_placeholders(messages) -> tuple[int, int]:
    text = "".join(m["content"] for m in messages if isinstance(m.get("content"), str))
    return text.count("<image>"), text.count("<video>")


def _build_messages(messages, num_images: int) -> list[dict]:
    """Copies of the messages with each string content split on ``<image>``/``<video>`` into
    ``{"type": "image"}`` and ``{"type": "text", "text": ...}`` parts (upstream's rule); a row without
    images keeps its plain string contents."""
    messages = [_copy_row(dict(m)) for m in messages]
    if num_images == 0:
        return messages
    for message in messages:
        parts = [piece for piece in _PLACEHOLDER_RE.split(message["content"]) if piece]
        message["content"] = [
            {"type": "image"} if piece == "<image>" else {"type": "text", "text": piece} for piece in parts
        ]
    return messages


class RLHFDataset(Dataset):
    """Prompts for RL rollouts, read from one or many parquet/JSON files (upstream verl's interface).

    Args:
        data_files: a path or a list of paths (``.parquet``, ``.json``, ``.jsonl``); ``~`` is expanded.
        tokenizer: a Hugging Face tokenizer.
        config: the ``data`` section (DictConfig or dict). Keys read: ``prompt_key`` ("prompt"),
            ``max_prompt_length`` (1024), ``filter_overlong_prompts`` (True), ``truncation``
            ("error" | "left" | "right" | "middle"), ``return_raw_chat`` (False), ``return_full_prompt``
            (False), ``apply_chat_template_kwargs`` ({}), ``use_chat_template`` (True), ``shuffle`` and
            ``seed`` (for the ``max_samples`` subset), ``max_samples`` (used when the argument is -1);
            with a processor also ``image_key`` ("images"), ``video_key`` ("videos"),
            ``image_patch_size`` (14) and ``return_multi_modal_inputs`` (True).
        processor: a Qwen2-VL family multi-modal processor (``verl.utils.hf_processor``) for rows with
            images, or None for text prompts.
        max_samples: keep at most this many rows (-1: all).
    """

    def __init__(self, data_files, tokenizer, config, processor=None, max_samples: int = -1):
        config = _to_plain_config(config)
        self.tokenizer = tokenizer
        self.processor = processor
        self.image_key = config.get("image_key", "images")
        self.video_key = config.get("video_key", "videos")
        self.audio_key = config.get("audio_key", "audios")
        self.image_patch_size = int(config.get("image_patch_size", 14))
        self.return_multi_modal_inputs = bool(config.get("return_multi_modal_inputs", True))
        self.prompt_key = config.get("prompt_key", "prompt")
        self.max_prompt_length = int(config.get("max_prompt_length", 1024))
        self.filter_overlong_prompts = bool(config.get("filter_overlong_prompts", True))
        self.truncation = config.get("truncation", "error")
        self.return_raw_chat = bool(config.get("return_raw_chat", False))
        self.return_full_prompt = bool(config.get("return_full_prompt", False))
        self.apply_chat_template_kwargs = dict(config.get("apply_chat_template_kwargs") or {})
        self.use_chat_template = bool(config.get("use_chat_template", True))
        if max_samples is None or max_samples < 0:
            max_samples = config.get("max_samples", -1)
        self.max_samples = -1 if max_samples is None else int(max_samples)

        if self.truncation not in TRUNCATIONS:
            raise ValueError(f"data.truncation={self.truncation!r} is not one of {list(TRUNCATIONS)}")
        if self.max_prompt_length <= 0:
            raise ValueError(
                f"data.max_prompt_length must be a positive number of tokens, got {self.max_prompt_length}"
            )
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if self.pad_token_id is None:
            raise ValueError(
                f"tokenizer {type(tokenizer).__name__} has neither a pad token nor an eos token to pad prompts "
                "with; set tokenizer.pad_token before building the dataset"
            )
        if self.use_chat_template and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r} has no chat "
                "template, so chat-message prompts cannot be rendered; use a tokenizer that has one (an instruct "
                "or chat model), set tokenizer.chat_template, or set data.use_chat_template=False to join the "
                "message contents with newlines"
            )
        self._mrope_config = self._vision_token_ids = None
        if processor is not None:
            self._mrope_config, self._vision_token_ids = _processor_token_layout(processor, tokenizer)
            if not self.use_chat_template:
                raise ValueError(
                    "data.use_chat_template=False joins text prompts with newlines; with a multi-modal processor the "
                    "images are placed by the processor's chat template, so leave data.use_chat_template=True"
                )
            if self.image_patch_size <= 0:
                raise ValueError(
                    f"data.image_patch_size must be a positive number of pixels, got {self.image_patch_size}"
                )

        if isinstance(data_files, str | os.PathLike):
            data_files = [data_files]
        self.data_files = [os.path.expanduser(str(f)) for f in data_files]
        if not self.data_files:
            raise ValueError("RLHFDataset needs at least one data file; data.train_files / data.val_files is empty")
        self.original_data_files = list(self.data_files)
        self.config = config
        self.shuffle = bool(config.get("shuffle", False))
        self.seed = config.get("seed")
        self.dataframe = None
        self._file_rows: tuple[list[dict], list[tuple[str, int]]] | None = None
        self._read_files_and_tokenize()
        self.rows, self._origins = self._rows_of_dataframe()
        self._select_max_samples(self.shuffle, self.seed)
        # Per row: (the messages, their token ids before truncation, the rendered text or None
        # without return_full_prompt); None until computed (module docstring: tokenised once).
        self._prompt_cache: list[tuple[list, np.ndarray, str | None] | None] = [None] * len(self.rows)
        if self.filter_overlong_prompts or self.truncation == "error":
            self._check_lengths()
        self._sync_dataframe()

    # ----------------------------------------------------------------------------------------------
    # loading
    def _read_files_and_tokenize(self) -> None:
        """Upstream's hook: read ``self.data_files`` into ``self.dataframe`` (module docstring, "subclass
        hooks"). Here ``self.dataframe`` is a list of row dicts; an override may set a ``datasets.Dataset``."""
        rows, origins = [], []
        for path in self.data_files:
            file_rows = read_rows(path)
            if not file_rows:
                raise ValueError(f"data file {path!r} has no rows; regenerate it or remove it from the file list")
            self._check_prompt_column(file_rows, f"data file {path!r}")
            rows.extend(file_rows)
            origins.extend((path, i) for i in range(len(file_rows)))
        self.dataframe = rows
        self._file_rows = (rows, origins)

    def _check_prompt_column(self, rows: Sequence[Mapping], where: str) -> None:
        columns = set().union(*(row.keys() for row in rows[:100]))
        if self.prompt_key not in columns:
            raise ValueError(
                f"{where} has no column {self.prompt_key!r} (data.prompt_key); its columns are "
                f"{sorted(columns)}. Set data.prompt_key to the column holding the chat messages"
            )

    def _rows_of_dataframe(self) -> tuple[list[dict], list[tuple[str, int]]]:
        """``self.dataframe`` (the files' rows, or what an override of ``_read_files_and_tokenize`` built)
        as checked row dicts with their origins, every row with the same columns."""
        frame = self.dataframe
        if self._file_rows is not None and frame is self._file_rows[0]:
            rows, origins = self._file_rows
        else:
            where = f"{type(self).__name__}.dataframe (set by _read_files_and_tokenize)"
            if frame is None:
                raise ValueError(
                    f"{type(self).__name__}._read_files_and_tokenize() left self.dataframe unset; it must set it to "
                    "a datasets.Dataset or a list of row dicts (upstream's hook contract)"
                )
            if hasattr(frame, "to_list") and hasattr(frame, "select"):  # a datasets.Dataset
                rows = frame.to_list()
            elif isinstance(frame, list | tuple) and all(isinstance(row, Mapping) for row in frame):
                rows = [dict(row) for row in frame]
            else:
                raise TypeError(
                    f"{where} is a {type(frame).__name__}; it must be a datasets.Dataset or a list of row dicts"
                )
            if not rows:
                raise ValueError(f"{where} has no rows (data files {self.data_files})")
            self._check_prompt_column(rows, where)
            origins = [(where, i) for i in range(len(rows))]
        for row, (path, i) in zip(rows, origins, strict=True):
            _check_messages(row.get(self.prompt_key), self.prompt_key, f"{path}, row {i}")
            self._check_media(row, f"{path}, row {i}")
        self._file_rows = None
        # Files (or JSON rows) may differ in their extra columns; every item must carry the same keys so
        # that a collated batch has one value per row for each of them.
        all_columns = set().union(*(row.keys() for row in rows))
        for row in rows:
            if len(row) != len(all_columns):
                for column in all_columns.difference(row):
                    row[column] = None
        return rows, origins

    def _sync_dataframe(self) -> None:
        """Leave ``self.dataframe`` holding the rows kept (after max_samples and the length filter)."""
        if isinstance(self.dataframe, list):
            self.dataframe = self.rows
        elif hasattr(self.dataframe, "select") and len(self.dataframe) != len(self.rows):
            self.dataframe = self.dataframe.select([i for _, i in self._origins])

    def maybe_filter_out_long_prompts(self, dataframe=None):
        """Upstream's hook: ``dataframe`` (a ``datasets.Dataset`` or a list of row dicts; default
        ``self.dataframe``) without the rows whose rendered prompt is longer than ``data.max_prompt_length``
        tokens, when ``data.filter_overlong_prompts`` is on; unchanged otherwise."""
        dataframe = self.dataframe if dataframe is None else dataframe
        if not self.filter_overlong_prompts:
            return dataframe
        rows = dataframe.to_list() if hasattr(dataframe, "to_list") else list(dataframe)
        lengths, _, _ = self._prompt_lengths([dict(row) for row in rows], [f"row {i}" for i in range(len(rows))])
        keep = [i for i, n in enumerate(lengths) if n <= self.max_prompt_length]
        if hasattr(dataframe, "select"):
            return dataframe.select(keep)
        return [rows[i] for i in keep]

    def _check_media(self, row: dict, where: str) -> None:
        """Refuse what would be silently dropped or fail mid-run: videos, audio, images without a processor,
        and a ``<image>`` placeholder count that differs from the row's number of images."""
        audios = row.get(self.audio_key) if self.audio_key else None
        if audios is not None and len(audios) > 0:
            raise NotImplementedError(
                f"{where}: column {self.audio_key!r} (data.audio_key) holds audio, which is not supported here "
                "(no audio model or processor path); drop the audio from the data"
            )
        images = row.get(self.image_key) if self.image_key else None
        videos = row.get(self.video_key) if self.video_key else None
        if videos is not None and len(videos) > 0:
            raise NotImplementedError(
                f"{where}: column {self.video_key!r} (data.video_key) holds videos, which are not supported here "
                "(reading video frames needs torchvision, not installed); drop the videos from the data"
            )
        num_images = 0 if images is None else len(images)
        if self.processor is None:
            if num_images:
                raise ValueError(
                    f"{where}: column {self.image_key!r} (data.image_key) holds {num_images} image(s) but the "
                    "dataset has no processor (the model is text-only); train a vision-language model "
                    "(its processor is passed as processor=...), or remove the images from the data"
                )
            return
        if isinstance(images, str | bytes | Mapping):
            raise TypeError(
                f"{where}: column {self.image_key!r} must hold a list of images (one per <image> placeholder), "
                f"got a single {type(images).__name__}; wrap it in a list"
            )
        num_image_tags, num_video_tags = _count_placeholders(row[self.prompt_key])
        if num_video_tags:
            raise NotImplementedError(
                f"{where}: the prompt has {num_video_tags} <video> placeholder(s); videos are not supported here "
                "(reading video frames needs torchvision, not installed)"
            )
        if num_image_tags != num_images:
            raise ValueError(
                f"{where}: the prompt has {num_image_tags} <image> placeholder(s) but column {self.image_key!r} "
                f"holds {num_images} image(s); each image needs exactly one <image> in the prompt text, in order"
            )

    def _select_max_samples(self, shuffle: bool, seed) -> None:
        total = len(self.rows)
        if not 0 <= self.max_samples < total:
            return
        if shuffle:
            rng = np.random.default_rng(seed)
            keep = sorted(rng.choice(total, size=self.max_samples, replace=False).tolist())
        else:
            keep = range(self.max_samples)
        self.rows = [self.rows[i] for i in keep]
        self._origins = [self._origins[i] for i in keep]

    def _prompt_lengths(self, rows: list[dict], wheres: list[str]) -> tuple[list[int], list, list[str]]:
        """Each row's prompt length in tokens, and (text models; empty with a processor) the token ids and
        the rendered text they come from. With a processor the length is the expanded one (each image's
        patch tokens included), which needs the images decoded and sized."""
        if self.processor is not None:
            lengths = [len(self._encode_multi_modal(row, where)[3]) for row, where in zip(rows, wheres, strict=True)]
            return lengths, [], []
        texts = [self._render(row[self.prompt_key]) for row in rows]
        all_ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        return [len(ids) for ids in all_ids], all_ids, texts

    def _check_lengths(self) -> None:
        wheres = [f"{path}, row {i}" for path, i in self._origins]
        lengths, all_ids, texts = self._prompt_lengths(self.rows, wheres)
        if self.processor is None:
            self._prompt_cache = [
                (
                    _messages_key(row[self.prompt_key]),
                    np.asarray(ids, dtype=np.int64),
                    text if self.return_full_prompt else None,
                )
                for row, ids, text in zip(self.rows, all_ids, texts, strict=True)
            ]
        too_long = [i for i, n in enumerate(lengths) if n > self.max_prompt_length]
        if not too_long:
            return
        if self.filter_overlong_prompts:
            if len(too_long) == len(self.rows):
                raise ValueError(
                    f"all {len(self.rows)} prompts are longer than data.max_prompt_length={self.max_prompt_length} "
                    f"tokens (the shortest has {min(lengths)}{', image tokens included' if self.processor else ''}); "
                    "raise data.max_prompt_length"
                )
            drop = set(too_long)
            keep = [i for i in range(len(self.rows)) if i not in drop]
            self.rows = [self.rows[i] for i in keep]
            self._origins = [self._origins[i] for i in keep]
            self._prompt_cache = [self._prompt_cache[i] for i in keep]
            logger.warning(
                "dropped %d of %d prompts longer than data.max_prompt_length=%d tokens (filter_overlong_prompts)",
                len(drop),
                len(lengths),
                self.max_prompt_length,
            )
            return
        path, row = self._origins[too_long[0]]
        raise ValueError(
            f"{len(too_long)} prompts are longer than data.max_prompt_length={self.max_prompt_length} tokens"
            f"{' (image tokens included)' if self.processor is not None else ''}, e.g. "
            f"{path}, row {row} with {lengths[too_long[0]]} tokens, and data.truncation='error'. Raise "
            "data.max_prompt_length, set data.filter_overlong_prompts=True to drop them, or set data.truncation "
            "to 'left', 'right' or 'middle'"
        )

    # ----------------------------------------------------------------------------------------------
    # items
    def _render(self, messages) -> str:
        messages = [dict(m) for m in messages]
        if not self.use_chat_template:
            return "\n".join(m["content"] for m in messages)
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **self.apply_chat_template_kwargs
        )

    def _tokenized(self, item: int, messages) -> tuple[np.ndarray, str | None]:
        """(the prompt's token ids before truncation, its rendered text or None), computed once per
        row while the row's messages stay the ones the ids were computed from."""
        cached = self._prompt_cache[item] if item < len(self._prompt_cache) else None
        if (
            cached is not None
            and _same_messages(cached[0], messages)
            and (cached[2] is not None or not self.return_full_prompt)
        ):
            return cached[1], cached[2]
        text = self._render(messages)
        ids = np.asarray(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
        text = text if self.return_full_prompt else None
        if item < len(self._prompt_cache):  # rows appended after __init__ are tokenised every time
            self._prompt_cache[item] = (_messages_key(messages), ids, text)
        return ids, text

    def _truncate(self, ids: np.ndarray, where: str) -> np.ndarray:
        limit = self.max_prompt_length
        if len(ids) <= limit:
            return ids
        if self.truncation == "left":
            return ids[-limit:]
        if self.truncation == "right":
            return ids[:limit]
        if self.truncation == "middle":
            head = limit // 2
            return np.concatenate([ids[:head], ids[len(ids) - (limit - head) :]])
        raise ValueError(
            f"{where}: prompt has {len(ids)} tokens > data.max_prompt_length={limit} and data.truncation='error'"
        )

    # ----------------------------------------------------------------------------------------------
    # multi-modal items
    def _encode_multi_modal(self, row: dict, where: str):
        """(messages with image parts, rendered text, RGB images, expanded ids as int64 array, the
        processor's other outputs) of one row, before truncation."""
        images = (row.get(self.image_key) if self.image_key else None) or []
        try:
            images = [process_image(image, image_patch_size=self.image_patch_size) for image in images]
        except (TypeError, ValueError, OSError) as e:
            raise type(e)(f"{where}: column {self.image_key!r}: {e}") from e
        messages = _build_messages(row[self.prompt_key], len(images))
        text = self.processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **self.apply_chat_template_kwargs
        )
        inputs = dict(self.processor(text=[text], images=images or None, return_tensors="pt"))
        ids = inputs.pop("input_ids")[0].numpy().astype(np.int64)
        for key in ("attention_mask", "mm_token_type_ids", "token_type_ids", "second_per_grid_ts"):
            inputs.pop(key, None)
        return messages, text, images, ids, inputs

    def _truncate_multi_modal(self, ids: np.ndarray, raw_ids: np.ndarray, where: str):
        """Truncate the expanded ids as ``data.truncation`` says and drop the same text tokens from the
        unexpanded ``raw_ids``; removing any vision token is an error."""
        if len(ids) <= self.max_prompt_length:
            return ids, raw_ids
        kept = self._truncate(np.arange(len(ids)), where)
        removed = np.ones(len(ids), dtype=bool)
        removed[kept] = False
        if np.isin(ids[removed], self._vision_token_ids).any():
            raise ValueError(
                f"{where}: the prompt has {len(ids)} tokens with its images' tokens > data.max_prompt_length="
                f"{self.max_prompt_length}, and data.truncation={self.truncation!r} would cut through an image. "
                "Raise data.max_prompt_length, or set data.filter_overlong_prompts=True to drop such prompts"
            )
        # position of each expanded token in the unexpanded ids: a run of image pads is one raw token
        is_pad = ids == self._mrope_config.image_token_id
        continues_run = np.zeros(len(ids), dtype=bool)
        continues_run[1:] = is_pad[1:] & is_pad[:-1]
        raw_index = np.arange(len(ids)) - np.cumsum(continues_run)
        if raw_index[-1] + 1 != len(raw_ids):
            raise RuntimeError(
                f"{where}: the processor's ids ({len(ids)}) do not collapse to the tokenizer's unexpanded ids "
                f"({len(raw_ids)}) by merging runs of image tokens; cannot truncate this prompt consistently"
            )
        return ids[kept], raw_ids[np.unique(raw_index[kept])]

    def _multi_modal_item(self, item: int) -> dict:
        from verl.utils.vision import vl_position_ids

        row = dict(self.rows[item])
        path, file_row = self._origins[item]
        where = f"{path}, row {file_row}"
        messages, text, images, ids, inputs = self._encode_multi_modal(row, where)
        for key in (self.prompt_key, self.image_key, self.video_key):
            row.pop(key, None)
        row = _copy_row(row)
        raw_ids = np.asarray(self.tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)
        ids, raw_ids = self._truncate_multi_modal(ids, raw_ids, where)

        num_pad = self.max_prompt_length - len(ids)
        input_ids = torch.full((self.max_prompt_length,), self.pad_token_id, dtype=torch.long)
        input_ids[num_pad:] = torch.from_numpy(ids)
        attention_mask = torch.zeros(self.max_prompt_length, dtype=torch.long)
        attention_mask[num_pad:] = 1
        grid = inputs.get("image_grid_thw")
        row["input_ids"] = input_ids
        row["attention_mask"] = attention_mask
        row["position_ids"] = vl_position_ids(self._mrope_config, input_ids[None], attention_mask[None], grid)[0]
        row["raw_prompt_ids"] = raw_ids.tolist()
        row["multi_modal_data"] = {"images": images} if images else {}
        if self.return_multi_modal_inputs:
            row["multi_modal_inputs"] = inputs if images else {}
        return self._finish_row(row, item, messages, text)

    def _finish_row(self, row: dict, item: int, messages, text) -> dict:
        """The columns every item ends with: `raw_prompt` / `full_prompts` when asked for, and `index`
        (the row's `extra_info.index`, else its position)."""
        if self.return_raw_chat:
            row["raw_prompt"] = messages
        if self.return_full_prompt:
            row["full_prompts"] = text
        extra_info = row.get("extra_info")
        index = extra_info.get("index") if isinstance(extra_info, Mapping) else None
        row["index"] = item if index is None else index
        return row

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, item: int) -> dict:
        if self.processor is not None:
            return self._multi_modal_item(item)
        row = dict(self.rows[item])
        messages = row.pop(self.prompt_key)
        row = _copy_row(row)
        ids, text = self._tokenized(item, messages)
        path, file_row = self._origins[item]
        ids = self._truncate(ids, f"{path}, row {file_row}")

        num_pad = self.max_prompt_length - len(ids)
        input_ids = torch.full((self.max_prompt_length,), self.pad_token_id, dtype=torch.long)
        input_ids[num_pad:] = torch.from_numpy(ids)
        attention_mask = torch.zeros(self.max_prompt_length, dtype=torch.long)
        attention_mask[num_pad:] = 1
        row["input_ids"] = input_ids
        row["attention_mask"] = attention_mask
        row["position_ids"] = torch.clamp(torch.cumsum(attention_mask, dim=0) - 1, min=0)
        row["raw_prompt_ids"] = ids.tolist()
        return self._finish_row(row, item, _copy_row(messages) if self.return_raw_chat else None, text)


def create_rl_dataset(data_paths, data_config, tokenizer, processor=None, is_train: bool = True) -> Dataset:
    """The RL prompt dataset for ``data.train_files`` (is_train) or ``data.val_files``.

    ``data.custom_cls.path``/``.name`` selects a user Dataset class (same constructor as RLHFDataset);
    ``data.train_max_samples`` / ``data.val_max_samples`` cap the number of rows (-1: all).
    """
    custom = data_config.get("custom_cls") or {}
    dataset_cls = RLHFDataset
    if custom.get("path"):
        from verl.utils.import_utils import load_extern_type

        dataset_cls = load_extern_type(custom["path"], custom.get("name"), config_key="data.custom_cls")
        if not issubclass(dataset_cls, Dataset):
            raise TypeError(
                f"data.custom_cls {custom.get('name')!r} from {custom['path']!r} must be a subclass of "
                "torch.utils.data.Dataset"
            )
    max_samples = data_config.get("train_max_samples" if is_train else "val_max_samples", -1)
    return dataset_cls(
        data_files=data_paths,
        tokenizer=tokenizer,
        config=data_config,
        processor=processor,
        max_samples=-1 if max_samples is None else max_samples,
    )
