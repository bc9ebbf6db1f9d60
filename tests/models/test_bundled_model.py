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
