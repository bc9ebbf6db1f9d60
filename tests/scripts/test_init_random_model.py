"""scripts/init_random_model.py (upstream's command line): a random model of the source's architecture
with the new config's sizes and the source's tokenizer; an existing output is left alone; a changed
model type, a missing input and bad JSON are errors that leave nothing behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl.models import bundled_model_path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "init_random_model.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=REPO)


def write_json(path: Path, value) -> Path:
    path.write_text(json.dumps(value))
    return path


def test_writes_a_smaller_random_model_of_the_same_architecture_with_the_sources_tokenizer(tmp_path):
    source = bundled_model_path("arith-tiny")
    new = write_json(tmp_path / "new.json", {"num_hidden_layers": 2, "intermediate_size": 64})
    out = tmp_path / "models" / "small"
    done = run("--hf_model_path", source, "--new_config_path", str(new), "--output_path", str(out), "--seed", "3")
    assert done.returncode == 0, done.stderr

    model = AutoModelForCausalLM.from_pretrained(out)
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.intermediate_size, cfg.hidden_size) == ("qwen2", 2, 64, 128)
    assert cfg.layer_types == ["full_attention"] * 2  # rebuilt for the new depth
    # hand count: embeddings 263x128 (tied head), per layer q,k,v,o 4x(128x128) + q,k,v biases 3x128,
    # MLP 3x(128x64), two norms 2x128; the final norm 128
    per_layer = 4 * 128 * 128 + 3 * 128 + 3 * 128 * 64 + 2 * 128
    assert sum(p.numel() for p in model.parameters()) == 263 * 128 + 2 * per_layer + 128
    trained = AutoModelForCausalLM.from_pretrained(source)
    assert not torch.equal(model.model.embed_tokens.weight, trained.model.embed_tokens.weight)

    ours, theirs = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(source)
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.chat_template == theirs.chat_template
    assert not list((tmp_path / "models").glob(".init_random_model.*"))  # no staging folder left


def test_the_same_seed_gives_the_same_weights(tmp_path):
    new = write_json(tmp_path / "new.json", {"num_hidden_layers": 1})
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        args = ("--hf_model_path", bundled_model_path(), "--new_config_path", str(new), "--output_path", str(out))
        assert run(*args, "--seed", "7").returncode == 0
    a, b = (AutoModelForCausalLM.from_pretrained(o).state_dict() for o in outs)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_an_existing_output_is_left_alone(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    new = write_json(tmp_path / "new.json", {"num_hidden_layers": 1})
    done = run("--hf_model_path", bundled_model_path(), "--new_config_path", str(new), "--output_path", str(out))
    assert done.returncode == 0
    assert "already exists" in done.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize(
    "new_config, message",
    [
        ({"model_type": "llama"}, "model_type 'llama' differs from the model's 'qwen2'"),
        ("not json", "is not valid JSON"),
        ([1, 2], "must hold a JSON object"),
    ],
)
def test_bad_new_configs_are_errors_that_write_nothing(tmp_path, new_config, message):
    new = tmp_path / "new.json"
    new.write_text(new_config if isinstance(new_config, str) else json.dumps(new_config))
    out = tmp_path / "out"
    done = run("--hf_model_path", bundled_model_path(), "--new_config_path", str(new), "--output_path", str(out))
    assert done.returncode == 1
    assert message in done.stderr
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.json"]


def test_a_missing_model_directory_names_the_flag(tmp_path):
    new = write_json(tmp_path / "new.json", {})
    done = run("--hf_model_path", str(tmp_path / "nope"), "--new_config_path", str(new), "--output_path", "x")
    assert done.returncode == 1
    assert "--hf_model_path" in done.stderr and "does not exist" in done.stderr


def test_an_unknown_key_is_kept_with_a_warning(tmp_path):
    new = write_json(tmp_path / "new.json", {"num_hidden_layers": 1, "my_debug_flag": 5})
    out = tmp_path / "out"
    done = run("--hf_model_path", bundled_model_path(), "--new_config_path", str(new), "--output_path", str(out))
    assert done.returncode == 0
    assert "'my_debug_flag' is not in the model's config.json" in done.stderr
    assert json.loads((out / "config.json").read_text())["my_debug_flag"] == 5
