"""The actor on one CUDA device: FSDP2 with bf16 compute + fp32 reduce, remove-padding (flash-attn
varlen when installed), hybrid-engine offload. Skipped without a GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from tests.distributed_helpers import (
    assert_first_adamw_step_follows,
    device_preference,
    disable_tf32,
    free_port,
    make_ppo_batch,
    make_tiny_causal_lm,
)
from verl.protocol import DataProto

pytestmark = pytest.mark.gpu

ATTENTION = ["sdpa"] + (["flash_attention_2"] if importlib.util.find_spec("flash_attn") else [])


@pytest.mark.parametrize("attn_implementation", ATTENTION)
def test_bf16_fsdp2_actor_log_probs_update_and_offload(nccl_group, attn_implementation):
    from verl.utils import fsdp_utils
    from verl.workers.actor import DataParallelPPOActor

    td = make_ppo_batch(batch_size=8, seed=0)
    reference = make_tiny_causal_lm(dtype=torch.float32).to("cuda")
    model = make_tiny_causal_lm(dtype=torch.float32)
    model.set_attn_implementation(attn_implementation)
    model = fsdp_utils.apply_fsdp2(model)
    assert next(model.parameters()).device.type == "cuda"
    config = {
        "ppo_mini_batch_size": 8,
        "ppo_micro_batch_size_per_gpu": 4,
        "use_remove_padding": True,
        "grad_clip": 1.0,
        "policy_loss": {"loss_mode": "vanilla"},
    }
    actor = DataParallelPPOActor(config, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    data = DataProto.from_dict(tensors=dict(td.items()), meta_info={"temperature": 1.0, "micro_batch_size": 4})
    log_probs, _ = actor.compute_log_prob(data)
    with torch.no_grad():
        batch = td.to("cuda")
        logits = reference(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits[:, -td["responses"].shape[1] - 1 : -1]
        expected = torch.log_softmax(logits.float(), -1).gather(-1, batch["responses"][..., None])[..., 0]
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(log_probs[mask], expected[mask], atol=0.1, rtol=0.05)  # bf16 compute

    data.batch["old_log_probs"] = log_probs.cpu()
    data.batch["advantages"] = torch.randn(td["responses"].shape) * td["response_mask"]
    metrics = actor.update_policy(data)
    assert torch.isfinite(torch.tensor(metrics["actor/grad_norm"])).all()

    fsdp_utils.offload_fsdp_model_to_cpu(model)
    fsdp_utils.offload_fsdp_optimizer(actor.actor_optimizer)
    assert all(p.device.type == "cpu" for p in model.parameters())
    fsdp_utils.load_fsdp_model_to_device(model)
    fsdp_utils.load_fsdp_optimizer(actor.actor_optimizer)
    names = [name for name, tensor in fsdp_utils.iter_full_params(model, dtype=torch.bfloat16)]
    assert names == list(reference.state_dict())
    actor.update_policy(data)


@pytest.fixture(params=["nccl_only", "worker_group"])
def world_of_one(request, monkeypatch):
    """A world-size-1 group on GPU 0: NCCL alone (as above; the host-side micro-batch count of
    `use_dynamic_bsz` used to fail there with "No backend type associated with device type cpu"), or
    the workers' own `cpu:gloo,cuda:nccl` group (`verl.single_controller.base.worker`)."""
    from verl.single_controller.base.worker import init_process_group

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VERL_DEVICE", "auto")
    torch.cuda.set_device(0)
    if request.param == "nccl_only":
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    else:
        init_process_group(timeout_s=120)
    yield request.param
    dist.destroy_process_group()


@pytest.fixture
def exact_fp32_matmuls(monkeypatch):
    """fp32 matmuls without TF32 (the workers turn it on), so results depend only on summation order."""
    disable_tf32(monkeypatch)


def _fp32_fsdp_actor(config: dict, lr: float, seed: int = 0):
    from verl.utils import fsdp_utils
    from verl.workers.actor import DataParallelPPOActor

    model = make_tiny_causal_lm(seed=seed, dtype=torch.float32)
    model = fsdp_utils.apply_fsdp2(model, {"mixed_precision": {"param_dtype": "fp32", "reduce_dtype": "fp32"}})
    return DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=lr)), model


def test_dynamic_batch_log_probs_and_update_equal_fixed_micro_batches(world_of_one, exact_fp32_matmuls):
    """use_dynamic_bsz=True (token-budget micro-batches, balanced on the host and agreed over the
    group) gives the fixed-size split's log-probs and update. Tolerance 1e-5 absolute: fp32 compute
    without TF32, so the split changes only the order of float additions (~1e-7 relative)."""
    from verl.utils import fsdp_utils

    td = make_ppo_batch(batch_size=8, seed=0)  # rows of 2-11 tokens
    g = torch.Generator().manual_seed(1)
    advantages = torch.randn(td["responses"].shape, generator=g) * td["response_mask"]
    results = {}
    for dynamic in (False, True):
        config = {
            "ppo_mini_batch_size": 8,
            "ppo_micro_batch_size_per_gpu": 2,
            "use_dynamic_bsz": dynamic,
            "ppo_max_token_len_per_gpu": 24,
            "grad_clip": 1e9,
            "policy_loss": {"loss_mode": "vanilla"},
        }
        actor, model = _fp32_fsdp_actor(config, lr=0.1)
        meta = {"temperature": 1.0, "micro_batch_size": 2, "use_dynamic_bsz": dynamic, "max_token_len": 24}
        data = DataProto.from_dict(tensors=dict(td.items()), meta_info=meta)
        log_probs, _ = actor.compute_log_prob(data)
        if not dynamic:
            old_log_probs = log_probs.detach().cpu()
        data.batch["old_log_probs"] = old_log_probs
        data.batch["advantages"] = advantages
        metrics = actor.update_policy(data)
        weights = {name: tensor.detach().float().cpu() for name, tensor in fsdp_utils.iter_full_params(model)}
        results[dynamic] = (log_probs.detach().cpu(), weights, metrics["actor/grad_norm"])
    (fixed_lp, fixed_w, fixed_norm), (dyn_lp, dyn_w, dyn_norm) = results[False], results[True]
    mask = td["response_mask"].bool()
    torch.testing.assert_close(dyn_lp[mask], fixed_lp[mask], atol=1e-5, rtol=0)
    initial = dict(make_tiny_causal_lm(seed=0, dtype=torch.float32).state_dict())
    moved = max(float((fixed_w[n] - initial[n]).abs().max()) for n in fixed_w)
    assert moved > 1e-3, f"the fixed-split update barely moved the weights ({moved:.3g}); nothing is compared"
    for name in fixed_w:
        torch.testing.assert_close(dyn_w[name], fixed_w[name], atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    assert dyn_norm == pytest.approx(fixed_norm, rel=1e-5), (dyn_norm, fixed_norm)  # one mini-batch: one norm


LR = 1e-6


def test_bf16_fsdp2_update_at_lr_1e6_moves_weights_like_the_fp32_cpu_update(world_of_one):
    """One lr=1e-6 AdamW update of the FSDP2 actor in its GPU default (bf16 compute, fp32 master
    weights and gradient reduction) against the same update in fp32 on the CPU.

    The update: AdamW's first step moves each weight by lr * g / (|g| + eps), i.e. by lr with the
    sign of its gradient wherever |g| >> eps. With bf16 parameters a 1e-6 step is below bf16's 2^-8
    relative spacing and would vanish; with fp32 masters every weight whose fp32 step is ~lr moves
    by ~lr, and in the direction the fp32 gradient gives for >= 90% of them (bf16 compute perturbs
    gradients by ~1%, which flips only the signs of gradients near zero).

    Log-probs after the update: within 0.1 (max) and 0.02 (mean) of the fp32 ones. The update moves
    log-probs by ~1e-5, far below this; the bound is bf16's rounding of the logits (2^-9 relative,
    a few ops deep in a 2-layer model with |logits| < 4), so it checks that the bf16 actor computes
    the fp32 actor's function; the weight check above checks the update.
    """
    import copy

    from verl.utils import fsdp_utils
    from verl.workers.actor import DataParallelPPOActor

    td = make_ppo_batch(batch_size=8, seed=0)
    base = make_tiny_causal_lm(seed=0, dtype=torch.float32)
    before = {name: p.detach().clone() for name, p in base.named_parameters()}
    config = {
        "ppo_mini_batch_size": 8,
        "ppo_micro_batch_size_per_gpu": 4,
        "grad_clip": 1.0,
        "policy_loss": {"loss_mode": "vanilla"},
    }
    cpu_model = copy.deepcopy(base)
    cpu_actor = DataParallelPPOActor(
        config, cpu_model, torch.optim.AdamW(cpu_model.parameters(), lr=LR, weight_decay=0)
    )
    gpu_model = fsdp_utils.apply_fsdp2(copy.deepcopy(base))  # the GPU default: bf16 params in compute, fp32 masters
    gpu_actor = DataParallelPPOActor(
        config, gpu_model, torch.optim.AdamW(gpu_model.parameters(), lr=LR, weight_decay=0)
    )
    assert {p.dtype for p in gpu_model.parameters()} == {torch.float32}, "FSDP2 must keep fp32 master weights"

    meta = {"temperature": 1.0, "micro_batch_size": 4}
    with device_preference("cpu"):  # the reference stays on the CPU although CUDA is there
        old_log_probs, _ = cpu_actor.compute_log_prob(DataProto.from_dict(tensors=dict(td.items()), meta_info=meta))
    g = torch.Generator().manual_seed(1)
    tensors = {
        **dict(td.items()),
        "old_log_probs": old_log_probs,
        "advantages": torch.randn(td["responses"].shape, generator=g) * td["response_mask"],
    }
    with device_preference("cpu"):
        cpu_actor.update_policy(DataProto.from_dict(tensors=tensors, meta_info={"temperature": 1.0}))
    gpu_actor.update_policy(DataProto.from_dict(tensors=tensors, meta_info={"temperature": 1.0}))

    gpu_weights = {name: t.detach().float().cpu() for name, t in fsdp_utils.iter_full_params(gpu_model)}
    assert_first_adamw_step_follows(before, cpu_model, gpu_weights, LR)

    after = DataProto.from_dict(tensors=dict(td.items()), meta_info=meta)
    with device_preference("cpu"):
        cpu_lp, _ = cpu_actor.compute_log_prob(after)
    gpu_lp, _ = gpu_actor.compute_log_prob(DataProto.from_dict(tensors=dict(td.items()), meta_info=meta))
    mask = td["response_mask"].bool()
    diff = (gpu_lp.float().cpu() - cpu_lp.float())[mask].abs()
    assert float(diff.max()) <= 0.1 and float(diff.mean()) <= 0.02, (
        f"bf16 log-probs after the update: max |diff| {float(diff.max()):.3g}, mean {float(diff.mean()):.3g}"
    )
