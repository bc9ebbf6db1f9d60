"""The bundled arith-tiny checkpoint: present, small, loadable offline, and as accurate as it claims."""

from __future__ import annotations

import json
import os

import pytest

from verl.models import bundled_model_path


def test_bundled_model_path_points_at_a_small_hf_directory():
    path = bundled_model_path()
    assert os.path.basename(path) == "arith-tiny"
    files = set(os.listdir(path))
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "generation_config.json",
        "training_info.json",
    } <= files
    assert os.path.getsize(os.path.join(path, "model.safetensors")) < 8 * 1024 * 1024


def test_unknown_bundled_model_lists_the_available_ones():
    with pytest.raises(FileNotFoundError, match=r"bundled models: \[.*'arith-tiny'"):
        bundled_model_path("nope")


def test_recorded_heldout_accuracy_is_in_the_rl_starting_band_and_reproduces():
    """Re-measure greedy accuracy on the default task's 500 held-out problems (generated here, not
    read from the asset) and compare with the number the build recorded."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.utils.dataset.arith import evaluate_greedy_accuracy, make_arith_rows

    path = bundled_model_path()
    with open(os.path.join(path, "training_info.json")) as f:
        info = json.load(f)
    assert 0.20 <= info["heldout_greedy_accuracy"] <= 0.50

    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    _, test_rows = make_arith_rows(seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the build measured with one thread; keep the float reductions alike
    try:
        accuracy = evaluate_greedy_accuracy(model, tokenizer, test_rows)
    finally:
        torch.set_num_threads(threads)
    assert accuracy == pytest.approx(info["heldout_greedy_accuracy"], abs=0.01)


def test_bundled_tool_model_renders_tool_turns_and_its_recorded_accuracy_reproduces(tmp_path):
    """arith-tool-tiny (the multi-turn example's model): its tokenizer carries the chat template
    with the tool role, and the greedy accuracy its build recorded is what the agent loop with the
    calculator measures again on the 500 held-out problems."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.models.build_bundled_tool import evaluate_tool_use
    from verl.utils.dataset.arith import load_rows
    from verl.utils.dataset.arith_tool import write_arith_tool_parquet

    path = bundled_model_path("arith-tool-tiny")
    with open(os.path.join(path, "training_info.json")) as f:
        info = json.load(f)
    tokenizer = AutoTokenizer.from_pretrained(path)
    conversation = [
        {"role": "user", "content": "What is 1+2*3?"},
        {"role": "assistant", "content": "<tool_call>{}</tool_call>"},
        {"role": "tool", "content": "7"},
    ]
    rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<eos><|user|><tool_response>7</tool_response><|assistant|>"), rendered

    _, test_path = write_arith_tool_parquet(str(tmp_path))
    rows = load_rows(test_path)
    assert len(rows) == info["heldout"]["problems"] == 500
    model = AutoModelForCausalLM.from_pretrained(path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the build measured
    try:
        result = evaluate_tool_use(model, tokenizer, rows)
    finally:
        torch.set_num_threads(threads)
    assert result["accuracy"] == pytest.approx(info["heldout"]["accuracy"], abs=0.01)
    assert result["tool_use"] >= 0.95
