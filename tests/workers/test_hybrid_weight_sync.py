"""The hybrid engine's weight sync (`verl.workers.rollout_weights.sync_rollout_weights`, what
`generate_sequences` runs before every generation): an FSDP2 actor's fp32 master weights reach the
built-in engine exactly, i.e. bit-equal to the masters cast to the engine's dtype.

The actor is the worker's own engine (`FSDPEngineWithLMHead`, FSDP2 over a world of one: gloo on CPU,
NCCL on CUDA); its weights are moved away from the checkpoint the engine was built from, and the
engine is asleep (weights freed) before the sync, so an engine that kept anything of its own
would show. Each check runs in a fresh interpreter (it owns the default process group).
"""

from __future__ import annotations

import pytest

from tests.distributed_helpers import run_in_fresh_interpreter


def _case_hybrid_sync(rollout_dtype_name: str) -> dict:
    import os
    import tempfile

    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from safetensors.torch import load_file
    from torch.distributed.fsdp import FSDPModule

    from verl.models.factory import make_tiny
    from verl.single_controller.base.worker import get_free_port
    from verl.utils import device as dev
    from verl.utils.fsdp_utils import iter_full_params
    from verl.workers.engine import FSDPEngineWithLMHead
    from verl.workers.rollout.hf_rollout import HFRollout
    from verl.workers.rollout_weights import rollout_dtype, sync_rollout_weights

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    dev.set_device()
    dist.init_process_group(
        dev.get_dist_backend(), init_method=f"tcp://127.0.0.1:{get_free_port()}", rank=0, world_size=1
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny("tiny", os.path.join(tmp, "tiny"), seed=0, dtype="float32")
        checkpoint = load_file(os.path.join(path, "model.safetensors"))
        actor = FSDPEngineWithLMHead(OmegaConf.create({"path": path}), {"fsdp_size": 1, "dtype": "auto"})
        config = OmegaConf.create({"dtype": rollout_dtype_name})
        rollout = HFRollout(path, config=config, device=dev.get_device())
    assert isinstance(actor.module, FSDPModule)
    torch.manual_seed(1)
    with torch.no_grad():
        for param in actor.module.parameters():
            local = param.to_local()
            local.add_(0.05 * torch.randn_like(local))
    rollout.sleep()  # as the worker leaves it between generations: weights freed
    dtype = rollout_dtype(config)
    sync_rollout_weights(actor, rollout, dtype)

    expected = {name: tensor.to(dtype) for name, tensor in iter_full_params(actor.module)}
    decoder = rollout.engine.decoder
    names = decoder.parameter_names()
    # the engine's own tensors, by HF name (views into its fused buffers)
    held = {name: decoder._targets[name] for name in names}
    mismatched = [n for n in names if held[n].dtype != dtype or not torch.equal(held[n], expected[n])]
    unchanged = [n for n in names if torch.equal(held[n], checkpoint[n].to(held[n].device, dtype))]
    result = {
        "device": str(dev.get_device()),
        "backend": dist.get_backend(),
        "dtype": str(dtype),
        "num_checked": len(names),
        "num_expected": len(expected),
        "mismatched": mismatched,
        "still_the_checkpoints": unchanged,
    }
    dist.destroy_process_group()
    return result


def _check(result: dict, dtype: str) -> None:
    assert result["dtype"] == dtype, result
    assert result["num_checked"] >= result["num_expected"] - 1, result  # a tied lm_head is the embedding
    assert result["mismatched"] == [], f"the engine's weights differ from the cast masters: {result}"
    assert result["still_the_checkpoints"] == [], f"the sync left weights from the engine's own load: {result}"


def test_on_cpu_the_engine_gets_the_actors_masters_cast_to_bf16_bit_equal():
    result = run_in_fresh_interpreter("tests.workers.test_hybrid_weight_sync", "_case_hybrid_sync", "bfloat16")
    assert result["backend"] == "gloo", result
    _check(result, "torch.bfloat16")


@pytest.mark.gpu
def test_on_cuda_the_engine_gets_the_actors_masters_cast_to_bf16_bit_equal():
    result = run_in_fresh_interpreter("tests.workers.test_hybrid_weight_sync", "_case_hybrid_sync", "auto")
    assert result["backend"] == "nccl" and result["device"].startswith("cuda"), result
    _check(result, "torch.bfloat16")
