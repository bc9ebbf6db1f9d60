"""`main_ppo` with generation running ahead of training (async_training.staleness_threshold >= 1) on
CPU: one actor worker and one rollout worker in separate pools, real Ray, FSDP2, the gloo weight
broadcast. Each trained sample's weight version comes from the rollout worker that generated it
(trainer.rollout_data_dir dumps them), so these tests check the version the engine really held."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.trainer.main_ppo_runs import (
    demo_script_cmd,
    read_metrics,
    run_and_kill_9_after_checkpoint,
    run_main_ppo,
    start_module_runs,
)

pytestmark = pytest.mark.slow  # the slow tier (make test-all, CI): see docs/testing.md

BATCH = 4
N = 4


def _cmd(tmp_path: Path, steps: int, ahead: float, *extra: str) -> list[str]:
    return demo_script_cmd(
        tmp_path,
        steps,
        "rollout.n_gpus_per_node=1",
        f"async_training.staleness_threshold={ahead}",
        f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
        *extra,
        batch=BATCH,
        n=N,
        ranks=1,
    )


def _entry_cmd(script: str, tmp_path: Path, steps: int, *extra: str) -> list[str]:
    """`_cmd`'s run through one of upstream's async entry points (examples/async/`script`, which calls it)."""
    cmd = demo_script_cmd(
        tmp_path,
        steps,
        "rollout.n_gpus_per_node=1",
        f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
        *extra,
        batch=BATCH,
        n=N,
        ranks=1,
    )
    cmd[1] = f"examples/async/{script}"
    return cmd


def _trained(tmp_path: Path) -> dict[int, list[dict]]:
    """step -> the samples trained at that step (from trainer.rollout_data_dir)."""
    out = {}
    for f in (tmp_path / "rollouts").glob("*.jsonl"):
        out[int(f.stem)] = [json.loads(line) for line in f.read_text().splitlines()]
    return out


def _killed_after_step_2_and_resumed(tmp_path: Path, steps: int, ahead: float, cluster) -> dict[int, list[dict]]:
    """The run of `_cmd(...)` with checkpoints every 2 steps, `kill -9`ed right after the step-2
    checkpoint and resumed to the end (in `tmp_path / "killed"`) on `cluster`: what each step trained."""
    killed = tmp_path / "killed"
    killed.mkdir()
    cmd = _cmd(killed, steps, ahead, "trainer.save_freq=2")
    run_and_kill_9_after_checkpoint(cmd, killed, 2)
    for f in (killed / "rollouts").glob("*.jsonl"):  # steps after the checkpoint are retrained on resume
        if int(f.stem) > 2:
            f.unlink()
    run_main_ppo(cmd, killed, cluster=cluster)
    return _trained(killed)


def assert_partial_rollout_tags(trained: dict[int, list[dict]], steps: int, ahead: int = 1) -> None:
    """Every step trained; each sample's versions ordered, the oldest within the bound, the newest
    never ahead of the trainer's."""
    assert sorted(trained) == list(range(1, steps + 1))
    for step, rows in trained.items():
        for r in rows:
            assert r["weight_version"] <= r["weight_version_max"] <= step - 1, (step, r)
            assert (step - 1) - r["weight_version"] <= ahead, (step, r)


def _run(run: Path, cluster, steps: int, ahead: float, *extra: str) -> Path:
    """`_cmd(run, ...)` to completion on `cluster`: the run directory."""
    return _run_cmd(run, cluster, _cmd(run, steps, ahead, *extra))


def _run_cmd(run: Path, cluster, cmd: list[str]) -> Path:
    run_main_ppo(cmd, run, cluster=cluster)
    return run


def _resumed_from_two_ahead_with_k1(policy: str):
    """The 4-step k=1 run resumed from the k=2 run's step-2 checkpoint with stale_sample_policy=`policy`."""

    def run(tmp: Path, cluster, started: dict) -> Path:
        first = started["two_ahead"].result()
        return _run(
            tmp,
            cluster,
            4,
            1,
            "trainer.resume_mode=resume_path",
            f"trainer.resume_from_path={first / 'ckpt' / 'global_step_2'}",
            f"async_training.stale_sample_policy={policy}",
        )

    return run


def _killed_between_two_syncs_and_resumed(tmp: Path, cluster, started: dict) -> Path:
    """k=2, trigger_parameter_sync_step=2, 6 steps, checkpoints every 3: kill -9 right after the
    step-3 checkpoint, then resumed to the end on `cluster`; the run directory."""
    cmd = _cmd(tmp, 6, 2, "async_training.trigger_parameter_sync_step=2", "trainer.save_freq=3")
    run_and_kill_9_after_checkpoint(cmd, tmp, 3)
    for f in (tmp / "rollouts").glob("*.jsonl"):  # steps after the checkpoint are retrained on resume
        if int(f.stem) > 3:
            f.unlink()
    run_main_ppo(cmd, tmp, cluster=cluster)
    return tmp


# Every run of the file but the Megatron one (which sizes a cluster of its own), by name: a function of
# (its own directory, the shared cluster, the started runs' futures) -> what the tests read. They run
# side by side (start_module_runs); a run that resumes from another's checkpoint comes after it.
RUNS = {
    "one_step_off": lambda tmp, cluster, started: _run(tmp, cluster, 4, 1),  # k=1, the default correction
    "two_ahead": lambda tmp, cluster, started: _run(tmp, cluster, 5, 2, "trainer.save_freq=2"),
    "two_ahead_resumed": lambda tmp, cluster, started: _killed_after_step_2_and_resumed(tmp, 5, 2, cluster),
    "half_ahead": lambda tmp, cluster, started: _run(tmp, cluster, 4, 0.5, "trainer.save_freq=2"),
    "half_ahead_resumed": lambda tmp, cluster, started: _killed_after_step_2_and_resumed(tmp, 4, 0.5, cluster),
    "tis": lambda tmp, cluster, started: _run(tmp, cluster, 2, 1, "async_training.off_policy_correction=tis"),
    # upstream's one-step-off entry point with the trainer's recompute: k=1 with off_policy_correction=none
    "none": lambda tmp, cluster, started: _run_cmd(
        tmp,
        cluster,
        _entry_cmd("run_one_step_off_arith_tiny_cpu.sh", tmp, 2, "algorithm.rollout_correction.bypass_mode=False"),
    ),
    "regenerate": _resumed_from_two_ahead_with_k1("regenerate"),
    "drop": _resumed_from_two_ahead_with_k1("drop"),
    # upstream's fully-async entry point: staleness_threshold 0 with a sync every 2 steps is k = 0 x 2 + 2 - 1 = 1
    "sync_every_2": lambda tmp, cluster, started: _run_cmd(
        tmp,
        cluster,
        _entry_cmd(
            "run_fully_async_arith_tiny_cpu.sh",
            tmp,
            5,
            f"actor_rollout_ref.actor.ppo_mini_batch_size={BATCH}",
            "async_training.require_batches=1",
            "async_training.staleness_threshold=0",
            "async_training.trigger_parameter_sync_step=2",
            "async_training.partial_rollout=False",
            f"rollout.total_rollout_steps={5 * BATCH}",
            "rollout.test_freq=-1",
        ),
    ),
    "resumed_between_syncs": _killed_between_two_syncs_and_resumed,
    "partial": lambda tmp, cluster, started: _run(
        tmp, cluster, 3, 1, "async_training.partial_rollout=true", "async_training.partial_rollout_check_steps=1"
    ),
}
# test -> the runs it reads (with the runs those wait for)
TEST_RUNS = {
    "test_one_step_off_trains_batch_t_on_samples_of_weight_version_t_minus_2": ("one_step_off",),
    "test_staleness_never_exceeds_the_bound_and_resume_mid_run_loses_or_repeats_no_sample": (
        "two_ahead",
        "two_ahead_resumed",
    ),
    "test_half_a_batch_ahead_trains_half_of_each_batch_one_version_old_and_resumes_identically": (
        "half_ahead",
        "half_ahead_resumed",
    ),
    "test_off_policy_corrections_decoupled_tis_and_none_differ_as_documented": ("one_step_off", "tis", "none"),
    "test_groups_over_a_lowered_bound_are_regenerated_or_dropped_on_resume": ("two_ahead", "regenerate", "drop"),
    "test_syncing_every_2_updates_pushes_weights_at_steps_1_3_5_and_keeps_staleness_within_the_bound": (
        "sync_every_2",
    ),
    "test_resume_between_two_syncs_trains_every_group_once_with_the_tags_of_an_uninterrupted_run": (
        "resumed_between_syncs",
    ),
    "test_partial_rollouts_tag_each_sample_with_its_oldest_and_newest_version_within_the_bound": ("partial",),
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, shared_ray_cluster):
    """The runs of this module's selected tests, started at once: {name: future} (see start_module_runs)."""
    with start_module_runs(request, RUNS, TEST_RUNS, tmp_path_factory, shared_ray_cluster) as started:
        yield started


def test_one_step_off_trains_batch_t_on_samples_of_weight_version_t_minus_2(runs):
    """Step t trains with weights v(t-1); its samples were generated during step t-1, with v(t-2)."""
    steps, tmp_path = 4, runs["one_step_off"].result()
    trained = _trained(tmp_path)
    assert sorted(trained) == list(range(1, steps + 1))
    for step, rows in trained.items():
        assert len(rows) == BATCH * N
        assert {r["weight_version"] for r in rows} == {max(0, step - 2)}, step
        assert {r["uid"].split("_")[0] for r in rows} == {str(step)}  # batch t is the t-th batch drawn
    records = {r["step"]: r["data"] for r in read_metrics(tmp_path)}
    assert [records[s]["async/staleness_max"] for s in range(1, steps + 1)] == [0, 1, 1, 1]
    last = records[steps]
    for key in ("off_policy/is_weight_mean", "off_policy/is_weight_max", "training/rollout_probs_diff_mean"):
        assert key in last, sorted(last)
    assert last["off_policy/is_weight_min"] <= 1.0 <= last["off_policy/is_weight_max"]


def test_staleness_never_exceeds_the_bound_and_resume_mid_run_loses_or_repeats_no_sample(runs):
    """k=2: versions are max(0, t-3), staleness <= 2 every step; killing the run right after the
    step-2 checkpoint (two generated batches still queued) and resuming trains every prompt group
    exactly once, the same groups at the same steps with the same versions as the straight run."""
    steps, ahead = 5, 2
    straight = runs["two_ahead"].result()
    trained = _trained(straight)
    for step, rows in trained.items():
        staleness = [(step - 1) - r["weight_version"] for r in rows]
        assert max(staleness) <= ahead
        assert {r["weight_version"] for r in rows} == {max(0, step - 1 - ahead)}, step
    assert max(r["data"]["async/staleness_max"] for r in read_metrics(straight)) == ahead

    resumed = runs["two_ahead_resumed"].result()
    assert sorted(resumed) == list(range(1, steps + 1))
    groups = Counter(r["uid"] for rows in resumed.values() for r in rows)
    assert set(groups.values()) == {N}  # each group's N samples trained once, none twice
    assert set(groups) == {r["uid"] for rows in trained.values() for r in rows}
    for step in range(1, steps + 1):
        assert {r["uid"] for r in resumed[step]} == {r["uid"] for r in trained[step]}
        assert {r["weight_version"] for r in resumed[step]} == {r["weight_version"] for r in trained[step]}


def test_half_a_batch_ahead_trains_half_of_each_batch_one_version_old_and_resumes_identically(runs):
    """staleness_threshold=0.5 (upstream's fractional meaning): per weight version the pool generates
    1.5 batches, so from step 2 on half of batch t's groups were generated with v(t-2) and half with
    v(t-1); no sample is more than ceil(0.5) = 1 version old. The checkpoint at step 2 falls with
    half of batch 3 submitted and half held back: the resumed run trains the same groups with the
    same versions."""
    steps = 4
    straight = runs["half_ahead"].result()
    trained = _trained(straight)
    assert sorted(trained) == list(range(1, steps + 1))
    assert Counter(r["weight_version"] for r in trained[1]) == {0: BATCH * N}
    for step in range(2, steps + 1):
        assert {r["uid"].split("_")[0] for r in trained[step]} == {str(step)}  # batch t at step t
        versions = Counter(r["weight_version"] for r in trained[step])
        assert versions == {step - 2: BATCH * N // 2, step - 1: BATCH * N // 2}, (step, versions)
        # the older half is the batch's first groups (the part generated ahead)
        older = {r["uid"] for r in trained[step] if r["weight_version"] == step - 2}
        assert older == {f"{step}_{i}" for i in range(BATCH // 2)}
    records = {r["step"]: r["data"] for r in read_metrics(straight)}
    assert [records[s]["async/staleness_max"] for s in range(1, steps + 1)] == [0, 1, 1, 1]
    assert records[steps]["async/staleness_threshold"] == 0.5

    resumed = runs["half_ahead_resumed"].result()
    assert sorted(resumed) == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        assert sorted((r["uid"], r["weight_version"]) for r in resumed[step]) == sorted(
            (r["uid"], r["weight_version"]) for r in trained[step]
        ), step


def _step_metrics(tmp_path: Path) -> dict[int, dict]:
    return {r["step"]: r["data"] for r in read_metrics(tmp_path)}


def test_off_policy_corrections_decoupled_tis_and_none_differ_as_documented(runs):
    """k=1, so at step 2 every sample is one version behind the trainer's weights.

    decoupled: old_log_probs are the trainer's current (proximal) log-probs, so the PPO ratio starts
    at exactly 1 (ppo_kl 0); the behaviour/proximal weights are reported and differ from 1.
    tis: old_log_probs are the rollout's own, so the ratio is against the stale behaviour policy
    (ppo_kl != 0 at step 2) and no proximal pass runs (no importance-weight metrics).
    none: proximal recompute, the behaviour policy ignored (ppo_kl 0, no importance weights in the loss); that run
    is upstream's one-step-off entry point with algorithm.rollout_correction.bypass_mode=False.
    Steps 1 and 2 of a run do not depend on its length: decoupled is the default, so the 4-step
    `one_step_off` run serves as the decoupled run; tis and none run 2 steps."""
    metrics = {"decoupled": _step_metrics(runs["one_step_off"].result())}
    for correction in ("tis", "none"):
        metrics[correction] = _step_metrics(runs[correction].result())
    decoupled, tis, none = (metrics[c][2] for c in ("decoupled", "tis", "none"))
    # the proximal pass and the update's forward run the same model on the same rows
    assert abs(decoupled["actor/ppo_kl"]) < 1e-6 and abs(none["actor/ppo_kl"]) < 1e-6
    assert tis["actor/ppo_kl"] > 1e-4, tis["actor/ppo_kl"]  # measured ~6e-3
    assert decoupled["off_policy/is_weight_min"] < 1.0 < decoupled["off_policy/is_weight_max"]
    assert "off_policy/is_weight_mean" not in tis
    # none ignores the behaviour policy in the loss; the entry point's config asks the rollout for its
    # log-probs (upstream's calculate_log_probs=True), so pi_prox / pi_behav is reported as a diagnostic
    assert none["off_policy/is_weight_min"] < 1.0 < none["off_policy/is_weight_max"]
    assert "rollout_corr/rollout_is_mean" not in none  # no rollout_is asked for: nothing weights the loss
    # step 1 trains on version-0 samples with version-0 weights: only engine-vs-trainer rounding
    assert all(abs(metrics[c][1]["actor/ppo_kl"]) < 1e-6 for c in metrics)


def test_groups_over_a_lowered_bound_are_regenerated_or_dropped_on_resume(runs):
    """k=2 run, then resumed from its step-2 checkpoint with k=1. The checkpoint holds batch 3
    (made with version 0) and batch 4 (version 1): at step 3 the trainer holds version 2, so batch 3
    is 2 versions stale, over the new bound, and batch 4 is 1 version stale, within it.

    regenerate: batch 3's prompts are generated again with the current weights and trained later,
    so every prompt of batches 1-4 is trained exactly once. drop: batch 3 is never trained and a
    fresh batch (5) takes its place. Either way no trained sample is staler than the new bound."""
    first = runs["two_ahead"].result()  # 5 steps; its first 4 are those of a 4-step run
    trained_first = _trained(first)
    assert {r["weight_version"] for r in trained_first[3]} == {0}  # as generated before the checkpoint
    assert {r["weight_version"] for r in trained_first[4]} == {1}

    resumed = {}
    for policy in ("regenerate", "drop"):  # 4 steps each, resumed from `first`'s step-2 checkpoint
        run = runs[policy].result()
        trained = _trained(run)
        assert sorted(trained) == [3, 4], policy
        for step, rows in trained.items():
            assert max((step - 1) - r["weight_version"] for r in rows) <= 1, (policy, step)
        resumed[policy] = (trained, {r["step"]: r["data"] for r in read_metrics(run)})

    batch = lambda rows: {r["uid"].split("_")[0] for r in rows}  # noqa: E731
    trained, metrics = resumed["regenerate"]
    assert batch(trained[3]) == {"4"} and {r["weight_version"] for r in trained[3]} == {1}
    assert batch(trained[4]) == {"3"} and {r["weight_version"] for r in trained[4]} == {2}  # made after resume
    every = Counter(r["uid"] for step in (1, 2) for r in trained_first[step])
    every.update(r["uid"] for rows in trained.values() for r in rows)
    assert set(every.values()) == {N} and {u.split("_")[0] for u in every} == {"1", "2", "3", "4"}
    assert metrics[3]["async/regenerated_stale_groups"] == BATCH
    assert metrics[4]["async/dropped_stale_groups"] == 0

    trained, metrics = resumed["drop"]
    assert batch(trained[3]) == {"4"} and batch(trained[4]) == {"5"}
    assert {r["weight_version"] for r in trained[4]} == {3}  # drawn fresh at step 4
    assert metrics[3]["async/dropped_stale_groups"] == BATCH
    assert metrics[4]["async/regenerated_stale_groups"] == 0


def test_syncing_every_2_updates_pushes_weights_at_steps_1_3_5_and_keeps_staleness_within_the_bound(runs):
    """k=1, trigger_parameter_sync_step=2 (the most lag k=1 allows): the pool gets v0 at step 1, v2 at
    step 3, v4 at step 5, and generates ahead only while the bound holds: batches 1-2 with v0, 3-4 with
    v2, 5 with v4 (staleness 0, 1, 0, 1, 0). Versions 1 and 3 never reach the rollout worker.
    The run is upstream's fully-async entry point (staleness_threshold=0, trigger_parameter_sync_step=2,
    a step of ppo_mini_batch_size x require_batches = 4 prompts, rollout.total_rollout_steps=20)."""
    steps = 5
    tmp_path = runs["sync_every_2"].result()
    trained = _trained(tmp_path)
    expected = {1: 0, 2: 0, 3: 2, 4: 2, 5: 4}
    for step, rows in trained.items():
        assert {r["weight_version"] for r in rows} == {expected[step]}, step
        assert {r["weight_version_max"] for r in rows} == {expected[step]}, step  # no partial rollouts
        assert {r["uid"].split("_")[0] for r in rows} == {str(step)}
    records = {r["step"]: r["data"] for r in read_metrics(tmp_path)}
    assert [records[s]["async/staleness_max"] for s in range(1, steps + 1)] == [0, 1, 0, 1, 0]
    assert [s for s in records if "timing_s/sync_weights" in records[s]] == [1, 3, 5]
    assert [records[s]["async/weight_syncs"] for s in range(1, steps + 1)] == [1, 1, 2, 2, 3]
    assert [records[s]["async/rollout_weight_version"] for s in range(1, steps + 1)] == [0, 0, 2, 2, 4]


def test_resume_between_two_syncs_trains_every_group_once_with_the_tags_of_an_uninterrupted_run(runs):
    """k=2, trigger_parameter_sync_step=2, killed after the step-3 checkpoint, between the syncs of
    steps 3 and 5. An uninterrupted run generates batches 1-3 with v0, 4-5 with v2 and 6 with v4
    (submitted at step 5, right after its sync): the resumed run must too, so it keeps the
    checkpoint's pool version (2) for what it submits until the next sync, although it pushes the
    checkpoint's own weights (v3) to the restarted rollout pool."""
    steps, ahead = 6, 2
    expected = {1: 0, 2: 0, 3: 0, 4: 2, 5: 2, 6: 4}
    resumed = _trained(runs["resumed_between_syncs"].result())
    assert sorted(resumed) == list(range(1, steps + 1))
    groups = Counter(r["uid"] for rows in resumed.values() for r in rows)
    assert set(groups.values()) == {N} and len(groups) == steps * BATCH  # each group trained once
    for step, rows in resumed.items():
        assert {r["uid"].split("_")[0] for r in rows} == {str(step)}, step
        assert {r["weight_version"] for r in rows} == {expected[step]}, step
        assert max((step - 1) - r["weight_version"] for r in rows) <= ahead


def test_partial_rollouts_tag_each_sample_with_its_oldest_and_newest_version_within_the_bound(runs):
    """k=1 with partial rollouts checked every decode step. Whether a generation is in flight when the
    weights arrive depends on timing (the worker test pins it down); here every sample's versions
    must be ordered, the oldest within the bound, and the newest never ahead of the trainer."""
    steps = 3
    tmp_path = runs["partial"].result()
    assert_partial_rollout_tags(_trained(tmp_path), steps)
    records = {r["step"]: r["data"] for r in read_metrics(tmp_path)}
    assert all(0.0 <= records[s]["async/mixed_version_frac"] <= 1.0 for s in records)


def test_one_step_off_with_a_megatron_actor_at_tp2_broadcasts_the_gathered_weights(tmp_path):
    """The trainer pool is a megatron actor at tp=2 (two ranks); its tensor-parallel shards are
    gathered into HF tensors and broadcast to the separate rollout pool (the FSDP backend's rollout
    worker: generation needs no megatron). Version tags are the same as with FSDP."""
    steps = 3
    run_main_ppo(
        _cmd(
            tmp_path,
            steps,
            1,
            "trainer.n_gpus_per_node=2",
            "--config-name=arith_demo_megatron",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "ray_kwargs.ray_init.num_cpus=3",  # three worker processes on a 2-core machine
        ),  # a cluster of its own, sized for the run (a joined cluster takes no sizing arguments)
        tmp_path,
    )
    trained = _trained(tmp_path)
    assert sorted(trained) == list(range(1, steps + 1))
    for step, rows in trained.items():
        assert {r["weight_version"] for r in rows} == {max(0, step - 2)}, step
    records = {r["step"]: r["data"] for r in read_metrics(tmp_path)}
    assert [records[s]["async/staleness_max"] for s in range(1, steps + 1)] == [0, 1, 1]
    # the rollout pool generated with weights it received: its log-probs stay close to the trainer's
    assert records[steps]["training/rollout_probs_diff_mean"] < 0.05
