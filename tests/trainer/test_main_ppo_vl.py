"""`python -m verl.trainer.main_ppo` GRPO on a vision-language model end to end on CPU (docs/multimodal.md):
the tiny-vl preset (transformers' Qwen2.5-VL; tiny-qwen3-vl, Qwen3-VL, with VERL_TEST_VL_PRESETS), on the synthetic colour task (one image per prompt,
parquet written here), 2 worker processes, FSDP2, the built-in engine, with `trainer.balance_batch`
reordering the rows. Two steps, validation and a checkpoint at step 2; a second run resumes it for
step 3; the model merger's export of the checkpoint loads in transformers with its processor.

That the images reached both models: the rollout engine and the FSDP actor each run the rows with
their images (their own tests show that another image changes the log-probs), and the step reports
`training/rollout_probs_diff_max`, the largest gap between the engine's and the actor's probability
of each sampled token. With solid images of four colours in every batch, a row run with another
row's image, or without its image, or with text positions instead of M-RoPE ones, would not agree to
float32 rounding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.trainer.main_ppo_runs import ROOT, common_overrides, main_ppo_cmd, read_metrics, run_main_ppo

pytestmark = pytest.mark.slow  # the slow tier (make test-all, CI): see docs/testing.md

STEPS = 2


def _cmd(tmp_path, model: str, data, steps: int) -> list[str]:
    return main_ppo_cmd(
        "arith_demo",  # upstream's defaults with the CPU demo's environment; the task and model below
        *common_overrides(tmp_path, steps, model=model),
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}",
        "data.max_prompt_length=40",
        "data.max_response_length=1",  # the one-letter answer (the colour task's letter style)
        "data.train_batch_size=8",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.actor.use_kl_loss=True",  # the reference's forward with images too
        "actor_rollout_ref.rollout.calculate_log_probs=True",  # the engine's log-probs, for the mismatch metric
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=2",
        "trainer.balance_batch=True",
        "trainer.save_freq=2",
        "trainer.test_freq=2",
        f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
    )


# CI runs tiny-vl (the slow tier's time budget); VERL_TEST_VL_PRESETS=tiny-vl,tiny-qwen3-vl adds Qwen3-VL's
# DeepStack and interleaved M-RoPE through the same loop (~48 s more on the 2-core machine), whose parts have
# default-tier tests of their own (engine, actor, critic, rollout, positions against get_rope_index)
VL_PRESETS = os.environ.get("VERL_TEST_VL_PRESETS", "tiny-vl").split(",")


@pytest.mark.parametrize("preset", VL_PRESETS)
def test_grpo_on_a_vision_language_model_trains_checkpoints_resumes_and_exports(shared_ray_cluster, tmp_path, preset):
    from transformers import AutoModelForImageTextToText

    from verl.models.factory import make_tiny
    from verl.utils.dataset.vl_colors import write_vl_colors_parquet
    from verl.utils.tokenizer import hf_processor

    model = make_tiny(preset, str(tmp_path / preset))
    data = tmp_path / "data"
    write_vl_colors_parquet(str(data), num_train=32, num_test=8, answer_style="letter")

    run_main_ppo(_cmd(tmp_path, model, data, STEPS), tmp_path, timeout=600, cluster=shared_ray_cluster)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        metrics = record["data"]
        assert metrics["training/rollout_probs_diff_max"] < 1e-5, metrics["training/rollout_probs_diff_max"]
        assert metrics["response_length/mean"] == 1.0
        assert 0.0 <= metrics["critic/score/mean"] <= 1.0
        assert metrics["actor/kl_loss"] >= 0.0
    assert "val-core/vl_colors/acc/mean@1" in records[-1]["data"]
    lines = [json.loads(line) for line in (tmp_path / "rollouts" / "2.jsonl").read_text().splitlines()]
    assert len(lines) == 8 * 4 and {line["num_images"] for line in lines} == {1}
    assert any(r["data"]["critic/advantages/max"] > 0 for r in records)  # some group had a signal: the model moves

    # resume: the same command for 3 steps continues from the step-2 checkpoint
    os.remove(tmp_path / "metrics.jsonl")
    run_main_ppo(_cmd(tmp_path, model, data, STEPS + 1), tmp_path, timeout=600, cluster=shared_ray_cluster)
    assert [r["step"] for r in read_metrics(tmp_path)] == [3]

    # the merger's export of the step-2 checkpoint is an image-text-to-text model with its processor
    target = tmp_path / "merged"
    merge = [sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp"]
    merge += ["--local_dir", str(tmp_path / "ckpt" / "global_step_2" / "actor"), "--target_dir", str(target)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run(merge, cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=300)
    merged = AutoModelForImageTextToText.from_pretrained(target)
    initial = AutoModelForImageTextToText.from_pretrained(model)
    classes = {"tiny-vl": "Qwen2_5_VLForConditionalGeneration", "tiny-qwen3-vl": "Qwen3VLForConditionalGeneration"}
    assert type(merged).__name__ == classes[preset]
    assert hf_processor(str(target)) is not None
    trained, start = merged.state_dict(), initial.state_dict()
    assert trained.keys() == start.keys()
    moved = [name for name in start if not torch.equal(trained[name], start[name])]
    assert any(name.startswith("model.language_model.") for name in moved)
    assert any(name.startswith("model.visual.") for name in moved)  # the vision tower trained too
