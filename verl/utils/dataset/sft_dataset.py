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
    Upstream's trainers build `MultiTurnSFTDataset` (multiturn_sft_dataset.py) for this layout; both
    tokenise conversations with `ConversationTokenizer`, so their items are the same.
- `ConversationTokenizer` tokenises a conversation as upstream's `MultiTurnSFTDataset` does: each
  message rendered on its own with the tokenizer's chat template (the template's default system
  prompt cut from every message after the first), the assistant messages' tokens after the
  generation prompt (the assistant header) loss-masked, so the mask covers each reply, its
  end-of-turn token and whatever the template renders after it up to the next message (Qwen's
  `<|im_end|>\n`). The concatenation is then checked against the whole conversation rendered at
  once: a template whose turns do not render independently (one that strips earlier turns'
  reasoning, or merges consecutive tool results) is reported instead of silently mis-masked, or with
  `ignore_input_ids_mismatch` logged once and the per-turn tokens used, as upstream does.
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

from verl.utils.chat_template import extract_system_prompt_and_generation
from verl.utils.dataset.dataset_utils import select_max_samples
from verl.utils.logging_utils import get_logger
from verl.utils.tokenizer import hf_tokenizer

logger = get_logger(__name__)

TRUNCATION_MODES = ("error", "left", "right")
ROLES = ("system", "user", "assistant", "tool")  # tool: a tool call's result (multi-turn agents)


class SFTDataset(Dataset):
    """SFT examples from one or more parquet files.

    Args:
        parquet_files: a path or a list of paths.
        tokenizer: a transformers tokenizer with a chat template and an eos token, or its path.
        config: mapping with upstream's `data.*` keys: `prompt_key` (default `prompt`),
            `response_key` (default `response`), `prompt_dict_keys`, `response_dict_keys`,
            `multiturn.enable`, `multiturn.messages_key` (default `messages`), `max_length`
            (default 1024), `truncation` (`error`, `left` or `right`), `apply_chat_template_kwargs`,
            `ignore_input_ids_mismatch` (multi-turn), and `shuffle` / `seed` for the `max_samples` choice.
        max_samples: keep at most this many rows (-1: all; upstream's `data.train_max_samples`).
    """

    def __init__(
        self, parquet_files: str | Sequence[str], tokenizer, config: Mapping | None = None, max_samples: int = -1
    ):
        config = config or {}
        self.tokenizer = tokenizer = load_sft_tokenizer(tokenizer)
        self.max_length, self.truncation = check_length_config(config)
        self.apply_chat_template_kwargs = dict(config.get("apply_chat_template_kwargs") or {})
        multiturn = config.get("multiturn") or {}
        self.multiturn = bool(multiturn.get("enable", False))
        self.files = [parquet_files] if isinstance(parquet_files, str) else list(parquet_files)
        rows, columns = read_sft_rows(self.files, max_samples, config)
        if self.multiturn:
            key = multiturn.get("messages_key", "messages")
            self.conversations = [
                check_conversation(_lookup(row, [key], i, columns, "data.multiturn.messages_key"), i, key, self.files)
                for i, row in enumerate(rows)
            ]
            self.conversation_tokenizer = ConversationTokenizer(
                tokenizer, self.apply_chat_template_kwargs, bool(config.get("ignore_input_ids_mismatch", False))
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
            ids, mask = self.conversation_tokenizer(self.conversations[index], where=f"row {index} of {self.files}")
        else:
            ids, mask = self._tokenize_pair(self.prompts[index], self.responses[index])
        keep = truncation_slice(len(ids), self.max_length, self.truncation, f"row {index} of {self.files}")
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

    def _tokenize_pair(self, prompt: str | list[dict], response: str) -> tuple[list[int], list[int]]:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **self.apply_chat_template_kwargs
        )
        prompt_ids = self._encode(text)
        response_ids = self._encode(response + self.tokenizer.eos_token)
        return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)


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
    checked = []
    for turn, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise TypeError(
                f"row {index}: message {turn} of {key!r} is {_short(message)}; each message must be a dict with "
                f"'role' in {list(ROLES)} and a string 'content'"
            )
        content = message.get("content")
        if isinstance(content, list):
            raise TypeError(
                f"row {index}: message {turn} of {key!r} has a list of content parts ({_short(content)}); "
                "multi-modal messages are not supported (vision-language SFT is not implemented), give the "
                "content as a string"
            )
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            raise TypeError(
                f"row {index}: message {turn} of {key!r} is {_short(message)}; its 'content' must be a string "
                "(or null in an assistant message with 'tool_calls')"
            )
        # parquet gives every message every key its column holds (tool_calls=None on a user message);
        # templates test for a key's presence, so unset keys are dropped
        checked.append({k: v for k, v in message.items() if v is not None})
    return checked


def check_conversation(messages, index: int, key: str, files: list[str]) -> list[dict]:
    """The row's messages, checked (roles, string contents, at least one assistant message)."""
    messages = _check_messages(messages, index, key)
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(
            f"row {index} of {files}: the conversation in {key!r} has no assistant message, so there "
            "is nothing to learn; drop the row or add the assistant reply"
        )
    return messages


class ConversationTokenizer:
    """A conversation -> (token ids, loss mask), turn by turn as upstream's `MultiTurnSFTDataset` does
    (module docstring); `__call__` checks the result against the whole conversation rendered at once.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        chat_template_kwargs: extra arguments for every `apply_chat_template` call
            (upstream's `data.apply_chat_template_kwargs`).
        ignore_mismatch: on a mismatch with the whole rendering, log it once and keep the per-turn
            tokens instead of raising (upstream's `data.ignore_input_ids_mismatch`).
    """

    def __init__(self, tokenizer, chat_template_kwargs: Mapping | None = None, ignore_mismatch: bool = False):
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.ignore_mismatch = bool(ignore_mismatch)
        self.system_prompt, self.generation_prompt = extract_system_prompt_and_generation(tokenizer)
        self._warned = False

    def render(self, messages: list[dict], tools: list[dict] | None = None, enable_thinking=None) -> list[int]:
        kwargs = dict(self.chat_template_kwargs)
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=False, tokenize=False, **kwargs
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def __call__(
        self, messages: list[dict], tools: list[dict] | None = None, enable_thinking=None, where: str = "a row"
    ) -> tuple[list[int], list[int]]:
        ids: list[int] = []
        mask: list[int] = []
        for turn, message in enumerate(messages):
            # the tool schemas render once, with the first message (in the system block for most templates)
            turn_ids = self.render([message], tools if turn == 0 else None, enable_thinking)
            if turn > 0 and message["role"] != "system":
                turn_ids = turn_ids[len(self.system_prompt) :]
            header = len(self.generation_prompt) if message["role"] == "assistant" else len(turn_ids)
            header = min(header, len(turn_ids))
            ids += turn_ids
            mask += [0] * header + [1] * (len(turn_ids) - header)
        whole = self.render(messages, tools, enable_thinking)
        if whole != ids:
            self._mismatch(ids, whole, where)
        return ids, mask

    def _mismatch(self, per_turn: list[int], whole: list[int], where: str) -> None:
        at = next((i for i, (a, b) in enumerate(zip(per_turn, whole)) if a != b), min(len(per_turn), len(whole)))
        show = self.tokenizer.decode
        message = (
            f"{where}: the chat template renders the conversation's messages one at a time differently from the "
            f"whole conversation at once (from token {at}: per turn {show(per_turn[at : at + 12])!r}, whole "
            f"{show(whole[at : at + 12])!r}). The dataset tokenises turn by turn to find the assistant tokens, "
            "so its tokens would not be what the model sees at inference; templates that rewrite earlier turns "
            "(Qwen3 thinking models drop earlier <think> blocks) or merge consecutive messages do this. Use a "
            "template that renders each message on its own, or set data.ignore_input_ids_mismatch=true to "
            "train on the per-turn tokens"
        )
        if not self.ignore_mismatch:
            raise ValueError(message)
        if not self._warned:
            logger.warning("%s (data.ignore_input_ids_mismatch=true: using the per-turn tokens)", message)
            self._warned = True


def load_sft_tokenizer(tokenizer):
    """`tokenizer`, loaded with `hf_tokenizer` when it is a path, checked for a chat template and a pad token."""
    if isinstance(tokenizer, str):
        tokenizer = hf_tokenizer(tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat template, which the SFT datasets use to render prompts and replies; "
            "use an instruct/chat tokenizer or set tokenizer.chat_template before building the dataset"
        )
    if tokenizer.eos_token is None or tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer needs an eos token and a pad token for SFT; set tokenizer.eos_token/pad_token")
    return tokenizer


def check_length_config(config: Mapping) -> tuple[int, str]:
    """(`data.max_length`, `data.truncation`), checked."""
    max_length = int(config.get("max_length", 1024))
    truncation = config.get("truncation", "error")
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"data.truncation={truncation!r} is not one of {list(TRUNCATION_MODES)}")
    if max_length < 2:
        raise ValueError(f"data.max_length={max_length} must be at least 2 tokens")
    return max_length, truncation


def truncation_slice(length: int, max_length: int, truncation: str, where: str) -> slice:
    """The part of a `length`-token sequence to keep under `data.truncation` (raises for `error`)."""
    if length <= max_length:
        return slice(0, length)
    if truncation == "error":
        raise ValueError(
            f"{where} has {length} tokens, more than data.max_length={max_length}; raise data.max_length, or "
            "set data.truncation=left (keep the end) or right (keep the start)"
        )
    return slice(length - max_length, length) if truncation == "left" else slice(0, max_length)


def read_sft_rows(files: list[str], max_samples: int | None, config: Mapping) -> tuple[list[dict], set[str]]:
    """The rows of the parquet `files` (as Python values), cut to `max_samples` as upstream does
    (`config.shuffle` / `config.seed`), and the columns every file has."""
    rows, columns = _read_parquet_rows(files)
    keep = select_max_samples(len(rows), max_samples, bool(config.get("shuffle", False)), config.get("seed"))
    return (rows if keep is None else [rows[i] for i in keep]), columns


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
