"""Tiled MLP (verl.models.transformers.tiled_mlp): float64 outputs and gradients equal the untiled model's,
the intermediate activations of only one chunk are alive at a time, and the patch is scoped and undone."""

import copy

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

from verl.models.transformers.monkey_patch import apply_monkey_patch
from verl.models.transformers.tiled_mlp import (
    apply_tiled_mlp_monkey_patch,
    remove_tiled_mlp_monkey_patch,
    tiled_mlp_forward,
)


@pytest.fixture(autouse=True)
def _untiled_afterwards():
    yield
    remove_tiled_mlp_monkey_patch()


def _model(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return Qwen2ForCausalLM(config).double()


def _loss_and_grads(model, ids):
    model.zero_grad()
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("num_shards", [1, 3, 4, 22])
def test_tiled_model_logits_and_gradients_equal_the_untiled_model_in_float64(num_shards):
    model = _model()
    ids = torch.randint(0, 64, (2, 11))
    logits, grads = _loss_and_grads(model, ids)
    assert apply_tiled_mlp_monkey_patch(num_shards=num_shards, model_type="qwen2") == ["Qwen2MLP"]
    tiled_logits, tiled_grads = _loss_and_grads(model, ids)
    torch.testing.assert_close(tiled_logits, logits, rtol=0, atol=1e-13)
    for name, grad in grads.items():  # the MLP weights' gradients are sums over chunks: another order
        torch.testing.assert_close(tiled_grads[name], grad, rtol=1e-12, atol=1e-14, msg=name)


def test_input_gradient_and_weight_gradients_of_one_mlp_match_a_hand_computed_swiglu():
    torch.manual_seed(1)
    mlp = Qwen2MLP(Qwen2Config(hidden_size=4, intermediate_size=6)).double()
    x = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 5, 4, dtype=torch.float64)
    out = tiled_mlp_forward(mlp, x, num_shards=3)
    out.backward(g)
    # reference: silu(x Wg^T) * (x Wu^T) @ Wd^T written out, its gradients by autograd on fresh leaves
    wg, wu, wd = (
        w.detach().clone().requires_grad_() for w in (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    )
    xr = x.detach().clone().requires_grad_()
    a = xr @ wg.t()
    ref = (a * torch.sigmoid(a) * (xr @ wu.t())) @ wd.t()
    ref.backward(g)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-14)
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=1e-13)
    for mine, theirs in ((mlp.gate_proj.weight, wg), (mlp.up_proj.weight, wu), (mlp.down_proj.weight, wd)):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-12, atol=1e-13)


def test_frozen_weights_get_no_gradient_and_an_input_without_grad_gets_none():
    mlp = Qwen2MLP(Qwen2Config(hidden_size=4, intermediate_size=6)).double()
    mlp.gate_proj.weight.requires_grad_(False)
    x = torch.randn(7, 4, dtype=torch.float64)
    tiled_mlp_forward(mlp, x, num_shards=2).sum().backward()
    assert mlp.gate_proj.weight.grad is None
    assert mlp.up_proj.weight.grad is not None and mlp.down_proj.weight.grad is not None


def test_dropout_inside_the_mlp_draws_the_same_masks_in_the_recomputation():
    torch.manual_seed(2)
    mlp = Qwen2MLP(Qwen2Config(hidden_size=4, intermediate_size=6)).double()
    drop = torch.nn.Dropout(0.5)

    def fn(module, x):  # a LoRA-style dropout on the MLP's input
        return module.down_proj(module.act_fn(module.gate_proj(drop(x))) * module.up_proj(x))

    x = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(3)
    ref = fn(mlp, x)
    (ref_grad,) = torch.autograd.grad(ref.sum(), x)
    torch.manual_seed(3)
    out = tiled_mlp_forward(mlp, x, num_shards=1, fn=fn)
    (grad,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-14)


def _peak_bytes(step) -> int:
    """Peak of the bytes allocated (and not yet freed) while `step` runs, from the profiler's memory events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def test_the_peak_memory_of_forward_and_backward_drops_with_the_chunks():
    hidden, inter, tokens = 64, 1024, 2048
    mlp = Qwen2MLP(Qwen2Config(hidden_size=hidden, intermediate_size=inter))
    x = torch.randn(1, tokens, hidden, requires_grad=True)

    def step(shards):
        def run():
            out = tiled_mlp_forward(mlp, x, shards) if shards else mlp(x)
            out.sum().backward()
            mlp.zero_grad(set_to_none=True)
            x.grad = None

        return run

    untiled, tiled = _peak_bytes(step(None)), _peak_bytes(step(8))
    one_intermediate = tokens * inter * 4  # one [tokens, intermediate] float32 activation: 8 MiB
    # untiled: gate, its activation, up and the product (and their gradients) of all tokens at once
    assert untiled > 3 * one_intermediate
    # tiled: one chunk's worth of them (1/8 each) plus the [tokens, hidden] tensors and weight gradients
    assert tiled < 1.5 * one_intermediate
    assert tiled < untiled / 3
    print(f"peak bytes: untiled {untiled}, 8 chunks {tiled}")


def test_apply_monkey_patch_tiles_the_model_types_mlp_and_an_unknown_type_is_refused():
    model = _model()
    ids = torch.randint(0, 64, (1, 9))
    logits, _ = _loss_and_grads(model, ids)
    apply_monkey_patch(model, use_tiled_mlp=True, tiled_mlp_shards=2)
    assert "_verl_untiled_forward" in Qwen2MLP.__dict__
    tiled_logits, _ = _loss_and_grads(model, ids)
    torch.testing.assert_close(tiled_logits, logits, rtol=0, atol=1e-13)
    assert remove_tiled_mlp_monkey_patch() == ["Qwen2MLP"]
    assert "_verl_untiled_forward" not in Qwen2MLP.__dict__
    with pytest.raises(ValueError, match="TiledMLP does not support model_type='gpt2'"):
        apply_tiled_mlp_monkey_patch(model_type="gpt2")
    with pytest.raises(ValueError, match="num_shards=0"):
        apply_tiled_mlp_monkey_patch(num_shards=0, model_type="qwen2")


def test_patching_every_type_covers_the_shared_qwen2_class_once():
    patched = apply_tiled_mlp_monkey_patch(num_shards=2)
    assert patched == ["LlamaMLP", "Qwen2MLP", "Qwen3MLP"]
    model = copy.deepcopy(_model())
    model(input_ids=torch.randint(0, 64, (1, 5)), use_cache=False)
