"""Activation offload (verl.utils.activation_offload): the hooks run on CPU and the results are bit-equal to
the unwrapped model; with `copy_host_tensors` every saved activation but the parameters makes the round trip
to a host copy and back, and the gradients are still bit-equal."""

import copy
import logging

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from verl.utils import shared_prompt
from verl.utils.activation_offload import enable_activation_offloading, offload_layers
from verl.utils.model import enable_gradient_checkpointing
from verl.workers.model_memory import apply_model_memory_options


def _model(layers: int = 4) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return Qwen2ForCausalLM(config).double().train()


def _run(model, ids):
    model.zero_grad()
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("copy_host_tensors", [False, True])
def test_offloaded_model_is_bit_equal_to_the_plain_one(ckpt, copy_host_tensors):
    plain = _model()
    wrapped = copy.deepcopy(plain)
    if ckpt:
        enable_gradient_checkpointing(plain)
        enable_gradient_checkpointing(wrapped)
    ids = torch.randint(0, 64, (2, 11))
    logits, grads = _run(plain, ids)
    handler = enable_activation_offloading(wrapped, "fsdp2", enable_ckpt=ckpt, copy_host_tensors=copy_host_tensors)
    assert handler is not None and len(handler.layers) == 4
    wrapped_logits, wrapped_grads = _run(wrapped, ids)
    assert torch.equal(wrapped_logits, logits)
    for mine, ref in zip(wrapped_grads, grads, strict=True):
        assert torch.equal(mine, ref)
    stats = handler.stats
    if copy_host_tensors:
        assert stats.offloaded > 0 and stats.reloaded == stats.offloaded and stats.kept_on_host == 0
    else:  # on a CPU device every activation already is on the host
        assert stats.offloaded == 0 and stats.kept_on_host > 0
    if ckpt:  # only each checkpointed layer's inputs are saved, and transformers' checkpointing is off
        assert stats.kept_parameters == 0
        assert not any(getattr(m, "gradient_checkpointing", False) for m in wrapped.modules())
        assert shared_prompt.recomputes_layers(wrapped)
    else:  # the linear layers save their weights: left in place
        assert stats.kept_parameters > 0


def test_only_the_layers_but_the_last_are_offloaded_and_eval_or_no_grad_forwards_are_untouched():
    model = _model()
    handler = enable_activation_offloading(model, "fsdp", copy_host_tensors=True)
    ids = torch.randint(0, 64, (1, 7))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    model.eval()
    model(input_ids=ids, use_cache=False).logits.sum().backward()
    assert handler.stats.offloaded == 0 and handler.stats.kept_on_host == 0
    model.train()
    hidden = torch.randn(1, 7, 16, dtype=torch.float64, requires_grad=True)
    rotary = model.model.rotary_emb(hidden, torch.arange(7)[None])
    counts = []
    for layer in model.model.layers:
        before = handler.stats.offloaded + handler.stats.kept_parameters
        layer(hidden, position_embeddings=rotary)
        counts.append(handler.stats.offloaded + handler.stats.kept_parameters - before)
    assert all(c > 0 for c in counts[:-1]) and counts[-1] == 0


def test_fewer_than_three_layers_or_another_strategy_is_refused_as_upstream(caplog):
    with caplog.at_level(logging.WARNING):
        assert enable_activation_offloading(_model(layers=2), "fsdp2") is None
    assert "found only 2 layers" in caplog.text
    with pytest.raises(ValueError, match="activation offloading only supports fsdp strategy"):
        enable_activation_offloading(_model(), "megatron")


def test_layers_are_the_fsdp_units_or_else_the_decoder_layers():
    model = _model()
    assert offload_layers(model) == list(model.model.layers)


def test_the_model_section_turns_it_on_for_a_trained_model_only():
    section = {
        "enable_activation_offload": True,
        "enable_gradient_checkpointing": False,
        "tiled_mlp": {"enabled": False},
    }
    assert apply_model_memory_options(_model(), section, "fsdp", trains=False) is None
    assert apply_model_memory_options(_model(), {**section, "enable_activation_offload": False}, "fsdp", True) is None
    handler = apply_model_memory_options(_model(), section, "fsdp", trains=True)
    assert handler is not None and not handler.enable_ckpt
