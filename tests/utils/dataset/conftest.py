"""A real character-level tokenizer (tokenizers WordLevel wrapped as PreTrainedTokenizerFast) with a
chat template, built in memory so the dataset tests run offline in milliseconds."""

import string

import pytest

SPECIALS = ["<pad>", "<unk>", "<bos>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_char_tokenizer(with_pad: bool = True, with_chat_template: bool = True):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {token: i for i, token in enumerate(SPECIALS + chars)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    kwargs = {"unk_token": "<unk>", "bos_token": "<bos>", "eos_token": "<eos>"}
    if with_pad:
        kwargs["pad_token"] = "<pad>"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS[4:]})
    if with_chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="session")
def char_tokenizer():
    return make_char_tokenizer()


@pytest.fixture(scope="session")
def make_tokenizer():
    return make_char_tokenizer


@pytest.fixture(scope="session")
def vl_processor(tmp_path_factory):
    """The tiny-vl preset's processor (transformers' Qwen2.5-VL processor, images only here), loaded
    by `hf_processor` from a directory holding only the tokenizer and processor files."""
    from verl.models.factory import build_tokenizer
    from verl.models.vision import save_processor
    from verl.utils.tokenizer import hf_processor

    out = str(tmp_path_factory.mktemp("tiny-vl-processor"))
    tokenizer = build_tokenizer("tiny-vl")
    tokenizer.save_pretrained(out)
    save_processor(tokenizer, out)
    return hf_processor(out)
