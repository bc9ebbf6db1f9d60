"""A byte-level, merge-free tokenizer for the tiny models, built locally with `tokenizers`.

Design decisions:
- One token per byte and no BPE merges, so ASCII text is tokenised character by character: the
  tiny model sees `37+48` as five tokens and never has to learn a merge table that splits numbers
  arbitrarily. Every byte has a token, so no input is ever unknown (an accented letter is two
  tokens) and encoding never fails; `<unk>` exists for code that expects one but is never produced.
- The pipeline is exactly Qwen2's (NFC normaliser, Qwen2's split regex, byte-level mapping, a BPE
  model, byte-level decoder). That is deliberate: transformers 5 loads any checkpoint whose model
  type is `qwen2` with its own `Qwen2Tokenizer`, which rebuilds this pipeline from the vocabulary and
  ignores the one in tokenizer.json. Because ours is already that pipeline, the rebuilt tokenizer
  and the saved one agree token for token, in transformers 4.x and 5, in vLLM and in SGLang.
- The vocabulary is assembled, not learned from a corpus, so ids are stable across machines and
  library versions: special tokens first (pad 0, unk 1, bos 2, eos 3, then the role markers), then
  the 256 byte symbols in byte order (about 263 tokens; embedding cost ~34k parameters at hidden 128).
- `reserved_to` pads the vocabulary with `<|reserved_N|>` entries up to a model's embedding size.
  The Qwen2.5-0.5B-shaped benchmark preset uses it to keep Qwen2.5's 151,936-row embedding and LM
  head (the cost that matters in benchmarks) while every id a randomly initialised model samples
  still decodes. Padding only the model config would leave ids that engines cannot detokenise, and a
  BPE trained on a small synthetic corpus would not reach that size.
- Chat template: `<bos>` once, then `<|system|>`/`<|user|>` + content for those turns and
  `<|assistant|>` + content + `<eos>` for assistant turns; the generation prompt is `<|assistant|>`.
  So `[{"role": "user", "content": "What is 37+48?"}]` with a generation prompt renders as
  `<bos><|user|>What is 37+48?<|assistant|>` and the expected completion is `85<eos>`. A `tool`
  message (the result of a tool call, see docs/multi_turn.md) renders as a user turn wrapping its
  content in Hermes-style tags, `<|user|><tool_response>...</tool_response>`, as Qwen2.5's template
  does; no new token is needed, so the ids of every other rendering are unchanged. Every
  rendering of a conversation prefix is a token-prefix of the longer one, which is what the SFT
  dataset relies on to mask the loss to assistant tokens.
"""

from __future__ import annotations

PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
SYSTEM_TOKEN = "<|system|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
SPECIAL_TOKENS = (PAD_TOKEN, UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)
# Qwen2-VL's vision markers, appended after the byte symbols for the vision-language preset only (so
# every other id is the same as the text tokenizer's): an image is `<|vision_start|><|image_pad|>
# <|vision_end|>` in the rendered prompt, and the processor repeats `<|image_pad|>` once per merged patch.
VISION_START_TOKEN = "<|vision_start|>"
VISION_END_TOKEN = "<|vision_end|>"
IMAGE_PAD_TOKEN = "<|image_pad|>"
VIDEO_PAD_TOKEN = "<|video_pad|>"
VISION_TOKENS = (VISION_START_TOKEN, VISION_END_TOKEN, IMAGE_PAD_TOKEN, VIDEO_PAD_TOKEN)

# Qwen2's pre-tokenisation regex: contractions, letter runs, single digits, punctuation runs, spaces.
SPLIT_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>' + message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>' + message['content'] + eos_token }}"
    "{% elif message['role'] == 'tool' %}{{ '<|user|><tool_response>' + message['content'] + '</tool_response>' }}"
    "{% else %}{{ raise_exception('unknown chat role ' + message['role'] + '; use system, user, assistant or tool') }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


# The same template for messages whose content is a list of parts (`{"type": "text", "text": ...}`,
# `{"type": "image"}`, `{"type": "video"}`), as a processor's chat template receives them; a plain
# string content renders exactly as CHAT_TEMPLATE renders it.
VISION_CHAT_TEMPLATE = (
    "{% macro render(content) %}"
    "{% if content is string %}{{ content }}"
    "{% else %}{% for part in content %}"
    "{% if part['type'] == 'image' or 'image' in part %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' or 'video' in part %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endmacro %}"
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>' + render(message['content']) }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>' + render(message['content']) }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>' + render(message['content']) + eos_token }}"
    "{% elif message['role'] == 'tool' %}{{ '<|user|><tool_response>' + render(message['content']) + '</tool_response>' }}"
    "{% else %}{{ raise_exception('unknown chat role ' + message['role'] + '; use system, user, assistant or tool') }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def byte_symbols() -> list[str]:
    """The printable stand-in for each byte value 0..255 used by byte-level BPE (GPT-2 convention):
    printable Latin-1 bytes stand for themselves, the others are shifted to code points from 256."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    symbols, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


def base_vocab_size() -> int:
    """Number of real (non-reserved) tokens: the special tokens plus the 256 byte symbols."""
    return len(SPECIAL_TOKENS) + 256


def build_char_tokenizer(reserved_to: int | None = None, model_max_length: int = 2048, vision: bool = False):
    """The byte-level tokenizer as a `transformers.PreTrainedTokenizerFast`.

    Args:
        reserved_to: pad the vocabulary with reserved tokens up to exactly this many entries
            (at least `base_vocab_size()`); None keeps the base vocabulary.
        model_max_length: the longest sequence the model accepts (its max_position_embeddings).
        vision: add Qwen2-VL's vision markers (`VISION_TOKENS`, after the byte symbols) and render
            list-of-parts message contents (`VISION_CHAT_TEMPLATE`), for the vision-language preset.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    extra_special = list(VISION_TOKENS) if vision else []
    tokens = list(SPECIAL_TOKENS) + byte_symbols() + extra_special
    if reserved_to is not None:
        if reserved_to < len(tokens):
            raise ValueError(
                f"reserved_to={reserved_to} is smaller than the {len(tokens)} real tokens of the tokenizer; "
                f"use None or a value >= {len(tokens)}"
            )
        tokens += [f"<|reserved_{i}|>" for i in range(reserved_to - len(tokens))]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = Tokenizer(
        models.BPE(vocab=vocab, merges=[], continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS) + extra_special)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        additional_special_tokens=[SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, *extra_special],
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )
    tokenizer.chat_template = VISION_CHAT_TEMPLATE if vision else CHAT_TEMPLATE
    return tokenizer


def save_tokenizer(tokenizer, out_dir: str) -> None:
    """`tokenizer.save_pretrained(out_dir)`, rewritten so transformers 4.x (and engines pinned to it,
    such as vLLM) load it too.

    transformers 5 records the class as `TokenizersBackend`, lists extra special tokens under
    `extra_special_tokens` and keeps the chat template in `chat_template.jinja`; 4.x knows none of
    these. The rewritten `tokenizer_config.json` names `PreTrainedTokenizerFast`, uses
    `additional_special_tokens` and carries the template inline, which both major versions read.
    """
    import json
    import os

    tokenizer.save_pretrained(out_dir)
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if isinstance(config.get("extra_special_tokens"), list):
        config["additional_special_tokens"] = config.pop("extra_special_tokens")
    template_path = os.path.join(out_dir, "chat_template.jinja")
    if os.path.exists(template_path):
        with open(template_path) as f:
            config["chat_template"] = f.read()
        os.remove(template_path)
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
