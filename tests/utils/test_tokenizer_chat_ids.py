"""hf_tokenizer's apply_chat_template keeps transformers 4's default (a list of ids for tokenize=True), which
upstream's code and its users' reward functions index and send as JSON; the tokenizer otherwise stays what
transformers made: its class name on disk, pickling into another process, return_dict when asked."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import transformers

from verl.models import bundled_model_path
from verl.utils.tokenizer import hf_tokenizer, with_list_chat_ids

CHAT = [{"role": "user", "content": "What is 1+2?"}]


def test_tokenized_chat_is_a_list_equal_to_tokenizing_the_rendered_text():
    tok = hf_tokenizer(bundled_model_path())
    ids = tok.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert isinstance(ids, list) and ids == tok(text, add_special_tokens=False)["input_ids"]
    asked = tok.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True, return_dict=True)
    assert isinstance(asked, transformers.BatchEncoding) and asked["input_ids"] == ids
    json.dumps({"input_ids": ids})  # what FAPO's reward function posts
    assert isinstance(tok, transformers.PreTrainedTokenizerBase) and with_list_chat_ids(tok) is tok


def test_saved_class_name_and_pickling_into_another_process(tmp_path):
    tok = hf_tokenizer(bundled_model_path())
    base = type(tok).__mro__[1]
    tok.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"]
    assert saved == base.__name__  # loads back with plain transformers
    assert type(transformers.AutoTokenizer.from_pretrained(tmp_path)).__name__ == base.__name__
    code = (
        "import pickle, sys\n"
        "tok = pickle.loads(sys.stdin.buffer.read())\n"
        "ids = tok.apply_chat_template([{'role': 'user', 'content': 'What is 1+2?'}], tokenize=True)\n"
        "print(type(ids).__name__, len(ids))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(tok), capture_output=True, check=True)
    expected = len(tok.apply_chat_template(CHAT, tokenize=True))
    assert out.stdout.decode().split() == ["list", str(expected)]
