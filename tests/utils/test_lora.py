"""verl.utils.lora in one process: wrapping, the streamed merge (against a hand-computed float64
merge and against peft's own `merge_and_unload`), and the adapter saved in PEFT's format."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from omegaconf import OmegaConf

from tests.distributed_helpers import make_tiny_causal_lm
from verl.utils.lora import (
    PEFT_PREFIX,
    apply_lora,
    is_peft_model,
    lora_enabled,
    lora_scalings,
    merge_lora_state,
    read_adapter_config,
    save_lora_adapter,
    scaling_from_adapter_config,
)

RANK, ALPHA = 4, 8


def model_cfg(**overrides):
    cfg = {"lora_rank": RANK, "lora_alpha": ALPHA, "target_modules": "all-linear", "exclude_modules": None}
    cfg.update(overrides)
    return OmegaConf.create(cfg)


def lora_model_with_random_adapters(seed: int = 0, **overrides):
    """A float64 tiny Qwen2 with LoRA whose B factors are random (peft starts them at zero)."""
    model = apply_lora(make_tiny_causal_lm(seed), model_cfg(**overrides))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * 0.5)
    return model


def test_lora_is_enabled_by_a_positive_rank_only():
    assert lora_enabled({"lora_rank": 8}) and not lora_enabled({"lora_rank": 0}) and not lora_enabled({})


def test_only_the_adapters_of_the_targeted_linear_layers_train():
    model = apply_lora(make_tiny_causal_lm(), model_cfg(target_modules=["q_proj", "v_proj"]))
    assert is_peft_model(model) and not is_peft_model(make_tiny_causal_lm())
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "v_proj"}
    assert len(trainable) == 2 * 2 * 2  # 2 layers x 2 modules x (A, B)
    assert set(lora_scalings(model).values()) == {(ALPHA / RANK, False)}


def test_exclude_modules_keeps_adapters_off_those_layers():
    model = apply_lora(make_tiny_causal_lm(), model_cfg(exclude_modules=["down_proj", "up_proj"]))
    adapted = {name.rsplit(".", 1)[-1] for name in lora_scalings(model)}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"}  # never lm_head


def test_target_modules_that_match_nothing_say_what_to_set():
    with pytest.raises(ValueError, match=r"target_modules=.*no_such_proj.*actor_rollout_ref.model.target_modules"):
        apply_lora(make_tiny_causal_lm(), model_cfg(target_modules=["no_such_proj"]))


def test_one_merged_layer_equals_the_hand_computed_float64_merge():
    model = lora_model_with_random_adapters()
    sd = model.state_dict()
    prefix = f"{PEFT_PREFIX}model.layers.1.mlp.down_proj"
    w, a, b = (
        sd[f"{prefix}.base_layer.weight"],
        sd[f"{prefix}.lora_A.default.weight"],
        sd[f"{prefix}.lora_B.default.weight"],
    )
    expected = w.clone()
    for k in range(RANK):  # W + alpha / r * sum_k (column k of B) outer (row k of A)
        expected += ALPHA / RANK * torch.outer(b[:, k], a[k, :])
    merged = dict(merge_lora_state(sd.items(), lora_scalings(model)))
    torch.testing.assert_close(merged["model.layers.1.mlp.down_proj.weight"], expected, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(expected, w)  # the adapter really contributes


def test_streamed_merge_in_any_order_equals_peft_merge_and_unload():
    model = lora_model_with_random_adapters()
    items = list(model.state_dict().items())
    random.Random(0).shuffle(items)
    merged = dict(merge_lora_state(iter(items), ALPHA / RANK))  # one scaling, as read from adapter_config.json
    reference = model.merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(merged[name], tensor, rtol=1e-12, atol=1e-12, msg=name)


def test_merge_refuses_a_layer_with_a_missing_factor_or_a_non_peft_name():
    sd = lora_model_with_random_adapters().state_dict()
    partial = [(n, t) for n, t in sd.items() if "layers.0.self_attn.q_proj.lora_B" not in n]
    with pytest.raises(KeyError, match=r"model.layers.0.self_attn.q_proj.*\['A', 'W'\]"):
        list(merge_lora_state(partial, ALPHA / RANK))
    with pytest.raises(KeyError, match="not a peft state-dict name"):
        list(merge_lora_state([("model.norm.weight", torch.ones(2))], 1.0))


def test_scaling_from_an_adapter_config_follows_peft():
    assert scaling_from_adapter_config({"r": 8, "lora_alpha": 16}) == 2.0
    assert scaling_from_adapter_config({"r": 16, "lora_alpha": 16, "use_rslora": True}) == 4.0


def test_saved_adapter_loads_with_peft_from_pretrained(tmp_path):
    from peft import PeftModel

    model = lora_model_with_random_adapters()
    save_lora_adapter(model, str(tmp_path))
    config = read_adapter_config(str(tmp_path))
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (RANK, ALPHA, "LORA")
    assert json.loads((tmp_path / "adapter_config.json").read_text()) == config
    loaded = PeftModel.from_pretrained(make_tiny_causal_lm(), str(tmp_path))
    expected = {n: t for n, t in model.state_dict().items() if ".lora_" in n}
    got = loaded.state_dict()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


# ------------------------------------------------------------------ starting from a trained adapter

ADAPTER_TARGETS = ["q_proj", "v_proj", "down_proj"]


def tiny_model(seed: int = 0, **config_changes):
    """A float64 tiny Qwen2 (tests' layout), with `config_changes` applied to its HF config."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from tests.distributed_helpers import tiny_qwen2_config

    fields = tiny_qwen2_config().to_dict()
    fields.pop("layer_types", None)  # derived from num_hidden_layers when rebuilt
    config = Qwen2Config(**(fields | config_changes))
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(torch.float64)


def trained_adapter(path, model=None, **lora_overrides) -> str:
    """Save a peft adapter (r=2, alpha=6, dropout 0.1, random A and B) the way a user's would be."""
    from peft import LoraConfig, get_peft_model

    kwargs = {"r": 2, "lora_alpha": 6, "target_modules": ADAPTER_TARGETS, "lora_dropout": 0.1}
    peft_model = get_peft_model(
        model if model is not None else tiny_model(), LoraConfig(task_type="CAUSAL_LM", **(kwargs | lora_overrides))
    )
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * 0.3)
    peft_model.save_pretrained(str(path))
    return str(path)


def adapter_cfg(path, **overrides):
    """The config a user writes: a LoRA layout of its own beside the adapter (the adapter's wins)."""
    return model_cfg(lora_adapter_path=str(path), path="tiny-qwen2-under-test", **overrides)


def test_an_adapter_path_alone_turns_lora_on():
    assert lora_enabled({"lora_rank": 0, "lora_adapter_path": "/some/adapter"})
    assert not lora_enabled({"lora_rank": 0, "lora_adapter_path": None})


def test_a_loaded_adapter_computes_what_peft_from_pretrained_computes(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    path = trained_adapter(tmp_path / "adapter")
    model = apply_lora(tiny_model(), adapter_cfg(path))  # config says r=4, alpha=8, all-linear
    reference = PeftModel.from_pretrained(tiny_model(), path).eval()

    # the adapter's layout, not the config's: its targets, its alpha / r = 6 / 2
    scalings = lora_scalings(model)
    assert {name.rsplit(".", 1)[-1] for name in scalings} == set(ADAPTER_TARGETS)
    assert set(scalings.values()) == {(3.0, False)}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    saved = load_file(f"{path}/adapter_model.safetensors")
    loaded = {n.replace(".default.", "."): t for n, t in model.state_dict().items() if ".lora_" in n}
    assert loaded.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name

    ids = torch.randint(1, 40, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        # dropout is off (lora_dropout=0.1 in the adapter): training mode computes the same function
        got = model.train()(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    assert (expected - tiny_model()(input_ids=ids).logits).abs().max() > 1e-3, "the adapter changes nothing"


def test_an_adapter_whose_shapes_do_not_fit_names_the_layer_and_both_shapes(tmp_path):
    path = trained_adapter(tmp_path / "narrow", tiny_model(hidden_size=32, head_dim=32, intermediate_size=64))
    with pytest.raises(ValueError) as e:
        apply_lora(tiny_model(), adapter_cfg(path))
    msg = str(e.value)
    assert f"LoRA adapter {path} does not fit the model tiny-qwen2-under-test" in msg
    assert "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight has shape [2, 64] in the adapter" in msg
    assert "but [2, 128] in the model" in msg


def test_an_adapter_of_a_deeper_model_names_the_layers_this_model_lacks(tmp_path):
    path = trained_adapter(tmp_path / "deep", tiny_model(num_hidden_layers=3))
    with pytest.raises(ValueError, match=r"has no place for: base_model\.model\.model\.layers\.2\."):
        apply_lora(tiny_model(), adapter_cfg(path))


def test_an_adapter_whose_target_modules_the_model_lacks_names_both(tmp_path):
    path = trained_adapter(tmp_path / "gpt2")
    config = json.loads((tmp_path / "gpt2" / "adapter_config.json").read_text())
    config["target_modules"] = ["c_attn"]  # GPT-2's attention projection
    (tmp_path / "gpt2" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as e:
        apply_lora(tiny_model(), adapter_cfg(path))
    assert f"the LoRA adapter {path} (target_modules={{'c_attn'}}) does not fit the model tiny-qwen2-under-test" in str(
        e.value
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_dora": True}, "use_dora=True (DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save=['lm_head']"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern="),
        ({"bias": "all"}, "bias='all'"),
        ({"peft_type": "IA3"}, "peft_type='IA3' adapter, not a LoRA one"),
    ],
)
def test_adapters_the_rollout_merge_cannot_describe_are_refused(tmp_path, change, message):
    from verl.utils.lora import check_adapter_dir

    path = trained_adapter(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config | change))
    with pytest.raises(ValueError, match=re.escape(message)):
        check_adapter_dir(path)


def test_a_missing_or_incomplete_adapter_directory_says_what_it_needs(tmp_path):
    from verl.utils.lora import check_adapter_dir

    with pytest.raises(ValueError, match="does not exist or is not a directory; point it at a peft LoRA adapter"):
        check_adapter_dir(str(tmp_path / "nowhere"))
    path = trained_adapter(tmp_path / "adapter")
    (tmp_path / "adapter" / "adapter_model.safetensors").rename(tmp_path / "adapter" / "adapter_model.bin")
    with pytest.raises(ValueError, match=r"lacks adapter_model\.safetensors \(it has adapter_model\.bin: re-save"):
        check_adapter_dir(path)
