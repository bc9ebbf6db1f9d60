"""Supervised fine-tuning data from parquet: prompt/response pairs or multi-turn conversations.

Each item is a dict of 1-D tensors of length `max_length`, right-padded:
`input_ids`, `attention_mask`, `position_ids` and `loss_mask`, where `loss_mask[t] == 1` exactly
when token `t` belongs to an assistant reply (its content and the end-of-turn token the chat
template adds) and must be predicted from the tokens before it. The trainer shifts it by one to
line it up with next-token logits.

Design decisions:
- Two layouts, chosen by config like upstream verl:
  * single turn (default): `prompt_key` and `response_key` name columns; dotted keys reach into
    struct columns (`extra_info.answer`), and upstream's `prompt_dict_keys`/`response_dict_keys`
    descend further. A prompt may be a string (sent as one user message) or already a list of
    chat messages, so the RL parquet's `prompt` column works as is. The response is appended as the
    assistant reply plus the tokenizer's eos token.
  * multi-turn (`multiturn.enable=true`): `multiturn.messages_key` holds a list of
    `{"role", "content"}` messages; the loss covers every assistant message and nothing else.
- Assistant spans are found by rendering each conversation prefix with the tokenizer's own chat
  template and checking that it is a token-prefix of the next, so any template that renders
  prefixes stably works (no per-model role markers hard-coded here); a template that does not is
  reported, not silently mis-masked.
- Every row is validated when the dataset is built (columns exist, types are right, each
  conversation has an assistant turn), so bad data fails before training starts with the row
  number and what to change. Tokenisation happens lazily per item.
- Sequences longer than `max_length` are an error by default (`truncation=error`); `left` keeps
  the end of the sequence, `right` keeps the start.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch
from torch.utils.data import Dataset

TRUNCATION_MODES = ("error", "left", "right")
ROLES = ("system", "user", "assistant", "tool")  # tool: a tool call's result (multi-turn agents)


class SFTDataset(Dataset):
    """SFT examples from one or more parquet files.

    Args:
        parquet_files: a path or a list of paths.
        tokenizer: a transformers tokenizer with a chat template and an eos token.
        config: mapping with upstream's `data.*` keys: `prompt_key` (default `prompt`),
            `response_key` (default `response`), `prompt_dict_keys`, `response_dict_keys`,
            `multiturn.enable`, `multiturn.messages_key` (default `messages`), `max_length`
            (default 1024) and `truncation` (`error`, `left` or `right`).
    """

    def __init__(self, parquet_files: str | Sequence[str], tokenizer, config: Mapping | None = None):
        config = config or {}
        self.tokenizer = tokenizer
        self.max_length = int(config.get("max_length", 1024))
        self.truncation = config.get("truncation", "error")
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation={self.truncation!r} is not one of {list(TRUNCATION_MODES)}")
        if self.max_length < 2:
            raise ValueError(f"data.max_length={self.max_length} must be at least 2 tokens")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat template, which SFTDataset uses to render prompts and replies; "
                "use an instruct/chat tokenizer or set tokenizer.chat_template before building the dataset"
            )
        if tokenizer.eos_token is None or tokenizer.pad_token_id is None:
            raise ValueError(
                "the tokenizer needs an eos token and a pad token for SFT; set tokenizer.eos_token/pad_token"
            )

        multiturn = config.get("multiturn") or {}
        self.multiturn = bool(multiturn.get("enable", False))
        self.files = [parquet_files] if isinstance(parquet_files, str) else list(parquet_files)
        rows, columns = _read_parquet_rows(self.files)
        if self.multiturn:
            key = multiturn.get("messages_key", "messages")
            self.conversations = [
                _check_messages(_lookup(row, [key], i, columns, "data.multiturn.messages_key"), i, key)
                for i, row in enumerate(rows)
            ]
            for i, messages in enumerate(self.conversations):
                if not any(m["role"] == "assistant" for m in messages):
                    raise ValueError(
                        f"row {i} of {self.files}: the conversation in {key!r} has no assistant message, so there "
                        "is nothing to learn; drop the row or add the assistant reply"
                    )
        else:
            prompt_path = _key_path(config.get("prompt_key", "prompt"), config.get("prompt_dict_keys"))
            response_path = _key_path(config.get("response_key", "response"), config.get("response_dict_keys"))
            self.prompts = []
            self.responses = []
            for i, row in enumerate(rows):
                prompt = _lookup(row, prompt_path, i, columns, "data.prompt_key")
                response = _lookup(row, response_path, i, columns, "data.response_key")
                self.prompts.append(_check_prompt(prompt, i, ".".join(prompt_path)))
                if not isinstance(response, str):
                    raise TypeError(
                        f"row {i} of {self.files}: data.response_key={'.'.join(response_path)!r} holds a "
                        f"value of type {type(response).__name__} ({_short(response)}), but SFT needs the reply as text; "
                        "convert that column to strings"
                    )
                self.responses.append(response)

    def __len__(self) -> int:
        return len(self.conversations) if self.multiturn else len(self.prompts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self.multiturn:
            ids, mask = self._tokenize_conversation(self.conversations[index], index)
        else:
            ids, mask = self._tokenize_pair(self.prompts[index], self.responses[index])
        if len(ids) > self.max_length:
            if self.truncation == "error":
                raise ValueError(
                    f"row {index} of {self.files} has {len(ids)} tokens, more than data.max_length="
                    f"{self.max_length}; raise data.max_length, or set data.truncation=left (keep the end) "
                    "or right (keep the start)"
                )
            keep = slice(-self.max_length, None) if self.truncation == "left" else slice(0, self.max_length)
            ids, mask = ids[keep], mask[keep]
        pad = self.max_length - len(ids)
        input_ids = torch.tensor(ids + [self.tokenizer.pad_token_id] * pad, dtype=torch.long)
        attention_mask = torch.tensor([1] * len(ids) + [0] * pad, dtype=torch.long)
        loss_mask = torch.tensor(mask + [0] * pad, dtype=torch.long)
        position_ids = torch.clamp(torch.cumsum(attention_mask, 0) - 1, min=0)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "loss_mask": loss_mask,
        }

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        return self._encode(text)

    def _tokenize_pair(self, prompt: str | list[dict], response: str) -> tuple[list[int], list[int]]:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        prompt_ids = self._render(messages, add_generation_prompt=True)
        response_ids = self._encode(response + self.tokenizer.eos_token)
        return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)

    def _tokenize_conversation(self, messages: list[dict], index: int) -> tuple[list[int], list[int]]:
        ids: list[int] = []
        mask: list[int] = []

        def extend_to(target: list[int], value: int) -> None:
            if target[: len(ids)] != ids:
                raise ValueError(
                    f"row {index}: the chat template does not render conversation prefixes as token prefixes "
                    "of the full conversation, so assistant tokens cannot be located for the loss mask; use a "
                    "template whose rendering only appends as messages are added"
                )
            mask.extend([value] * (len(target) - len(ids)))
            ids.extend(target[len(ids) :])

        for turn, message in enumerate(messages):
            if message["role"] == "assistant":
                extend_to(self._render(messages[:turn], add_generation_prompt=True), 0)
                extend_to(self._render(messages[: turn + 1], add_generation_prompt=False), 1)
            else:
                extend_to(self._render(messages[: turn + 1], add_generation_prompt=False), 0)
        return ids, mask


def _key_path(key: str, dict_keys: Sequence[str] | None) -> list[str]:
    if not isinstance(key, str) or not key:
        raise ValueError(f"a data key must be a non-empty column name, got {key!r}")
    return key.split(".") + list(dict_keys or [])


def _read_parquet_rows(files: list[str]) -> tuple[list[dict], set[str]]:
    import pyarrow.parquet as pq

    if not files:
        raise ValueError("no parquet files given; set data.train_files (and data.val_files) to parquet paths")
    rows: list[dict] = []
    columns: set[str] | None = None
    for path in files:
        path = os.path.expanduser(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"SFT data file {path} does not exist; check data.train_files / data.val_files")
        table = pq.read_table(path)
        if table.num_rows == 0:
            raise ValueError(f"SFT data file {path} has no rows; point the data files at a non-empty parquet file")
        file_columns = set(table.column_names)
        columns = file_columns if columns is None else columns & file_columns
        rows.extend(table.to_pylist())
    return rows, columns or set()


def _lookup(row: dict, path: list[str], index: int, columns: set[str], option: str):
    if path[0] not in columns:
        raise ValueError(
            f"{option}={'.'.join(path)!r}: column {path[0]!r} is not in the data (columns: {sorted(columns)}); "
            f"set {option} to one of them (use dots for fields inside a struct column, e.g. extra_info.answer)"
        )
    value = row[path[0]]
    for depth, key in enumerate(path[1:], start=1):
        if not isinstance(value, dict) or key not in value:
            where = ".".join(path[:depth])
            found = f"a dict with keys {sorted(value)}" if isinstance(value, dict) else f"a {type(value).__name__}"
            raise ValueError(f"row {index}: {option}={'.'.join(path)!r}: {where!r} is {found}, which has no {key!r}")
        value = value[key]
    return value


def _check_prompt(prompt, index: int, key: str):
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return _check_messages(prompt, index, key)
    raise TypeError(
        f"row {index}: data.prompt_key={key!r} holds a value of type {type(prompt).__name__} ({_short(prompt)}); a prompt must be "
        "a string or a list of {'role', 'content'} chat messages"
    )


def _check_messages(messages, index: int, key: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise TypeError(
            f"row {index}: {key!r} holds {_short(messages)}; expected a non-empty list of "
            "{'role': 'user'|'assistant'|'system'|'tool', 'content': str} messages"
        )
    for turn, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or message.get("role") not in ROLES
            or not isinstance(message.get("content"), str)
        ):
            raise TypeError(
                f"row {index}: message {turn} of {key!r} is {_short(message)}; each message must be a dict with "
                f"'role' in {list(ROLES)} and a string 'content'"
            )
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
