"""`main_ppo --config-name=arith_demo_megatron` end to end with the DeepSeek-V3 preset on CPU: the
tiny-dsv3 model (latent attention, a dense first layer, sigmoid group-limited routing, a shared
expert) trains two GRPO steps on 2 megatron workers with the experts split over them (ep=2), or
on 2 pipeline stages sized as upstream's DeepSeek-V3 scripts size theirs
(`override_transformer_config.num_layers_in_first_pipeline_stage`: the dense layer alone on the
first stage, the 2 MoE layers on the second), and the step-2 checkpoint merges back into a
`DeepseekV3ForCausalLM` with moved weights and the routers' correction bias as it was."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from tests.megatron_helpers import randomize_correction_bias
from tests.trainer.main_ppo_runs import common_overrides, main_ppo_cmd, read_metrics, run_main_ppo, start_module_runs

pytestmark = pytest.mark.slow  # the slow tier (make test-all, CI): see docs/testing.md


LAYOUTS = {
    "ep2": ["actor_rollout_ref.actor.megatron.expert_model_parallel_size=2"],
    "pp2": [
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_first_pipeline_stage=1",
    ],
}


def train_two_steps_and_merge(preset: str, layout: list[str], tmp_path, cluster, moved: tuple[str, ...]):
    """Two GRPO steps of `preset` (a sigmoid-routed MoE preset, its correction bias made non-zero so
    its trip shows) under the megatron `layout` overrides, then the step-2 checkpoint merged to HF:
    two updates with a gradient, the `moved` weights changed, the correction bias untouched. Returns
    the merged model."""
    return merge_and_check(train_two_steps(preset, layout, tmp_path, cluster), tmp_path, moved)


def biased_model(preset: str, out_dir: Path) -> str:
    """`preset` with its correction bias made non-zero, saved under `out_dir`: its path."""
    from verl.models.factory import build_model, save_model

    model, tokenizer = build_model(preset)
    randomize_correction_bias(model, 7)
    return save_model(model, tokenizer, str(out_dir / preset))


def train_two_steps(preset: str, layout: list[str], tmp_path, cluster, model_path: str = "") -> tuple[Path, str]:
    """The run of `train_two_steps_and_merge`: (its directory, the model it started from, by default
    `biased_model(preset, tmp_path)`)."""
    model_path = model_path or biased_model(preset, tmp_path)
    run = tmp_path / "run2"
    run_main_ppo(
        main_ppo_cmd(
            "arith_demo_megatron",
            *layout,
            # a random-init model never solves the task (every GRPO advantage is 0): an entropy bonus gives
            # the update a gradient
            "actor_rollout_ref.actor.entropy_coeff=0.01",
            "actor_rollout_ref.actor.skip_zero_advantage_step=False",
            "actor_rollout_ref.actor.skip_zero_advantage_rows=False",
            "trainer.save_freq=2",
            *common_overrides(run, 2, model=model_path),
        ),
        run,
        cluster=cluster,
    )
    return run, model_path


def merge_and_check(trained: tuple[Path, str], tmp_path, moved: tuple[str, ...]):
    """The checks of `train_two_steps_and_merge` on a run of `train_two_steps`; the merged model."""
    from transformers import AutoModelForCausalLM

    from verl.model_merger.__main__ import main as merger

    run, model_path = trained
    rows = [r["data"] for r in read_metrics(run) if "actor/pg_loss" in r["data"]]
    assert len(rows) == 2
    assert all(row["actor/grad_norm"] > 0 for row in rows), rows

    hf_dir = tmp_path / "hf"
    merger(["merge", "--backend", "megatron", "--local_dir", str(run / "ckpt" / "global_step_2" / "actor"), "--target_dir", str(hf_dir)])  # fmt: skip
    loaded = AutoModelForCausalLM.from_pretrained(hf_dir)
    merged = loaded.state_dict()
    before = AutoModelForCausalLM.from_pretrained(model_path).state_dict()
    assert sorted(merged) == sorted(before)
    for name in moved:
        assert not merged[name].equal(before[name]), f"two steps must have moved {name}"
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert before[bias].abs().min() > 0 and merged[bias].equal(before[bias]), "the correction bias is not trained"
    return loaded


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, shared_ray_cluster):
    """The runs of this module's selected tests, started at once: {name: future} (see start_module_runs).
    The models are built here, in pytest's thread, before the runs start (start_module_runs)."""
    from verl.models.factory import make_tiny

    models = {
        "biased": biased_model("tiny-dsv3", tmp_path_factory.mktemp("biased")),
        "plain": make_tiny("tiny-dsv3", str(tmp_path_factory.mktemp("plain") / "tiny-dsv3")),
    }
    runs_ = {name: partial(run, models) for name, run in RUNS.items()}
    # two at a time: each holds 2 Megatron workers (about a GB each)
    with start_module_runs(request, runs_, TEST_RUNS, tmp_path_factory, shared_ray_cluster, 2) as started:
        yield started


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_grpo_trains_a_deepseek_v3_model_and_merges(tmp_path, runs, layout):
    moved = ("model.layers.1.mlp.gate.weight", "model.layers.2.self_attn.kv_b_proj.weight")
    loaded = merge_and_check(runs[layout].result(), tmp_path, moved)
    assert type(loaded).__name__ == "DeepseekV3ForCausalLM"


def test_grpo_with_router_replay_r2_on_deepseek_v3_at_pp2(runs):
    """R2 over 2 pipeline stages, the first holding only the dense layer: the old-log-prob pass
    records both MoE layers' routing on the second stage, the driver carries it, and the second
    mini-batch replays it (the actor refuses an update with old log-probs and no recording)."""
    from tests.trainer.test_main_ppo_megatron_moe import _assert_two_updates_after_an_old_log_prob_pass

    _assert_two_updates_after_an_old_log_prob_pass(runs["r2"].result())


def _r2_at_pp2(models: dict, tmp_path: Path, cluster, started: dict) -> Path:
    model_path = models["plain"]
    run = tmp_path / "r2"
    run_main_ppo(
        main_ppo_cmd(
            "arith_demo_megatron",
            *LAYOUTS["pp2"],
            "actor_rollout_ref.actor.router_replay.mode=R2",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.entropy_coeff=0.01",  # a gradient although every GRPO advantage is 0
            *common_overrides(run, 2, model=model_path),
        ),
        run,
        cluster=cluster,
    )
    return run


def _dsv3_at(layout: str, models: dict, tmp_path: Path, cluster, started: dict) -> tuple[Path, str]:
    return train_two_steps("tiny-dsv3", LAYOUTS[layout], tmp_path, cluster, models["biased"])


# Every run of the file, by name: a function of (the models, its own directory, the shared cluster, the
# started runs' futures) -> what its test reads.
RUNS = {
    **{layout: partial(_dsv3_at, layout) for layout in sorted(LAYOUTS)},
    "r2": _r2_at_pp2,
}
# test -> the runs it reads
TEST_RUNS = {
    "test_grpo_trains_a_deepseek_v3_model_and_merges": tuple(sorted(LAYOUTS)),
    "test_grpo_with_router_replay_r2_on_deepseek_v3_at_pp2": ("r2",),
}
