"""The megatron workers called directly without Ray (one process, gloo): mixed precision.

`megatron.dtype=bf16` must train: the parameters (the optimizer's master weights) stay float32 and
only the forward runs in bf16. With bf16 parameters, an AdamW step at lr 1e-6 (~1e-6 per weight)
is below bf16's 2^-8 relative spacing for every weight above ~2.6e-4 in magnitude and rounds back
to the old value.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed_helpers import assert_first_adamw_step_follows, device_preference, make_ppo_batch
from verl.models import bundled_model_path
from verl.protocol import DataProto
from verl.trainer.config import load_ppo_config

pytest.importorskip("megatron.core", reason="needs megatron-core")

LR = 1e-6


@pytest.fixture
def one_process(one_process):
    """The shared one-rank setup (tests/distributed_helpers.py); megatron's groups go before the
    process group it destroys."""
    yield
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()


def _actor_worker(dtype: str):
    from verl.workers.megatron_workers import ActorRolloutRefWorker

    cfg = load_ppo_config(
        [
            f"actor_rollout_ref.model.path={bundled_model_path()}",
            "actor_rollout_ref.actor.strategy=megatron",
            f"actor_rollout_ref.actor.megatron.dtype={dtype}",
            f"actor_rollout_ref.actor.optim.lr={LR}",
            "actor_rollout_ref.actor.optim.weight_decay=0.0",
            "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "trainer.n_gpus_per_node=1",
        ],
        config_name="arith_demo_megatron",
    )
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor")
    worker.init_model()
    return worker


def _update_batch() -> DataProto:
    td = make_ppo_batch(batch_size=8, prompt_length=6, response_length=5, seed=3)
    g = torch.Generator().manual_seed(4)
    td["old_log_probs"] = -3.0 + 0.1 * torch.randn(td["responses"].shape, generator=g)
    td["advantages"] = torch.randn(td["responses"].shape, generator=g) * td["response_mask"]
    return DataProto.from_dict(tensors=dict(td.items()), meta_info={"temperature": 1.0})


def test_bf16_actor_keeps_fp32_master_weights_and_an_lr_1e6_step_moves_them(one_process):
    worker = _actor_worker("bf16")
    chunks = worker.actor_model.chunks
    params = dict(chunks[0].named_parameters())
    assert {p.dtype for p in params.values()} == {torch.float32}, "the master weights must stay fp32"
    seen = []  # the compute dtype: what a projection without bias (the MLP's first) produces
    linear = chunks[0].decoder.layers[0].mlp.linear_fc1
    handle = linear.register_forward_hook(lambda module, args, output: seen.append(output[0].dtype))
    before = {name: p.detach().clone() for name, p in params.items()}
    worker.update_actor(_update_batch())
    handle.remove()
    assert seen and set(seen) == {torch.bfloat16}, f"the forward ran in {set(seen)}, not bf16"
    for name, param in params.items():
        delta = (param.detach() - before[name]).abs()
        # Adam's first step moves a weight by ~lr wherever its gradient is nonzero (fp32 spacing:
        # <= 1.2e-7 below magnitude 1)
        assert 0.5 * LR < float(delta.max()) < 2 * LR, f"{name}: largest change {float(delta.max()):.3g}"
        # the same change on bf16 weights (the old megatron.dtype=bf16 parameters) would vanish
        as_bf16 = before[name].bfloat16()
        lost = ((as_bf16.float() + (param.detach() - before[name])).bfloat16() == as_bf16).float().mean()
        assert float(lost) > 0.9, f"{name}: only {float(lost):.2f} of a bf16 copy would have stayed put"


def test_fp16_is_refused_for_a_trained_model(one_process):
    with pytest.raises(ValueError, match="fp16 training needs loss scaling"):
        _actor_worker("fp16")


def _fsdp_view(actor_cfg) -> dict:
    """The megatron actor's section as the FSDP actor's: the keys both have, plain values (its
    `_target_` and megatron-only sections would name the other class)."""
    import dataclasses

    from omegaconf import OmegaConf

    from verl.workers.config import FSDPActorConfig

    shared = {f.name for f in dataclasses.fields(FSDPActorConfig)} - {"_target_", "optim"}
    plain = OmegaConf.to_container(OmegaConf.structured(actor_cfg), resolve=True)
    return {key: value for key, value in plain.items() if key in shared}


@pytest.fixture
def one_gpu_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VERL_DEVICE", "cuda")
    yield
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.gpu
def test_bf16_megatron_update_on_gpu_moves_weights_like_the_fp32_cpu_update(one_gpu_process, tmp_path):
    """One lr=1e-6 AdamW update of the megatron actor at megatron.dtype=bf16 on the GPU against the
    same update of the plain HF model in fp32 on the CPU (the FSDP actor's code, which the megatron
    actor equals in fp32: tests/workers/actor/test_megatron_actor.py).

    Every weight tensor moves by ~lr (AdamW's first step, fp32 master weights), in the fp32 update's
    direction for >= 90% of the weights whose fp32 step is clearly ~lr; log-probs after the update
    are within 0.1 (max) / 0.02 (mean) of the fp32 ones: bf16's logit rounding, as for FSDP2
    (tests/workers/actor/test_dp_actor_gpu.py), on a 4-layer model. Then a checkpoint save, whose
    Adam step count is a host-side collective on the workers' group, completes."""
    from verl.models.mcore import mcore_to_hf_named_tensors
    from verl.utils.model import load_causal_lm
    from verl.workers.actor.dp_actor import DataParallelPPOActor

    worker = _actor_worker("bf16")
    chunks = worker.actor_model.chunks
    assert next(chunks[0].parameters()).device.type == "cuda"
    reference = load_causal_lm(bundled_model_path())  # fp32 on the CPU
    before = {name: p.detach().clone() for name, p in reference.named_parameters()}
    ref_actor = DataParallelPPOActor(
        _fsdp_view(worker.actor._cfg),
        reference,
        torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8),
    )
    data = _update_batch()
    worker.update_actor(data)
    with device_preference("cpu"):  # the reference stays on the CPU although CUDA is there
        ref_actor.update_policy(_update_batch())

    after = {
        name: t.detach().float().cpu() for name, t in mcore_to_hf_named_tensors(chunks, worker.actor_model.hf_config)
    }
    assert_first_adamw_step_follows(before, reference, after, LR)

    meta = {"temperature": 1.0, "micro_batch_size": 4}
    scored = _update_batch()
    scored.meta_info.update(meta)
    gpu_lp, _ = worker.actor.compute_log_prob(scored)
    scored = _update_batch()
    scored.meta_info.update(meta)
    with device_preference("cpu"):
        cpu_lp, _ = ref_actor.compute_log_prob(scored)
    mask = scored.batch["response_mask"].bool()
    diff = (gpu_lp.float().cpu() - cpu_lp.float())[mask].abs()
    assert float(diff.max()) <= 0.1 and float(diff.mean()) <= 0.02, (
        f"bf16 log-probs after the update: max |diff| {float(diff.max()):.3g}, mean {float(diff.mean()):.3g}"
    )

    pytest.importorskip("psutil", reason="megatron's dist_checkpointing needs psutil")
    worker.save_checkpoint(str(tmp_path / "ckpt"), global_step=1)
    assert (tmp_path / "ckpt").is_dir()
