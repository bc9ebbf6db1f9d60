"""Upstream's batch-level engine interface (`verl.workers.engine.batch_api`) on the FSDP engine in one
process: per-token outputs against each row run alone through the HF model, the gradient of a whole
batch's loss against a float64 autograd reference, and micro-batching that does not change the update."""

from __future__ import annotations

import functools

import pytest
import torch
from omegaconf import OmegaConf

from tests.distributed_helpers import make_ppo_batch, reference_response_log_probs
from verl.utils import tensordict_utils as tu
from verl.workers.config import ActorConfig, FSDPEngineConfig
from verl.workers.engine import EngineRegistry
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from verl.models.factory import make_tiny

    return make_tiny("tiny", str(tmp_path_factory.mktemp("tiny") / "model"), seed=0, dtype="float32")


def _engine(path, model_type="language_model", **engine_kwargs):
    engine_config = FSDPEngineConfig(fsdp_size=-1, dtype="auto", **engine_kwargs)  # a plain fp32 replica
    return EngineRegistry.new(
        model_type, "fsdp", OmegaConf.create({"path": path}), engine_config, {"lr": 1e-3, "clip_grad": 1.0}
    )


def _packed(batch, **settings):
    data = left_right_2_no_padding(batch.clone())
    tu.assign_non_tensor(data, **settings)
    return data


def test_infer_batch_gives_each_rows_log_probs_and_entropy(tiny_path):
    engine = _engine(tiny_path)
    batch = make_ppo_batch(batch_size=5, prompt_length=4, response_length=5, seed=1)
    data = _packed(batch, use_dynamic_bsz=True, max_token_len_per_gpu=10, temperature=0.7, calculate_entropy=True)
    with engine.eval_mode():
        out = engine.infer_batch(data)
    assert not engine.module.training
    assert out["loss"] == [] and out["metrics"] == {}
    mask = batch["response_mask"].bool()
    log_probs = no_padding_2_padding(out["model_output"]["log_probs"], data)
    entropy = no_padding_2_padding(out["model_output"]["entropy"], data)
    ref_lp, ref_ent = reference_response_log_probs(engine.module, batch, temperature=0.7)
    torch.testing.assert_close(log_probs[mask].double(), ref_lp[mask], atol=2e-5, rtol=0)
    torch.testing.assert_close(entropy[mask].double(), ref_ent[mask], atol=2e-5, rtol=0)


def _reference_grad_norm(path, batch, config) -> float:
    """The whole batch's PPO loss (token-mean, clipped ratio, positive advantages) in float64 autograd."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float64)
    mask = batch["response_mask"].to(torch.float64)
    rows = []
    prompt_length = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    for i in range(len(batch)):
        keep = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][keep]
        p, r = int(keep[:prompt_length].sum()), int(keep[prompt_length:].sum())
        logp = torch.log_softmax(model(input_ids=ids[None]).logits[0], dim=-1)
        token_lp = logp[p - 1 : p - 1 + r].gather(-1, ids[p : p + r, None])[:, 0]
        rows.append(torch.nn.functional.pad(token_lp, (0, mask.shape[1] - r)))
    log_prob = torch.stack(rows)
    ratio = torch.exp(log_prob - batch["old_log_probs"])
    adv = batch["advantages"]
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - config.clip_ratio, 1 + config.clip_ratio))
    ((pg * mask).sum() / mask.sum()).backward()
    return float(torch.sqrt(sum((p.grad**2).sum() for p in model.parameters())))


def test_train_batch_gradient_is_the_whole_batchs_and_micro_batching_does_not_change_the_update(tiny_path):
    batch = make_ppo_batch(batch_size=6, prompt_length=4, response_length=5, seed=2)
    g = torch.Generator().manual_seed(5)
    batch["old_log_probs"] = -torch.rand(6, 5, generator=g) - 3.0
    batch["advantages"] = torch.rand(6, 5, generator=g)
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    loss_fn = functools.partial(ppo_loss, config=config)
    grads, outputs = [], []
    for settings in (
        {"use_dynamic_bsz": True, "max_token_len_per_gpu": 12},  # several token-budget micro-batches
        {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 6},  # the whole batch at once
        {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 4},  # 4 + 2 rows
    ):
        engine = _engine(tiny_path)
        # the accumulated gradient of the micro-batches' losses, before any step
        engine.optimizer_zero_grad()
        engine.forward_backward_batch(_packed(batch, **settings), loss_fn)
        grads.append({name: p.grad.clone() for name, p in engine.module.named_parameters()})
        # the same through train_batch, which steps
        with engine.train_mode():
            outputs.append(engine.train_batch(_packed(batch, **settings), loss_function=loss_fn))
        assert engine.module.training
    assert len(outputs[0]["loss"]) > 2 and len(outputs[1]["loss"]) == 1 and len(outputs[2]["loss"]) == 2
    expected = _reference_grad_norm(tiny_path, batch.clone(), config)
    for out in outputs:
        assert out["metrics"]["grad_norm"] == pytest.approx(expected, rel=1e-4)
        assert sum(out["loss"]) == pytest.approx(sum(outputs[1]["loss"]), rel=1e-5)
    for other in grads[1:]:
        for name, grad in grads[0].items():
            torch.testing.assert_close(other[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_value_engine_infer_batch_gives_the_value_heads_outputs(tiny_path):
    engine = _engine(tiny_path, model_type="value_model")
    batch = make_ppo_batch(batch_size=3, prompt_length=4, response_length=4, seed=3)
    data = _packed(batch, use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
    values = no_padding_2_padding(engine.infer_batch(data)["model_output"]["values"], data)
    with torch.no_grad():
        for i in range(3):
            keep = batch["attention_mask"][i].bool()
            alone = engine.module(input_ids=batch["input_ids"][i][keep][None]).logits[0, :, 0]
            n = int(batch["response_mask"][i].sum())
            torch.testing.assert_close(values[i, :n], alone[-n - 1 : -1], atol=1e-5, rtol=0)


def test_batch_api_refusals_say_what_to_do(tiny_path):
    engine = _engine(tiny_path)
    batch = make_ppo_batch(batch_size=2, prompt_length=3, response_length=3, seed=4)
    padded = batch.clone()
    padded["loss_mask"] = padded["response_mask"]
    with pytest.raises(ValueError, match="left_right_2_no_padding"):
        engine.infer_batch(padded)
    with pytest.raises(ValueError, match="max_token_len_per_gpu"):
        engine.infer_batch(_packed(batch, use_dynamic_bsz=True))
    with pytest.raises(ValueError, match="loss_function"):
        engine.forward_backward_batch(_packed(batch, use_dynamic_bsz=False, micro_batch_size_per_gpu=1), None)
    frozen = EngineRegistry.new(
        "language_model", "fsdp", OmegaConf.create({"path": tiny_path}), {"fsdp_size": -1, "dtype": "auto"}
    )
    with pytest.raises(RuntimeError, match="without an optimizer_config"):
        frozen.train_batch(_packed(batch, use_dynamic_bsz=False, micro_batch_size_per_gpu=1), lambda **kw: None)


@pytest.mark.gpu
def test_batch_api_on_the_gpu_equals_the_cpu(tiny_path, monkeypatch):
    """The packed forward, the loss on the device and the step: an fp32 engine on CUDA gives the CPU engine's
    log-probs and gradient norm (TF32 off, so only summation order differs)."""
    from tests.distributed_helpers import device_preference, disable_tf32

    disable_tf32(monkeypatch)
    batch = make_ppo_batch(batch_size=6, prompt_length=4, response_length=5, seed=6)
    g = torch.Generator().manual_seed(7)
    batch["old_log_probs"] = -torch.rand(6, 5, generator=g) - 3.0
    batch["advantages"] = torch.rand(6, 5, generator=g)
    loss_fn = functools.partial(
        ppo_loss, config=ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    )
    results = {}
    for device in ("cpu", "cuda"):
        with device_preference(device):
            engine = _engine(tiny_path)
            data = _packed(batch, use_dynamic_bsz=True, max_token_len_per_gpu=16, calculate_entropy=True)
            log_probs = engine.infer_batch(data)["model_output"]["log_probs"]
            assert log_probs.device.type == device
            out = engine.train_batch(_packed(batch, use_dynamic_bsz=True, max_token_len_per_gpu=16), loss_fn)
            results[device] = (no_padding_2_padding(log_probs.cpu(), data), out["metrics"]["grad_norm"])
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(results["cuda"][0][mask], results["cpu"][0][mask], atol=1e-4, rtol=0)
    assert results["cuda"][1] == pytest.approx(results["cpu"][1], rel=1e-3)
