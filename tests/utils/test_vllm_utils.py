"""`verl.utils.vllm`: version checks from package metadata, and the MoE weight-loader patch (on
stand-in model classes named like vLLM's; vLLM itself is not needed, only importable)."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch
from torch import nn

from verl.utils.vllm import is_version_ge
from verl.utils.vllm.patch import patch_vllm_moe_model_weight_loader


def test_is_version_ge_compares_installed_versions_and_names_a_missing_package():
    assert is_version_ge("torch", "1.0")
    assert not is_version_ge("torch", "999.0")
    with pytest.raises(ModuleNotFoundError, match="'no-such-package-xyz' is not installed"):
        is_version_ge("no-such-package-xyz", "1.0")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_patch_without_vllm_says_vllm_is_missing():
    with pytest.raises(ImportError, match="vLLM is not installed"):
        patch_vllm_moe_model_weight_loader(nn.Module())


def _loader(param, loaded):
    return None


class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w13_weight = nn.Parameter(torch.zeros(2, 4, 3))
        self.w2_weight = nn.Parameter(torch.zeros(2, 3, 2))
        self.weight_loader = _loader


class _Layer(nn.Module):
    def __init__(self, attribute: str):
        super().__init__()
        block = nn.Module()
        block.experts = _Experts()
        block.gate = nn.Linear(3, 2)
        setattr(self, attribute, block)


def _model(class_name: str, attribute: str = "mlp"):
    model = type(class_name, (nn.Module,), {})()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([_Layer(attribute), _Layer(attribute)])
    return model


@pytest.fixture
def fake_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))


def test_patch_gives_fused_expert_weights_the_experts_loader(fake_vllm):
    model = _model("Qwen3MoeForCausalLM")
    patch_vllm_moe_model_weight_loader(model)
    for layer in model.model.layers:
        assert layer.mlp.experts.w13_weight.weight_loader is _loader
        assert layer.mlp.experts.w2_weight.weight_loader is _loader
        assert not hasattr(layer.mlp.gate.weight, "weight_loader")
    mixtral = _model("MixtralForCausalLM", attribute="block_sparse_moe")
    patch_vllm_moe_model_weight_loader(mixtral)
    assert mixtral.model.layers[0].block_sparse_moe.experts.w2_weight.weight_loader is _loader


def test_patch_leaves_other_families_alone_and_needs_an_inner_model(fake_vllm):
    other = _model("SomeOtherMoeForCausalLM")
    patch_vllm_moe_model_weight_loader(other)
    assert not hasattr(other.model.layers[0].mlp.experts.w13_weight, "weight_loader")
    with pytest.raises(ValueError, match="no 'model' or 'language_model'"):
        patch_vllm_moe_model_weight_loader(type("Qwen3MoeForCausalLM", (nn.Module,), {})())
