"""A real character-level tokenizer and a builder of rollout-shaped DataProto batches
(left-padded prompts, right-padded responses) for the reward manager tests."""

import string

import numpy as np
import pytest
import torch

from verl.protocol import DataProto

SPECIALS = ["<pad>", "<unk>", "<bos>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="session")
def char_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    backend = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(SPECIALS + chars)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS[4:]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture
def make_batch(char_tokenizer):
    """make_batch(responses, ground_truths, data_sources=..., prompt_len=8, response_len=8) -> DataProto.

    Each response string is tokenized as written (write "<eos>" to end it); responses are right-padded
    with pad tokens that the attention mask excludes.
    """

    def build(responses, ground_truths, data_sources=None, prompt_len=8, response_len=8, extra_infos=None):
        tok = char_tokenizer
        n = len(responses)
        data_sources = data_sources or ["arith"] * n
        prompts = torch.full((n, prompt_len), tok.pad_token_id)
        response_ids = torch.full((n, response_len), tok.pad_token_id)
        attention_mask = torch.zeros((n, prompt_len + response_len), dtype=torch.long)
        for i, text in enumerate(responses):
            p = tok("<bos>Q?", add_special_tokens=False)["input_ids"]
            prompts[i, prompt_len - len(p) :] = torch.tensor(p)
            attention_mask[i, prompt_len - len(p) : prompt_len] = 1
            r = tok(text, add_special_tokens=False)["input_ids"] if text else []
            assert len(r) <= response_len, text
            response_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            attention_mask[i, prompt_len : prompt_len + len(r)] = 1
        non_tensors = {
            "data_source": np.array(data_sources, dtype=object),
            "reward_model": np.array([{"style": "rule", "ground_truth": g} for g in ground_truths], dtype=object),
        }
        if extra_infos is not None:
            non_tensors["extra_info"] = np.array(extra_infos, dtype=object)
        return DataProto.from_dict(
            tensors={
                "prompts": prompts,
                "responses": response_ids,
                "input_ids": torch.cat([prompts, response_ids], dim=1),
                "attention_mask": attention_mask,
                "response_mask": attention_mask[:, prompt_len:],
            },
            non_tensors=non_tensors,
        )

    return build
