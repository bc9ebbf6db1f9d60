"""`main_ppo --config-name=arith_demo_megatron` end to end with the gpt-oss preset on CPU: the
tiny-gptoss model (attention sinks, a sliding-window then a full-attention layer, YaRN, biases on
attention, router and experts, the clamped SwiGLU) trains two GRPO steps on 2 megatron workers with
the experts split over them (ep=2; whole experts, expert_tensor_parallel_size=1), the built-in engine
generating with the synced weights, and the step-2 checkpoint merges back into a `GptOssForCausalLM`
that transformers loads, with moved sinks, biases and expert weights. The FSDP backend trains the
same model (its packed, remove-padding forward) and its checkpoint merges too."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.main_ppo_runs import (
    common_overrides,
    demo_script_cmd,
    main_ppo_cmd,
    read_metrics,
    run_main_ppo,
    start_module_runs,
)

pytestmark = pytest.mark.slow  # the slow tier (make test-all, CI): see docs/testing.md


MOVED = (
    "model.layers.0.self_attn.sinks",
    "model.layers.0.self_attn.o_proj.bias",
    "model.layers.1.mlp.router.bias",
    "model.layers.1.mlp.experts.gate_up_proj",
    "model.layers.1.mlp.experts.down_proj_bias",
)
# a random-init model never solves the task (every GRPO advantage is 0): an entropy bonus gives the update a gradient
GRADIENT = (
    "actor_rollout_ref.actor.entropy_coeff=0.01",
    "actor_rollout_ref.actor.skip_zero_advantage_step=False",
    "actor_rollout_ref.actor.skip_zero_advantage_rows=False",
    "trainer.save_freq=2",
)


def _merged_and_moved(run, backend: str, model_path: str, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from verl.model_merger.__main__ import main as merger

    rows = [r["data"] for r in read_metrics(run) if "actor/pg_loss" in r["data"]]
    assert len(rows) == 2
    assert all(row["actor/grad_norm"] > 0 for row in rows), rows
    hf_dir = tmp_path / f"hf-{backend}"
    merger(["merge", "--backend", backend, "--local_dir", str(run / "ckpt" / "global_step_2" / "actor"), "--target_dir", str(hf_dir)])  # fmt: skip
    loaded = AutoModelForCausalLM.from_pretrained(hf_dir)
    assert type(loaded).__name__ == "GptOssForCausalLM"
    merged = loaded.state_dict()
    before = AutoModelForCausalLM.from_pretrained(model_path).state_dict()
    assert sorted(merged) == sorted(before)
    for name in MOVED:
        assert not merged[name].equal(before[name]), f"two steps must have moved {name}"


def _megatron_at_ep2(model_path: str, tmp_path: Path, cluster, started: dict) -> tuple[Path, str]:
    run = tmp_path / "run"
    run_main_ppo(
        main_ppo_cmd(
            "arith_demo_megatron",
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1",
            *GRADIENT,
            *common_overrides(run, 2, model=model_path),
        ),
        run,
        cluster=cluster,
    )
    return run, model_path


def _fsdp(model_path: str, tmp_path: Path, cluster, started: dict) -> tuple[Path, str]:
    run = tmp_path / "run"
    cmd = demo_script_cmd(
        run,
        2,
        f"actor_rollout_ref.model.path={model_path}",
        "actor_rollout_ref.model.use_remove_padding=True",
        *GRADIENT,
    )
    run_main_ppo(cmd, run, cluster=cluster)
    return run, model_path


# Every run of the file, by name: a function of (the tiny gpt-oss model, its own directory, the shared
# cluster, the started runs' futures) -> (the run's directory, the model it started from).
RUNS = {"megatron_ep2": _megatron_at_ep2, "fsdp": _fsdp}
# test -> the runs it reads
TEST_RUNS = {
    "test_grpo_trains_a_gpt_oss_model_at_ep2_and_merges": ("megatron_ep2",),
    "test_fsdp_grpo_trains_a_gpt_oss_model_with_remove_padding_and_merges": ("fsdp",),
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, shared_ray_cluster):
    """The two runs, started at once: {name: future} (see start_module_runs), from one tiny gpt-oss
    model (seed 0) built here, in pytest's thread, before they start."""
    from functools import partial

    from verl.models.factory import make_tiny

    model_path = make_tiny("tiny-gptoss", str(tmp_path_factory.mktemp("tiny-gptoss")))
    runs_ = {name: partial(run, model_path) for name, run in RUNS.items()}
    with start_module_runs(request, runs_, TEST_RUNS, tmp_path_factory, shared_ray_cluster) as started:
        yield started


def test_grpo_trains_a_gpt_oss_model_at_ep2_and_merges(tmp_path, runs):
    run, model_path = runs["megatron_ep2"].result()
    _merged_and_moved(run, "megatron", model_path, tmp_path)


def test_fsdp_grpo_trains_a_gpt_oss_model_with_remove_padding_and_merges(tmp_path, runs):
    run, model_path = runs["fsdp"].result()
    _merged_and_moved(run, "fsdp", model_path, tmp_path)
