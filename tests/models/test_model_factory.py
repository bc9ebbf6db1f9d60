"""The tiny-model factory: presets, the byte-level tokenizer and the saved HF directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from verl.models.factory import HEAD_DIM, PRESETS, ModelPreset, build_model, count_parameters, make_tiny, save_model
from verl.models.tokenizer import SPECIAL_TOKENS, base_vocab_size, build_char_tokenizer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny("tiny", str(tmp_path_factory.mktemp("tiny")), seed=0)


def test_tokenizer_splits_ascii_text_into_one_token_per_character():
    tokenizer = build_char_tokenizer()
    text = "What is 37+48?"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.convert_ids_to_tokens(ids[8:13]) == ["3", "7", "+", "4", "8"]
    assert tokenizer.decode(ids) == text


def test_tokenizer_special_token_ids_are_fixed():
    tokenizer = build_char_tokenizer()
    assert len(tokenizer) == base_vocab_size() == len(SPECIAL_TOKENS) + 256
    assert (tokenizer.pad_token_id, tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (
        0,
        1,
        2,
        3,
    )
    assert tokenizer.convert_tokens_to_ids(["<|system|>", "<|user|>", "<|assistant|>"]) == [4, 5, 6]


def test_tokenizer_never_fails_on_unusual_characters():
    tokenizer = build_char_tokenizer()
    text = "Zoë paid 5€ 😀\n\ttab"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert all(0 <= i < len(tokenizer) for i in ids)
    assert tokenizer.decode(ids) == text  # byte-level: nothing is lost, not even emoji


def test_chat_template_renders_the_documented_prompt_exactly():
    tokenizer = build_char_tokenizer()
    prompt = [{"role": "user", "content": "What is 37+48?"}]
    rendered = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    assert rendered == "<bos><|user|>What is 37+48?<|assistant|>"
    full = tokenizer.apply_chat_template([*prompt, {"role": "assistant", "content": "85"}], tokenize=False)
    assert full == "<bos><|user|>What is 37+48?<|assistant|>85<eos>"


def test_reserved_tokens_pad_the_vocabulary_and_still_decode():
    tokenizer = build_char_tokenizer(reserved_to=1000)
    assert len(tokenizer) == 1000
    assert tokenizer.decode([999]) == f"<|reserved_{999 - base_vocab_size()}|>"
    with pytest.raises(ValueError, match="smaller than"):
        build_char_tokenizer(reserved_to=10)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_has_head_dim_64(name):
    preset = PRESETS[name]
    assert preset.hidden_size // preset.num_attention_heads == HEAD_DIM


def test_preset_parameter_counts_match_their_descriptions():
    assert 0.9e6 < count_parameters("tiny") < 1.2e6
    assert 4.5e6 < count_parameters("small") < 6e6
    assert 20e6 < count_parameters("base") < 30e6
    assert count_parameters("qwen2.5-0.5b-shape") == 494_032_768  # Qwen2.5-0.5B's published size


def test_preset_rejects_a_head_dim_vllm_cannot_serve():
    with pytest.raises(ValueError, match="head_dim 64"):
        ModelPreset(
            "qwen2",
            hidden_size=96,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            intermediate_size=8,
        )


def test_build_model_is_reproducible_from_its_seed():
    a, _ = build_model("tiny", seed=3)
    b, _ = build_model("tiny", seed=3)
    c, _ = build_model("tiny", seed=4)
    wa, wb, wc = (m.model.layers[0].mlp.up_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_saved_directory_is_a_plain_hf_checkpoint(tiny_dir):
    files = set(os.listdir(tiny_dir))
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= files
    with open(os.path.join(tiny_dir, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["head_dim"] == 64
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 10000.0  # read by 4.x and 5
    with open(os.path.join(tiny_dir, "tokenizer_config.json")) as f:
        tok_config = json.load(f)
    # Readable by transformers 4.x too: a known class name and the template inline.
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok_config["chat_template"].startswith("{{ bos_token }}")


def test_round_trip_offline_load_generate_and_template(tiny_dir):
    """A fresh interpreter with the Hub disabled loads the directory, renders the template exactly,
    tokenises like the in-memory tokenizer and generates."""
    code = f"""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from verl.models.tokenizer import build_char_tokenizer
path = {tiny_dir!r}
model = AutoModelForCausalLM.from_pretrained(path)
tokenizer = AutoTokenizer.from_pretrained(path)
reference = build_char_tokenizer()
for text in ["What is 37+48?", "Tom has 12 apples.\\nHow many?  (x) é"]:
    assert tokenizer(text, add_special_tokens=False).input_ids == reference(text, add_special_tokens=False).input_ids
prompt = tokenizer.apply_chat_template([{{"role": "user", "content": "What is 37+48?"}}], add_generation_prompt=True, tokenize=False)
assert prompt == "<bos><|user|>What is 37+48?<|assistant|>", prompt
ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
assert out.shape == (1, ids.shape[1] + 4) or int(out[0, -1]) == tokenizer.eos_token_id
print("ok", model.num_parameters())
"""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": REPO_ROOT,
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[0] == "ok"


def test_llama_preset_round_trips_through_save_and_load(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = build_model("base", seed=0)
    save_model(model, tokenizer, str(tmp_path))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    loaded_tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(loaded).__name__ == "LlamaForCausalLM"
    ids = torch.tensor([loaded_tok("What is 1+2?", add_special_tokens=False).input_ids])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, loaded(ids).logits)


def test_make_tiny_cli_writes_a_loadable_model(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from verl.models.make_tiny import main

    main(["--preset", "tiny", "--out", str(tmp_path / "m"), "--seed", "1"])
    assert "wrote preset 'tiny'" in capsys.readouterr().out
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "m")).num_parameters() == count_parameters("tiny")


def test_build_config_without_a_tokenizer_matches_the_one_with_it():
    from verl.models.factory import build_config, build_tokenizer

    assert build_config("small").to_dict() == build_config("small", build_tokenizer("small")).to_dict()


def test_deepseek_v3_preset_saves_and_loads_with_its_latent_attention_and_routing(tmp_path):
    from transformers import AutoModelForCausalLM

    make_tiny("tiny-dsv3", str(tmp_path))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    config = loaded.config
    assert type(loaded).__name__ == "DeepseekV3ForCausalLM"
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_group, config.topk_group) == (8, 4, 4, 2)
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim) == (
        96,
        64,
        48,
        16,
    )
    assert config.first_k_dense_replace == 1 and config.num_nextn_predict_layers == 0
    assert not hasattr(loaded.model.layers[0].mlp, "gate")  # the dense first layer
    assert loaded.model.layers[1].mlp.shared_experts.down_proj.weight.shape == (128, 32)
    assert 0.5e6 < count_parameters("tiny-dsv3") < 0.6e6


def test_glm4_moe_preset_saves_and_loads_with_its_attention_and_routing(tmp_path):
    from transformers import AutoModelForCausalLM

    make_tiny("tiny-glm4moe", str(tmp_path))
    with open(tmp_path / "config.json") as f:  # transformers 4.x (and engines pinned to it) read it top-level
        assert json.load(f)["partial_rotary_factor"] == 0.5
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    config = loaded.config
    assert type(loaded).__name__ == "Glm4MoeForCausalLM"
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_group, config.topk_group) == (8, 2, 1, 1)
    assert config.rope_parameters["partial_rotary_factor"] == 0.5 and config.routed_scaling_factor == 2.5
    assert config.attention_bias and not config.use_qk_norm and not config.tie_word_embeddings
    assert config.first_k_dense_replace == 1 and config.num_nextn_predict_layers == 0
    attention = loaded.model.layers[0].self_attn
    assert attention.k_proj.bias.shape == (2 * HEAD_DIM,) and attention.o_proj.bias is None
    assert not hasattr(loaded.model.layers[0].mlp, "gate")  # the dense first layer
    assert loaded.model.layers[1].mlp.shared_experts.down_proj.weight.shape == (256, 32)
    assert 1.3e6 < count_parameters("tiny-glm4moe") < 1.4e6


def test_gpt_oss_preset_saves_and_loads_with_sinks_windows_and_yarn(tmp_path):
    from transformers import AutoModelForCausalLM

    make_tiny("tiny-gptoss", str(tmp_path))
    with open(tmp_path / "config.json") as f:  # transformers 4.x (and engines pinned to it) read these top-level
        saved = json.load(f)
    assert saved["rope_theta"] == 150000.0 and saved["rope_scaling"]["rope_type"] == "yarn"
    assert saved["rope_scaling"]["factor"] == 32.0 and saved["rope_scaling"]["truncate"] is False
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    config = loaded.config
    assert type(loaded).__name__ == "GptOssForCausalLM"
    assert config.layer_types == ["sliding_attention", "full_attention"] and config.sliding_window == 4
    assert (config.num_local_experts, config.num_experts_per_tok, config.intermediate_size) == (4, 2, 64)
    assert config.attention_bias and config.swiglu_limit == 7.0 and not config.tie_word_embeddings
    attention = loaded.model.layers[0].self_attn
    assert attention.sinks.shape == (4,) and bool((attention.sinks != 0).all())
    assert attention.o_proj.bias.shape == (4 * HEAD_DIM,)
    assert loaded.model.layers[1].mlp.experts.gate_up_proj.shape == (4, 4 * HEAD_DIM, 2 * 64)
    assert loaded.model.layers[1].mlp.router.bias.shape == (4,)
    assert 0.9e6 < count_parameters("tiny-gptoss") < 0.95e6
