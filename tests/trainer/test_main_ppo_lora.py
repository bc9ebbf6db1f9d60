"""`python -m verl.trainer.main_ppo ... actor_rollout_ref.model.lora_rank=8` end to end on CPU (real Ray,
2 worker processes, FSDP2, the built-in engine), then `python -m verl.model_merger merge` on its
checkpoint: the merged directory loads in transformers and equals peft's own merge of the saved
adapter (`PeftModel.from_pretrained(base, lora_adapter).merge_and_unload()`). A second run starts
from a trained adapter (`model.lora_adapter_path`, with `lora_rank` left at 0).

The run joins the session's shared Ray cluster (`shared_ray_cluster`) through RAY_ADDRESS instead of starting
its own; a KL loss is on, so the reference policy (the base model with the adapters off) is used.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.trainer.main_ppo_runs import ROOT, demo_script_cmd, read_metrics, run_main_ppo

pytestmark = pytest.mark.slow  # the slow tier (make test-all, CI): see docs/testing.md


def _run_lora_demo(shared_ray_cluster, tmp_path, lora: list[str], steps: int) -> list[dict]:
    """The CPU demo script with `lora` overrides and a KL loss for `steps` steps, checkpointing the last;
    its metrics records."""
    cmd = demo_script_cmd(
        tmp_path,
        steps,
        *lora,
        "actor_rollout_ref.actor.optim.lr=1e-2",  # adapters need a larger step than full fine-tuning
        "actor_rollout_ref.actor.use_kl_loss=True",
        f"trainer.save_freq={steps}",
    )
    run_main_ppo(cmd, tmp_path, timeout=600, cluster=shared_ray_cluster)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    return records


def test_lora_run_trains_two_steps_and_its_checkpoint_merges_into_a_transformers_model(shared_ray_cluster, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from verl.models import bundled_model_path

    lora = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"]
    records = _run_lora_demo(shared_ray_cluster, tmp_path, lora, steps=2)
    assert records[-1]["data"]["actor/kl_loss"] > 0  # step 1 moved the adapters off the reference (the base)

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    actor_dir = tmp_path / "ckpt" / "global_step_2" / "actor"
    target = tmp_path / "merged"
    merge = [sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp"]
    merge += ["--local_dir", str(actor_dir), "--target_dir", str(target)]
    subprocess.run(merge, cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=300)

    merged = AutoModelForCausalLM.from_pretrained(target).state_dict()
    base = AutoModelForCausalLM.from_pretrained(bundled_model_path())
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    reference = PeftModel.from_pretrained(base, actor_dir / "lora_adapter").merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-6, msg=name)
    moved = [n for n in reference if not torch.equal(merged[n], base_state[n])]
    assert any(".q_proj." in n for n in moved) and not any("norm" in n for n in moved)


def test_run_started_from_an_adapter_trains_it_against_the_base_model_as_reference(shared_ray_cluster, tmp_path):
    from peft import LoraConfig, get_peft_model

    from verl.models import bundled_model_path
    from verl.utils.model import load_causal_lm

    config = LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(load_causal_lm(bundled_model_path()), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(0)) * 0.2)
    model.save_pretrained(str(tmp_path / "adapter"))

    records = _run_lora_demo(
        shared_ray_cluster, tmp_path, [f"actor_rollout_ref.model.lora_adapter_path={tmp_path / 'adapter'}"], 1
    )
    # fresh adapters start at the reference (KL 0 at step 1); this one starts off the base model
    assert records[0]["data"]["actor/kl_loss"] > 1e-4, records[0]["data"]["actor/kl_loss"]
    saved = json.loads(
        (tmp_path / "ckpt" / "global_step_1" / "actor" / "lora_adapter" / "adapter_config.json").read_text()
    )
    assert (saved["r"], saved["lora_alpha"], sorted(saved["target_modules"])) == (2, 4, ["q_proj", "v_proj"])
