"""Loading the actor/reference/critic model on several ranks (the FSDP engine): rank 0 reads the
checkpoint, the other ranks build the model on the meta device and receive rank 0's weights by
broadcast (`verl.utils.fsdp_utils.load_full_state_from_rank0`).

References are independent of the loading path: the tensors stored in the checkpoint's
safetensors file, and the rotary buffers of a model built directly from the config.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.distributed_helpers import run_distributed, tiny_qwen2_config
from verl.workers.engine import FSDPEngineWithLMHead, FSDPEngineWithValueHead


def _save_checkpoint(path, tie_word_embeddings: bool, seed: int = 0) -> str:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(tie_word_embeddings), dtype=torch.float32)
    model.save_pretrained(path)
    return str(path)


def _every_rank_holds_the_checkpoint(rank, world_size, path, fsdp_size):
    from torch.distributed.fsdp import FSDPModule

    from verl.utils.fsdp_utils import iter_full_params

    model = FSDPEngineWithLMHead(OmegaConf.create({"path": path}), {"fsdp_size": fsdp_size, "dtype": "auto"})
    sharded = isinstance(model.module, FSDPModule)
    assert sharded == (fsdp_size == 2), type(model.module)
    stored = load_file(os.path.join(path, "model.safetensors"))
    full = dict(iter_full_params(model.module))
    tied = model.module.config.tie_word_embeddings
    expected = {**stored, "lm_head.weight": stored["model.embed_tokens.weight"]} if tied else stored
    assert full.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(full[name], tensor), f"rank {rank}: {name} differs from the checkpoint"
    # a tie stays a tie (one parameter), so training updates both names at once
    head, embed = model.module.lm_head.weight, model.module.model.embed_tokens.weight
    assert (head is embed) == tied
    # buffers outside the state dict (rotary frequencies) were computed on rank 0 and sent
    fresh = AutoModelForCausalLM.from_config(model.module.config)
    for name, buffer in fresh.named_buffers():
        assert torch.equal(dict(model.module.named_buffers())[name].cpu(), buffer), name


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("fsdp_size", [2, -1], ids=["fsdp2", "replicas"])
def test_every_rank_gets_the_checkpoints_weights_exactly_though_only_rank_0_reads_it(tmp_path, tie, fsdp_size):
    path = _save_checkpoint(tmp_path / "ckpt", tie_word_embeddings=tie)
    run_distributed(_every_rank_holds_the_checkpoint, 2, path, fsdp_size)


def _the_critics_fresh_head_is_rank_0s_everywhere(rank, world_size, path):
    import torch.distributed as dist

    from verl.utils.fsdp_utils import iter_full_params

    critic = FSDPEngineWithValueHead(OmegaConf.create({"path": path}), {"fsdp_size": 2, "dtype": "auto"})
    full = dict(iter_full_params(critic.module))
    stored = load_file(os.path.join(path, "model.safetensors"))
    for name, tensor in stored.items():  # the backbone is the checkpoint's
        if name.startswith("model."):
            assert torch.equal(full[name], tensor), name
    heads = [None] * world_size
    dist.all_gather_object(heads, full["score.weight"])
    assert torch.equal(heads[0], heads[1]) and heads[0].abs().sum() > 0


def test_a_critics_backbone_is_the_checkpoints_and_its_fresh_value_head_is_the_same_on_every_rank(tmp_path):
    path = _save_checkpoint(tmp_path / "ckpt", tie_word_embeddings=True)
    run_distributed(_the_critics_fresh_head_is_rank_0s_everywhere, 2, path)


# ------------------------------------------------------------------------------ host memory
# A ~412 MB fp32 model (hidden 1024, 8 layers, vocabulary 263), sharded over 2 ranks. Each rank
# reports how far its resident memory rose while building the model (peak RSS, reset just before).
# Run in a fresh interpreter with glibc's mmap threshold fixed at 128 KiB, so that every freed
# tensor leaves the process at once and the peak is live memory, not malloc's cache.
def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(key + r":\s+(\d+)", f.read()).group(1)) * 1024


def _report_host_memory_while_loading(rank, world_size, path, out):
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    start = _status("VmRSS")
    model = FSDPEngineWithLMHead(OmegaConf.create({"path": path}), {"fsdp_size": 2, "dtype": "auto"})
    growth = _status("VmHWM") - start
    local = sum(p.to_local().numel() * p.element_size() for p in model.module.parameters())
    reports = [None] * world_size
    dist.all_gather_object(reports, {"peak_growth": growth, "local_param_bytes": local})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(reports, f)


# The ranks' function lives in this module, not in the script: the ranks start from a forkserver,
# which imports a function by its module's name, and a `python -c` script's __main__ has none.
_MEMORY_SCRIPT = r"""
import sys
import torch
from transformers import AutoModelForCausalLM, Qwen2Config
from tests.distributed_helpers import run_distributed
from tests.workers.test_sharded_loading import _report_host_memory_while_loading

path, out = sys.argv[1], sys.argv[2]
config = Qwen2Config(vocab_size=263, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                     num_attention_heads=16, num_key_value_heads=16, head_dim=64, tie_word_embeddings=True)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
del config
run_distributed(_report_host_memory_while_loading, 2, path, out)
"""


def test_ranks_above_zero_never_hold_a_full_copy_of_the_model_on_the_host(tmp_path):
    out = tmp_path / "memory.json"
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, str(tmp_path / "big"), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    model_bytes = os.path.getsize(tmp_path / "big" / "model.safetensors")
    rank0, rank1 = json.loads(out.read_text())
    mb = {k: f"{v / 1e6:.0f} MB" for k, v in (("model", model_bytes), ("rank0", rank0["peak_growth"]))}
    mb["rank1"] = f"{rank1['peak_growth'] / 1e6:.0f} MB"
    print(f"host memory while loading (peak RSS growth): {mb}")
    assert model_bytes > 400e6
    # rank 1 holds its half of the parameters plus one full tensor in flight (~12 MB here), not the model
    assert rank1["local_param_bytes"] < 0.55 * model_bytes
    assert rank1["peak_growth"] < 0.7 * model_bytes, (
        f"rank 1's host memory rose by {rank1['peak_growth'] / 1e6:.0f} MB while loading a "
        f"{model_bytes / 1e6:.0f} MB model sharded in two"
    )
    # the measurement sees a full copy where there is one: rank 0 reads the whole checkpoint
    assert rank0["peak_growth"] > model_bytes, f"rank 0 rose by only {rank0['peak_growth'] / 1e6:.0f} MB"
