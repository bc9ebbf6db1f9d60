"""MultiTurnSFTDataset, SFTTensorCollator and create_sft_dataset: loss masks worked out by hand on a
character tokenizer (one token per character), tools and enable_thinking reaching the chat template,
truncation, the per-turn vs whole-conversation check, max_samples and the dataset class choice."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from verl.utils.dataset.dataset_utils import DatasetPadMode, SFTTensorCollator
from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset

# tools render once, before the conversation; enable_thinking=False marks every reply with "~"
# (as Qwen3 writes an empty think block), true or absent leaves replies as they are
TOOLS_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}~{% endif %}{{ m['content'] }}{{ eos_token }}"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# renders only the last reply's content: turns rendered one by one differ from the whole conversation
LAST_REPLY_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>{% if loop.last %}{{ m['content'] }}{% endif %}{{ eos_token }}"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

TWO_TURNS = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "1+1"},
    {"role": "assistant", "content": "2"},
]
THREE_TURNS = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "a"},
    {"role": "assistant", "content": "b"},
    {"role": "user", "content": "cd"},
    {"role": "assistant", "content": "ef"},
    {"role": "user", "content": "g"},
    {"role": "assistant", "content": "hij"},
]
WEATHER = {"type": "function", "function": {"name": "wx", "description": "weather", "parameters": {"type": "object"}}}


@pytest.fixture
def tokenizer(make_tokenizer):
    tokenizer = make_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    return tokenizer


def _write(tmp_path, rows, name="data.parquet"):
    path = str(tmp_path / name)
    pd.DataFrame(rows).to_parquet(path)
    return path


def _tokens(tokenizer, ids):
    return tokenizer.convert_ids_to_tokens(ids.tolist() if isinstance(ids, torch.Tensor) else ids)


def _prefix_mask(tokenizer, messages, **template_kwargs):
    """The expected loss mask by another route: render growing prefixes of the conversation; an assistant
    turn's tokens are what its full prefix adds after the previous prefix plus the generation prompt."""

    def render(msgs, generation):
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=generation, tokenize=False, **template_kwargs)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    mask = []
    for turn, message in enumerate(messages):
        before = len(render(messages[:turn], message["role"] == "assistant")) if turn else 0
        if message["role"] == "assistant":
            mask += [0] * (before - len(mask))
        after = len(render(messages[: turn + 1], False))
        mask += [int(message["role"] == "assistant")] * (after - len(mask))
    return mask


def test_two_turn_loss_mask_covers_each_reply_and_its_eos_by_hand(tmp_path, tokenizer):
    dataset = MultiTurnSFTDataset(_write(tmp_path, [{"messages": TWO_TURNS}]), tokenizer, {"max_length": 24})
    item = dataset[0]
    expected = ["<bos>", "<|user|>", "h", "i", "<|assistant|>", "y", "o", "<eos>"]
    expected += ["<|user|>", "1", "+", "1", "<|assistant|>", "2", "<eos>"]
    assert _tokens(tokenizer, item["input_ids"][:15]) == expected
    assert item["loss_mask"].tolist() == [0] * 5 + [1, 1, 1] + [0] * 5 + [1, 1] + [0] * 9
    assert item["attention_mask"].tolist() == [1] * 15 + [0] * 9
    assert item["position_ids"].tolist() == list(range(15)) + [0] * 9
    assert item["input_ids"][15:].tolist() == [tokenizer.pad_token_id] * 9
    assert all(item[key].dtype == torch.long for key in item)


def test_three_turn_loss_mask_equals_the_prefix_renderings(tmp_path, tokenizer):
    item = MultiTurnSFTDataset(_write(tmp_path, [{"messages": THREE_TURNS}]), tokenizer, {"max_length": 40})[0]
    expected = _prefix_mask(tokenizer, THREE_TURNS)
    assert len(expected) == 22  # 1 + 2 + 2 + 3 + 3 + 4 + 2 + 5
    assert item["loss_mask"].tolist() == expected + [0] * 18
    masked = tokenizer.convert_ids_to_tokens(item["input_ids"][item["loss_mask"].bool()].tolist())
    assert masked == ["b", "<eos>", "e", "f", "<eos>", "h", "i", "j", "<eos>"]


def test_no_padding_items_have_their_own_length_and_no_attention_mask(tmp_path, tokenizer):
    path = _write(tmp_path, [{"messages": TWO_TURNS}, {"messages": THREE_TURNS}])
    dataset = MultiTurnSFTDataset(path, tokenizer, {"pad_mode": "no_padding", "max_length": 64})
    item = dataset[1]
    assert set(item) == {"input_ids", "position_ids", "loss_mask"}
    assert item["loss_mask"].tolist() == _prefix_mask(tokenizer, THREE_TURNS)
    assert item["position_ids"].tolist() == list(range(22))


def test_tools_render_once_before_the_conversation_from_lists_or_json_text(tmp_path, tokenizer):
    rows = [{"messages": TWO_TURNS, "tools": [WEATHER]}, {"messages": TWO_TURNS, "tools": None}]
    as_lists = MultiTurnSFTDataset(_write(tmp_path, rows), tokenizer, {"max_length": 32})
    text_rows = [{"messages": TWO_TURNS, "tools": json.dumps([WEATHER])}, {"messages": TWO_TURNS, "tools": ""}]
    as_text = MultiTurnSFTDataset(_write(tmp_path, text_rows, "text.parquet"), tokenizer, {"max_length": 32})
    for dataset in (as_lists, as_text):
        with_tools, without = dataset[0], dataset[1]
        assert _tokens(tokenizer, with_tools["input_ids"][:6]) == ["<bos>", "<|system|>", "w", "x", ";", "<|user|>"]
        # the 4 tool tokens shift the conversation and are not learned
        assert with_tools["loss_mask"].tolist()[:19] == [0] * 9 + [1, 1, 1] + [0] * 5 + [1, 1]
        assert without["loss_mask"].tolist()[:15] == [0] * 5 + [1, 1, 1] + [0] * 5 + [1, 1]
        assert torch.equal(with_tools["input_ids"][5:19], without["input_ids"][1:15])


def test_a_tools_key_under_multiturn_is_read_and_a_missing_column_means_no_tools(tmp_path, tokenizer):
    path = _write(tmp_path, [{"conv": TWO_TURNS, "fns": [WEATHER]}])
    nested = MultiTurnSFTDataset(path, tokenizer, {"multiturn": {"messages_key": "conv", "tools_key": "fns"}})
    assert nested.tools == [[WEATHER]]
    assert "w" in _tokens(tokenizer, nested[0]["input_ids"][:5])
    top = {"messages_key": "conv", "tools_key": "absent", "multiturn": {"messages_key": "nope", "tools_key": "fns"}}
    assert MultiTurnSFTDataset(path, tokenizer, top).tools is None


def test_malformed_tools_are_a_type_error_naming_the_row(tmp_path, tokenizer):
    path = _write(tmp_path, [{"messages": TWO_TURNS, "tools": json.dumps({"name": "wx"})}])
    with pytest.raises(TypeError, match=r"row 0 .*tools must be a list of OpenAI function schemas"):
        MultiTurnSFTDataset(path, tokenizer, {})


def test_per_row_enable_thinking_reaches_the_template(tmp_path, tokenizer):
    rows = [{"messages": TWO_TURNS, "enable_thinking": flag} for flag in (False, True, None)]
    dataset = MultiTurnSFTDataset(_write(tmp_path, rows), tokenizer, {"max_length": 32})
    off, on, unset = (tokenizer.decode(dataset[i]["input_ids"][dataset[i]["loss_mask"].bool()]) for i in range(3))
    assert (off, on, unset) == ("~yo<eos>~2<eos>", "yo<eos>2<eos>", "yo<eos>2<eos>")
    # a row's flag overrides data.apply_chat_template_kwargs; rows without one keep the config's
    config = {"max_length": 32, "apply_chat_template_kwargs": {"enable_thinking": False}}
    dataset = MultiTurnSFTDataset(_write(tmp_path, rows, "b.parquet"), tokenizer, config)
    assert [int((dataset[i]["input_ids"] == tokenizer.convert_tokens_to_ids("~")).sum()) for i in range(3)] == [2, 0, 2]


def test_enable_thinking_default_applies_to_data_without_the_column(tmp_path, tokenizer):
    path = _write(tmp_path, [{"messages": TWO_TURNS}])
    reply = {}
    for default in ("none", None, False, "false", True):
        item = MultiTurnSFTDataset(path, tokenizer, {"max_length": 32, "enable_thinking_default": default})[0]
        reply[default] = tokenizer.decode(item["input_ids"][item["loss_mask"].bool()])
    assert reply["none"] == reply[None] == reply[True] == "yo<eos>2<eos>"  # no flag, or thinking on
    assert reply[False] == reply["false"] == "~yo<eos>~2<eos>"
    # with the column, the rows' own flags win (a row without one stays unset, as upstream)
    rows = [{"messages": TWO_TURNS, "enable_thinking": flag} for flag in (True, None)]
    config = {"max_length": 32, "enable_thinking_default": False}
    dataset = MultiTurnSFTDataset(_write(tmp_path, rows, "c.parquet"), tokenizer, config)
    assert [tokenizer.decode(dataset[i]["input_ids"][dataset[i]["loss_mask"].bool()]) for i in range(2)] == [
        "yo<eos>2<eos>",
        "yo<eos>2<eos>",
    ]
    with pytest.raises(ValueError, match="enable_thinking_default='maybe' must be none, true or false"):
        MultiTurnSFTDataset(path, tokenizer, {"enable_thinking_default": "maybe"})


def test_truncation_error_left_and_right(tmp_path, tokenizer):
    path = _write(tmp_path, [{"messages": TWO_TURNS}])  # 15 tokens
    with pytest.raises(ValueError, match=r"has 15 tokens, more than data.max_length=6"):
        MultiTurnSFTDataset(path, tokenizer, {"max_length": 6})[0]
    left = MultiTurnSFTDataset(path, tokenizer, {"max_length": 6, "truncation": "left"})[0]
    assert _tokens(tokenizer, left["input_ids"]) == ["1", "+", "1", "<|assistant|>", "2", "<eos>"]
    assert left["loss_mask"].tolist() == [0, 0, 0, 0, 1, 1]
    assert left["position_ids"].tolist() == list(range(9, 15))
    right = MultiTurnSFTDataset(path, tokenizer, {"max_length": 6, "truncation": "right", "pad_mode": "no_padding"})[0]
    assert _tokens(tokenizer, right["input_ids"]) == ["<bos>", "<|user|>", "h", "i", "<|assistant|>", "y"]
    assert right["loss_mask"].tolist() == [0, 0, 0, 0, 0, 1]


def test_turns_that_render_differently_alone_are_an_error_unless_ignored(tmp_path, tokenizer):
    tokenizer.chat_template = LAST_REPLY_TEMPLATE
    path = _write(tmp_path, [{"messages": TWO_TURNS}])
    with pytest.raises(
        ValueError, match=r"renders the conversation's messages one at a time differently.*ignore_input"
    ):
        MultiTurnSFTDataset(path, tokenizer, {"max_length": 32})[0]
    item = MultiTurnSFTDataset(path, tokenizer, {"max_length": 32, "ignore_input_ids_mismatch": True})[0]
    # the per-turn tokens: the first reply keeps its content although the whole rendering drops it
    assert tokenizer.decode(item["input_ids"][item["loss_mask"].bool()]) == "yo<eos>2<eos>"


@pytest.mark.parametrize("shuffle", [False, True])
def test_max_samples_picks_upstreams_rows(tmp_path, tokenizer, shuffle):
    rows = [
        {"messages": [{"role": "user", "content": str(i)}, {"role": "assistant", "content": "x"}]} for i in range(10)
    ]
    dataset = MultiTurnSFTDataset(_write(tmp_path, rows), tokenizer, {"shuffle": shuffle, "seed": 7}, max_samples=3)
    expected = np.random.default_rng(7).choice(10, size=3, replace=False).tolist() if shuffle else [0, 1, 2]
    assert [int(m[0]["content"]) for m in dataset.messages] == expected
    assert len(MultiTurnSFTDataset(_write(tmp_path, rows), tokenizer, {}, max_samples=-1)) == 10


def test_images_are_refused_with_what_to_do_but_empty_lists_are_fine(tmp_path, tokenizer):
    empty = _write(tmp_path, [{"messages": TWO_TURNS, "images": []}], "empty.parquet")
    assert len(MultiTurnSFTDataset(empty, tokenizer, {})) == 1
    path = _write(tmp_path, [{"messages": TWO_TURNS, "images": [{"bytes": b"png", "path": None}]}])
    with pytest.raises(
        ValueError, match=r"row 0 .*'images' holds 1 image\(s\); vision-language SFT is not implemented"
    ):
        MultiTurnSFTDataset(path, tokenizer, {})


def test_tool_calls_survive_and_unknown_pad_modes_are_refused(tmp_path, tokenizer):
    call = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "wx"}}]}
    messages = [TWO_TURNS[0], call, {"role": "tool", "content": "sunny"}, TWO_TURNS[1]]
    dataset = MultiTurnSFTDataset(_write(tmp_path, [{"messages": messages}]), tokenizer, {"max_length": 64})
    assert dataset.messages[0][1]["tool_calls"][0]["function"]["name"] == "wx"
    assert "content" not in dataset.messages[0][1] and "tool_calls" not in dataset.messages[0][0]
    with pytest.raises(ValueError, match=r"data.pad_mode='left_right' is not one of \['right', 'no_padding'\]"):
        MultiTurnSFTDataset(_write(tmp_path, [{"messages": TWO_TURNS}]), tokenizer, {"pad_mode": "left_right"})


def test_tokenizer_may_be_given_as_a_path(tmp_path, tokenizer):
    tokenizer.save_pretrained(str(tmp_path / "tok"))
    path = _write(tmp_path, [{"messages": TWO_TURNS}])
    by_path = MultiTurnSFTDataset(path, str(tmp_path / "tok"), {"max_length": 24})[0]
    assert torch.equal(by_path["input_ids"], MultiTurnSFTDataset(path, tokenizer, {"max_length": 24})[0]["input_ids"])


def test_collator_stacks_padded_items_and_nests_unpadded_ones(tmp_path, tokenizer):
    path = _write(tmp_path, [{"messages": TWO_TURNS}, {"messages": THREE_TURNS}])
    right = MultiTurnSFTDataset(path, tokenizer, {"max_length": 32})
    batch = SFTTensorCollator(DatasetPadMode.RIGHT)([right[0], right[1]])
    assert batch["input_ids"].shape == (2, 32) and torch.equal(batch["loss_mask"][1], right[1]["loss_mask"])

    unpadded = MultiTurnSFTDataset(path, tokenizer, {"max_length": 32, "pad_mode": "no_padding"})
    items = [unpadded[0], {**unpadded[1], "extra": {"k": 1}}]
    items[0]["extra"] = None
    batch = SFTTensorCollator("no_padding")(items)
    assert batch["input_ids"].is_nested and batch["input_ids"].offsets().tolist() == [0, 15, 37]
    assert torch.equal(batch["loss_mask"].values(), torch.cat([unpadded[0]["loss_mask"], unpadded[1]["loss_mask"]]))
    assert batch["extra"].tolist() == [None, {"k": 1}]
    with pytest.raises(ValueError, match=r"pad_mode='middle' is not one of \['right', 'left_right', 'no_padding'\]"):
        SFTTensorCollator("middle")


CUSTOM_DATASET = """
class RecordingDataset:
    def __init__(self, parquet_files, tokenizer, config, max_samples=-1, processor="not passed"):
        self.kwargs = dict(parquet_files=parquet_files, config=config, max_samples=max_samples, processor=processor)

    def __len__(self):
        return 1
"""


def test_create_sft_dataset_loads_a_custom_class_or_picks_the_layout(tmp_path, tokenizer):
    from verl.trainer import fsdp_sft_trainer, sft_trainer
    from verl.utils.dataset.sft_dataset import SFTDataset

    (tmp_path / "my_data.py").write_text(CUSTOM_DATASET)
    path = _write(tmp_path, [{"messages": TWO_TURNS, "prompt": "p", "response": "r"}])
    custom = {"custom_cls": {"path": str(tmp_path / "my_data.py"), "name": "RecordingDataset"}}
    made = fsdp_sft_trainer.create_sft_dataset(path, custom, tokenizer, max_samples=5)
    assert type(made).__name__ == "RecordingDataset"
    assert made.kwargs == {"parquet_files": path, "config": custom, "max_samples": 5, "processor": "not passed"}
    made = sft_trainer.create_sft_dataset(path, custom, tokenizer, processor="P", max_samples=2)
    assert made.kwargs["processor"] == "P" and made.kwargs["max_samples"] == 2

    no_custom = {"custom_cls": {"path": None, "name": None}}
    assert isinstance(fsdp_sft_trainer.create_sft_dataset(path, no_custom, tokenizer), SFTDataset)
    multiturn = {**no_custom, "multiturn": {"enable": True}}
    assert isinstance(fsdp_sft_trainer.create_sft_dataset(path, multiturn, tokenizer), MultiTurnSFTDataset)
    assert isinstance(sft_trainer.create_sft_dataset(path, no_custom, tokenizer, None), MultiTurnSFTDataset)
    with pytest.raises(AttributeError, match=r"data.custom_cls.name='Missing' is not defined.*RecordingDataset"):
        fsdp_sft_trainer.create_sft_dataset(
            path, {"custom_cls": {**custom["custom_cls"], "name": "Missing"}}, tokenizer
        )


def test_sft_dataset_multiturn_layout_gives_multiturn_sft_dataset_items(tmp_path, tokenizer):
    from verl.utils.dataset.sft_dataset import SFTDataset

    path = _write(tmp_path, [{"messages": THREE_TURNS}])
    old = SFTDataset(path, tokenizer, {"multiturn": {"enable": True}, "max_length": 32})[0]
    new = MultiTurnSFTDataset(path, tokenizer, {"max_length": 32})[0]
    for key in ("input_ids", "attention_mask", "loss_mask"):
        assert torch.equal(old[key], new[key]), key


# Qwen2.5's ChatML layout (default system prompt, each turn closed by "<|im_end|>\n")
CHATML_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chatml_loss_mask_holds_each_reply_with_its_im_end_and_newline(tmp_path, make_tokenizer):
    # upstream's expectation for Qwen models: the masked text is exactly each reply, its <|im_end|> and the "\n"
    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML_TEMPLATE
    rows = {
        "messages": [
            [
                {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "2+2 equals 4."},
                {"role": "user", "content": "And what is 4+4?"},
                {"role": "assistant", "content": "4+4 equals 8."},
            ]
        ]
    }
    path = _write(tmp_path, rows)
    for pad_mode in ("no_padding", "right"):
        config = {"max_length": 256, "multiturn": {"messages_key": "messages"}, "pad_mode": pad_mode}
        item = MultiTurnSFTDataset(path, tokenizer, config)[0]
        assert tokenizer.decode(item["input_ids"][item["loss_mask"] == 1]) == (
            "2+2 equals 4.<|im_end|>\n4+4 equals 8.<|im_end|>\n"
        )
        unmasked = tokenizer.decode(item["input_ids"][(item["loss_mask"] == 0) & (item["input_ids"] != 0)])
        assert unmasked == (
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
            "<|im_start|>assistant\n<|im_start|>user\nAnd what is 4+4?<|im_end|>\n<|im_start|>assistant\n"
        )


def test_torchdata_stateful_dataloader_batches_and_resumes_the_dataset(tmp_path, tokenizer):
    # upstream's users load SFT data with torchdata's loader (a base requirement, as upstream's)
    from torchdata.stateful_dataloader import StatefulDataLoader

    rows = {
        "messages": [[{"role": "user", "content": str(i)}, {"role": "assistant", "content": "ok"}] for i in range(6)]
    }
    dataset = MultiTurnSFTDataset(_write(tmp_path, rows), tokenizer, {"max_length": 16})
    loader = StatefulDataLoader(dataset, batch_size=2, shuffle=False)
    it = iter(loader)
    first = next(it)
    assert first["input_ids"].shape == (2, 16) and torch.equal(first["input_ids"][1], dataset[1]["input_ids"])
    state = loader.state_dict()
    rest = [batch["input_ids"] for batch in it]
    resumed = StatefulDataLoader(dataset, batch_size=2, shuffle=False)
    resumed.load_state_dict(state)
    assert [torch.equal(a, b) for a, b in zip(rest, (batch["input_ids"] for batch in resumed), strict=True)] == [
        True,
        True,
    ]
