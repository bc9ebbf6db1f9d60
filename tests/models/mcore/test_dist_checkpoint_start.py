"""`megatron.use_dist_checkpointing`: an HF model converted once (upstream's script name and
arguments) into a megatron dist checkpoint at tp=1 starts a tp=2 actor and critic with exactly the
HF weights, each rank reading its own shards; a verl megatron checkpoint serves as a start too; a
key prefix round-trips; wrong paths and prefixes are clear errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.distributed_helpers import run_distributed
from tests.megatron_helpers import tiny_hf_model

pytestmark = pytest.mark.slow  # the slow tier (make test-all, CI): see docs/testing.md

REPO = Path(__file__).resolve().parents[3]


def _convert(hf_dir: Path, out: Path, *extra: str) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "converter_hf_to_mcore.py"),
            "--hf_model_path",
            str(hf_dir),
            "--output_path",
            str(out),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "metadata.json").is_file()


def _start_from_dist_checkpoint(rank, world_size, hf_dir, ckpt, prefixed, wrong, verl_ckpt):
    from verl.utils.megatron.parallel_state import destroy_model_parallel
    from verl.workers.engine import MegatronEngineWithLMHead, MegatronEngineWithValueHead

    def _trained_engine(model_cfg, megatron_cfg, value_head=False):
        engine_cls = MegatronEngineWithValueHead if value_head else MegatronEngineWithLMHead
        engine_cls.init_parallel(megatron_cfg)
        return engine_cls(model_cfg, megatron_cfg, {"lr": 1e-3, "total_training_steps": 1})

    hf_model = tiny_hf_model("qwen2")
    want = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    model_cfg = OmegaConf.create({"path": hf_dir})

    def megatron(path, prefix=""):
        return {
            "tensor_model_parallel_size": 2,
            "use_dist_checkpointing": True,
            "dist_checkpointing_path": path,
            "dist_checkpointing_prefix": prefix,
            "seed": 7,
        }

    actor = _trained_engine(model_cfg, megatron(ckpt))
    got = dict(actor.iter_hf_params())
    assert sorted(got) == sorted(want)
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name
    # a verl megatron checkpoint (weights and Adam moments) serves as a start too
    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager
    from verl.utils.optim import build_optimizer

    with torch.no_grad():
        actor.chunks[0].decoder.final_layernorm.weight.add_(1.0)
    optimizer = build_optimizer(actor.parameters(), {"lr": 1e-3, "total_training_steps": 1})
    MegatronCheckpointManager(actor.chunks, optimizer, hf_config=actor.hf_config).save_checkpoint(
        verl_ckpt, global_step=1
    )
    destroy_model_parallel()
    restarted = _trained_engine(model_cfg, megatron(verl_ckpt))
    assert torch.equal(dict(restarted.iter_hf_params())["model.norm.weight"], want["model.norm.weight"] + 1.0)
    destroy_model_parallel()

    # the prefixed checkpoint loads with its prefix, and names the likely cause without it
    actor = _trained_engine(model_cfg, megatron(prefixed, prefix="model."))
    assert torch.equal(dict(actor.iter_hf_params())["model.norm.weight"], want["model.norm.weight"])
    destroy_model_parallel()
    with pytest.raises(RuntimeError, match="dist_checkpointing_prefix"):
        _trained_engine(model_cfg, megatron(prefixed))
    destroy_model_parallel()
    with pytest.raises(FileNotFoundError, match="not a megatron dist checkpoint"):
        _trained_engine(model_cfg, megatron(wrong))
    destroy_model_parallel()

    # critic: the body from the LM checkpoint, a fresh head as HF initialises one (same on both ranks)
    critic = _trained_engine(model_cfg, megatron(ckpt), value_head=True)
    got = dict(critic.iter_hf_params())
    for name, tensor in got.items():
        if name.startswith("model."):
            assert torch.equal(tensor, want[name]), name
    head = got["score.weight"]
    assert torch.equal(got["score.bias"], torch.zeros(1))
    assert 0.005 < float(head.std()) < 0.05  # initializer_range 0.02
    both = [torch.empty_like(head) for _ in range(world_size)]
    torch.distributed.all_gather(both, head)
    assert torch.equal(both[0], both[1])
    destroy_model_parallel()


def test_actor_and_critic_start_from_a_converted_dist_checkpoint_at_another_layout(tmp_path):
    hf_dir = tmp_path / "hf"
    tiny_hf_model("qwen2").save_pretrained(hf_dir)
    _convert(hf_dir, tmp_path / "mcore")
    _convert(hf_dir, tmp_path / "mcore_prefixed", "--prefix", "model.")
    run_distributed(
        _start_from_dist_checkpoint,
        2,
        str(hf_dir),
        str(tmp_path / "mcore"),
        str(tmp_path / "mcore_prefixed"),
        str(tmp_path),
        str(tmp_path / "verl_ckpt" / "actor"),
    )
