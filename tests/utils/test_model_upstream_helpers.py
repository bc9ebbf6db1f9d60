"""Upstream's smaller `verl.utils.model` helpers, on the project's tiny HF models."""

from __future__ import annotations

import json
import pickle
from types import SimpleNamespace

import pytest
import torch

from tests.distributed_helpers import make_tiny_causal_lm, tiny_qwen2_config
from verl.utils import model as M


def test_model_size_picks_the_largest_unit_the_count_exceeds(capsys):
    layer = torch.nn.Linear(100, 100)  # 10,100 parameters
    assert M.get_model_size(layer) == (pytest.approx(10.1), "K")
    assert M.get_model_size(layer, scale="M") == (pytest.approx(0.0101), "M")
    assert M.get_model_size(torch.nn.Linear(2, 3), scale="auto") == (9, "")
    with pytest.raises(NotImplementedError, match="scale='G'"):
        M.get_model_size(layer, scale="G")
    M.print_model_size(layer)
    M.print_model_size(layer, name="head")
    assert capsys.readouterr().out.splitlines() == [
        "Linear contains 10.10K parameters",
        "head contains 10.10K parameters",
    ]


def test_convert_weight_keys_reverses_the_checkpoint_conversion_mapping():
    class Renaming(torch.nn.Module):
        _checkpoint_conversion_mapping = {
            r"^visual": "model.visual",
            r"^model(?!\.(language_model|visual))": "model.language_model",
        }

    state = {"model.visual.w": 1, "model.language_model.layers.0.w": 2, "lm_head.weight": 3}
    assert M.convert_weight_keys(state, Renaming()) == {"visual.w": 1, "model.layers.0.w": 2, "lm_head.weight": 3}
    assert M.convert_weight_keys(state, torch.nn.Linear(1, 1)) is state  # no mapping: unchanged


def test_exclude_modules_match_by_regex_exact_name_or_suffix():
    assert M.check_exclude_modules(SimpleNamespace(exclude_modules=r".*\.mlp\..*"), "model.layers.0.mlp.up_proj")
    listed = SimpleNamespace(exclude_modules=["lm_head", "gate"])
    assert M.check_exclude_modules(listed, "lm_head")
    assert M.check_exclude_modules(listed, "model.layers.1.mlp.gate")
    assert not M.check_exclude_modules(listed, "model.layers.1.mlp.gate_proj")
    assert not M.check_exclude_modules(SimpleNamespace(exclude_modules=None), "lm_head")
    assert not M.check_exclude_modules(SimpleNamespace(), "lm_head")


def test_target_modules_match_suffixes_and_honour_layers_to_transform():
    cfg = SimpleNamespace(target_modules=["q_proj", "v_proj"])
    assert M.check_target_modules(cfg, "model.layers.3.self_attn.q_proj")
    assert not M.check_target_modules(cfg, "model.layers.3.self_attn.k_proj")
    assert M.check_target_modules(SimpleNamespace(target_modules=r".*\.k_proj"), "model.layers.0.self_attn.k_proj")
    only_1 = SimpleNamespace(target_modules=["q_proj"], layers_to_transform=[1], layers_pattern="layers")
    assert M.check_target_modules(only_1, "model.layers.1.self_attn.q_proj")
    assert not M.check_target_modules(only_1, "model.layers.2.self_attn.q_proj")
    no_pattern = SimpleNamespace(target_modules=["q_proj"], layers_to_transform=2)
    assert M.check_target_modules(no_pattern, "model.layers.2.self_attn.q_proj")
    assert not M.check_target_modules(no_pattern, "q_proj.x")  # no layer number: not a target


def test_normalize_model_name_adds_the_pipeline_chunks_first_layer():
    from megatron.core.transformer.transformer_config import TransformerConfig

    # 8 layers, 2 pipeline stages x 2 virtual stages: chunks of 2 layers, interleaved
    # (pp0/vp0: 0-1, pp1/vp0: 2-3, pp0/vp1: 4-5, pp1/vp1: 6-7)
    cfg = TransformerConfig(
        num_layers=8,
        hidden_size=16,
        num_attention_heads=2,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
    )
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    assert M.normalize_model_name(name, pp_rank=1, vpp_rank=0, transformer_config=cfg) == name.replace(".1.", ".3.")
    assert M.normalize_model_name(name, pp_rank=0, vpp_rank=1, transformer_config=cfg) == name.replace(".1.", ".5.")
    assert M.normalize_model_name("embedding.word_embeddings.weight", 1, 1, cfg) == "embedding.word_embeddings.weight"


def test_hf_auto_model_class_follows_the_architecture():
    from transformers import (
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForTokenClassification,
        Qwen2VLConfig,
    )

    config = tiny_qwen2_config()
    config.architectures = ["Qwen2ForCausalLM"]
    assert M.get_hf_auto_model_class(config) is AutoModelForCausalLM
    config.architectures = ["Qwen2ForTokenClassification"]
    assert M.get_hf_auto_model_class(config) is AutoModelForTokenClassification
    config.architectures = ["Qwen2Model"]
    assert M.get_hf_auto_model_class(config) is AutoModel
    remote = tiny_qwen2_config()
    remote.architectures = ["MyLM"]
    remote.auto_map = {"AutoConfig": "my.MyConfig", "AutoModelForCausalLM": "my.MyLM"}
    assert M.get_hf_auto_model_class(remote) is AutoModelForCausalLM
    vl = Qwen2VLConfig()
    vl.architectures = ["Qwen2VLForConditionalGeneration"]
    assert M.get_hf_auto_model_class(vl) is AutoModelForImageTextToText


def test_lora_rank_is_read_from_the_adapter_config(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 16, "lora_alpha": 32}))
    assert M.get_lora_rank_from_adapter(tmp_path) == 16
    with pytest.raises(FileNotFoundError, match="LoRA adapter path not found"):
        M.get_lora_rank_from_adapter(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="adapter_config.json not found"):
        M.get_lora_rank_from_adapter(empty)
    (empty / "adapter_config.json").write_text(json.dumps({"lora_alpha": 32}))
    with pytest.raises(ValueError, match="LoRA rank 'r' not found"):
        M.get_lora_rank_from_adapter(empty)
    (empty / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="Invalid JSON"):
        M.get_lora_rank_from_adapter(empty)


def test_huggingface_actor_and_critic_are_built_from_a_saved_config(tmp_path):
    make_tiny_causal_lm(dtype=torch.float32).save_pretrained(tmp_path)
    config = M.get_huggingface_actor_config(str(tmp_path), {"num_hidden_layers": 1})
    assert config.num_hidden_layers == 1
    with pytest.raises(TypeError, match="override_config_kwargs must be a dict"):
        M.get_huggingface_actor_config(str(tmp_path), ["num_hidden_layers"])
    torch.manual_seed(0)
    actor = M.create_huggingface_actor(str(tmp_path), {"num_hidden_layers": 1})
    assert actor.config.num_hidden_layers == 1 and len(actor.model.layers) == 1
    critic = M.create_huggingface_critic(str(tmp_path), automodel_kwargs={"torch_dtype": torch.float64})
    ids = torch.tensor([[1, 2, 3]])
    values = critic(input_ids=ids).logits
    assert values.shape == (1, 3) and values.dtype == torch.float64
    hidden = critic.model(input_ids=ids).last_hidden_state
    head = critic.lm_head[0]
    torch.testing.assert_close(values, (hidden @ head.weight.T + head.bias).squeeze(-1))


def test_lambda_layer_and_squeeze():
    layer = M.LambdaLayer(fn=M.squeeze)
    assert layer(torch.zeros(2, 3, 1)).shape == (2, 3)


def test_causal_lm_output_for_ppo_carries_log_probs_and_entropy():
    out = M.CausalLMOutputForPPO(logits=torch.zeros(1, 2, 3), log_probs=torch.ones(1, 2), entropy=torch.zeros(1, 2))
    assert out["log_probs"].tolist() == [[1.0, 1.0]] and out.entropy.shape == (1, 2)
    assert pickle.loads(pickle.dumps(out)).log_probs.tolist() == [[1.0, 1.0]]
    from verl.utils.model import CausalLMOutputForPPO

    assert CausalLMOutputForPPO is M.CausalLMOutputForPPO
    with pytest.raises(AttributeError, match="no attribute 'NotAName'"):
        M.NotAName  # noqa: B018
