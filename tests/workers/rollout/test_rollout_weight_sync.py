"""Weight sync and sleep/wake: after update_weights the engine generates what the trained model
generates; sleep really frees the engine's memory; misuse is a clear error."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tests.workers.rollout.rollout_helpers import build_model, hf_greedy_loop, left_padded_prompts, sync_from_fsdp2
from verl.workers.rollout.native.engine import GenerationEngine
from verl.workers.rollout.sampling import SamplingParams

GREEDY = SamplingParams(do_sample=False)
LENGTHS = [6, 2, 4]
NEW = 10


def _trained_copy(model, steps: int = 5, seed: int = 1):
    """A copy of `model` after a few real AdamW steps on a language-modelling loss."""
    trained = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(trained.parameters(), lr=3e-2)
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(3, model.config.vocab_size, (8, 12), generator=gen)
    for _ in range(steps):
        loss = trained(input_ids=data, labels=data).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return trained.eval()


def _greedy(engine, prompts):
    return engine.generate(*prompts, NEW, GREEDY, pad_token_id=0).responses


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("allow_native", [True, False])
def test_after_weight_sync_engine_greedy_equals_trained_model_greedy(arch, allow_native):
    model = build_model(arch)
    engine = GenerationEngine.from_model(model, device="cpu", allow_native=allow_native)
    trained = _trained_copy(model)
    prompts = left_padded_prompts(LENGTHS)
    before = _greedy(engine, prompts)
    expected = hf_greedy_loop(trained, *prompts, NEW)
    assert not torch.equal(before, expected), "training did not change greedy outputs; the test would prove nothing"

    # streamed one tensor at a time, as an FSDP gather would produce them
    stream = ((name, param.detach().clone()) for name, param in trained.named_parameters())
    metrics = engine.update_weights(stream)
    assert metrics["timing_s/update_weights"] >= 0
    torch.testing.assert_close(_greedy(engine, prompts), expected, rtol=0, atol=0)


def test_sync_accepts_wrapper_prefixes_and_base_model_names(qwen2_model):
    engine = GenerationEngine.from_model(qwen2_model, device="cpu")
    trained = _trained_copy(qwen2_model)
    prompts = left_padded_prompts(LENGTHS)
    renamed = []
    for i, (name, param) in enumerate(trained.state_dict().items()):
        if i % 2:
            name = "_fsdp_wrapped_module." + name.replace("layers.", "layers._checkpoint_wrapped_module.", 1)
        elif name.startswith("model."):
            name = name[len("model.") :]
        renamed.append((name, param))
    engine.update_weights(renamed)
    torch.testing.assert_close(_greedy(engine, prompts), hf_greedy_loop(trained, *prompts, NEW), rtol=0, atol=0)


def test_sync_rejects_unknown_names_and_wrong_shapes(qwen2_model):
    engine = GenerationEngine.from_model(qwen2_model, device="cpu")
    with pytest.raises(KeyError, match="model.layers.9.mlp.up_proj.weight"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(256, 128))])
    with pytest.raises(ValueError, match=r"shape \(3, 3\).*expects \(128,\)"):
        engine.update_weights([("model.norm.weight", torch.zeros(3, 3))])


def _storages(engine):
    d = engine.decoder
    tensors = list(d.weights.values()) + [d.k_cache, d.v_cache, d.key_bias]
    return [StorageWeakRef(t.untyped_storage()) for t in tensors]


def test_sleep_releases_every_weight_and_cache_storage_and_wake_up_needs_a_sync(qwen2_model):
    engine = GenerationEngine.from_model(qwen2_model, device="cpu")
    prompts = left_padded_prompts(LENGTHS)
    expected = _greedy(engine, prompts)
    refs = _storages(engine)
    assert engine.memory_bytes()["weights"] > 0 and engine.memory_bytes()["kv_cache"] > 0

    engine.sleep()
    assert all(ref.expired() for ref in refs), "a weight or cache buffer is still referenced after sleep()"
    assert engine.memory_bytes() == {"weights": 0, "kv_cache": 0}
    with pytest.raises(RuntimeError, match="sleeping.*wake_up"):
        _greedy(engine, prompts)
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.update_weights(qwen2_model.named_parameters())

    engine.wake_up()
    with pytest.raises(RuntimeError, match="not synced since wake_up"):
        _greedy(engine, prompts)
    engine.update_weights(list(qwen2_model.named_parameters())[:3])
    with pytest.raises(RuntimeError, match="not synced since wake_up"):
        _greedy(engine, prompts)
    engine.update_weights(qwen2_model.named_parameters())
    torch.testing.assert_close(_greedy(engine, prompts), expected, rtol=0, atol=0)


def test_sleep_level_one_frees_the_cache_and_keeps_the_weights(qwen2_model):
    engine = GenerationEngine.from_model(qwen2_model, device="cpu")
    prompts = left_padded_prompts(LENGTHS)
    expected = _greedy(engine, prompts)
    cache_ref = StorageWeakRef(engine.decoder.k_cache.untyped_storage())
    engine.sleep(level=1)
    assert cache_ref.expired() and engine.memory_bytes()["weights"] > 0
    engine.wake_up()
    torch.testing.assert_close(_greedy(engine, prompts), expected, rtol=0, atol=0)


def test_generic_path_sleep_releases_parameter_storage(qwen2_model):
    engine = GenerationEngine.from_model(qwen2_model, device="cpu", allow_native=False)
    prompts = left_padded_prompts(LENGTHS)
    expected = _greedy(engine, prompts)
    refs = [StorageWeakRef(p.untyped_storage()) for p in engine.decoder.model.parameters()]
    engine.sleep()
    assert all(ref.expired() for ref in refs) and engine.memory_bytes()["weights"] == 0
    engine.wake_up()
    engine.update_weights(qwen2_model.named_parameters())
    torch.testing.assert_close(_greedy(engine, prompts), expected, rtol=0, atol=0)


_RSS_SCRIPT = textwrap.dedent(
    """
    import gc, psutil, torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from verl.workers.rollout.native.engine import GenerationEngine
    config = Qwen2Config(vocab_size=64, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    model = Qwen2ForCausalLM(config)
    engine = GenerationEngine.from_model(model, device="cpu")
    del model; gc.collect()
    ids = torch.randint(3, 64, (16, 32))
    engine.generate(ids, torch.ones_like(ids), 64)
    rss = lambda: psutil.Process().memory_info().rss
    before, held = rss(), sum(engine.memory_bytes().values())
    engine.sleep(); gc.collect()
    after = rss()
    print(held, before - after)
    """
)


def test_sleep_returns_the_memory_to_the_operating_system():
    """RSS drops by the engine's weights + KV cache (~110 MB). glibc's fixed mmap threshold makes
    every large buffer its own mapping, so a freed buffer leaves the process immediately."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    held, released = map(int, out.stdout.split()[-2:])
    assert held > 100e6
    assert released > 0.95 * held, (
        f"sleep() freed {released / 1e6:.1f} MB of RSS but the engine held {held / 1e6:.1f} MB"
    )


def test_sync_from_an_fsdp2_sharded_model_gathers_dtensors(qwen2_model, tmp_path):
    """A real FSDP2 module (1-rank gloo group): its DTensor state dict streams into the engine."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("this process already belongs to a process group; the test needs its own 1-rank group")
    engine = GenerationEngine.from_model(qwen2_model, device="cpu")
    trained = _trained_copy(qwen2_model)
    prompts = left_padded_prompts(LENGTHS)
    expected = hf_greedy_loop(trained, *prompts, NEW)
    sync_from_fsdp2(engine, trained, tmp_path)
    torch.testing.assert_close(_greedy(engine, prompts), expected, rtol=0, atol=0)
