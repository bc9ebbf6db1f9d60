"""The actor on one CUDA device: FSDP2 with bf16 compute + fp32 reduce, remove-padding (flash-attn
varlen when installed), hybrid-engine offload. Skipped without a GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from tests.distributed_helpers import free_port, make_ppo_batch, make_tiny_causal_lm
from verl.protocol import DataProto

pytestmark = pytest.mark.gpu

ATTENTION = ["sdpa"] + (["flash_attention_2"] if importlib.util.find_spec("flash_attn") else [])


@pytest.fixture
def nccl_group(monkeypatch):
    monkeypatch.setenv("VERL_DEVICE", "auto")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


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
