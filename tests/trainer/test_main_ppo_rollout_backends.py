"""The same `python -m verl.trainer.main_ppo` GRPO run with each rollout backend: only
`actor_rollout_ref.rollout.name` changes. With rollout log-probs on, every step reports the
train/rollout mismatch (`training/rollout_probs_diff_mean`, `_max`) and the truncated
importance-sampling correction (`actor.tis_imp_ratio_cap`) is applied.

The hf case runs in the main suite; the vllm case needs vllm and runs in the vllm virtualenv
(.ci/vllm.sh). SGLang cannot be installed on these machines (docs/rollout_backends.md).
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.trainer.main_ppo_runs import demo_script_cmd, read_metrics, run_main_ppo

pytestmark = pytest.mark.slow  # the slow tier (make test-all, CI): see docs/testing.md


@pytest.mark.parametrize(
    "backend",
    [
        "hf",
        pytest.param(
            "vllm",
            marks=[
                pytest.mark.vllm,
                pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (.ci/vllm.sh)"),
            ],
        ),
    ],
)
def test_grpo_runs_with_the_backend_and_reports_the_train_rollout_mismatch(backend, tmp_path, request):
    cmd = demo_script_cmd(
        tmp_path,
        2,
        f"actor_rollout_ref.rollout.name={backend}",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.actor.tis_imp_ratio_cap=2.0",
        "actor_rollout_ref.rollout.max_num_seqs=64",
        batch=8,
    )
    # the built-in engine joins the session's cluster; vLLM's run (its own virtualenv, .ci/vllm.sh) keeps its own
    cluster = request.getfixturevalue("shared_ray_cluster") if backend == "hf" else None
    run_main_ppo(cmd, tmp_path, timeout=900, cluster=cluster)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        data = record["data"]
        for key in ("actor/pg_loss", "training/rollout_probs_diff_mean", "training/rollout_probs_diff_max"):
            assert key in data, f"{key} missing from {sorted(data)}"
        # both sides compute in float32 on CPU, so the engines agree to rounding; a sampling or
        # temperature bug (log-probs of another distribution) shows up as gaps of 0.1 and more
        assert 0 <= data["training/rollout_probs_diff_mean"] < 1e-3, data["training/rollout_probs_diff_mean"]
        assert data["training/rollout_probs_diff_max"] < 1e-2, data["training/rollout_probs_diff_max"]
    print(backend, [{k: r["data"][k] for k in r["data"] if "rollout_probs_diff" in k} for r in records])


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (.ci/vllm.sh)")
def test_one_step_off_with_vllm_partial_rollouts_tags_versions_within_the_bound(tmp_path):
    """Generation one step ahead in a separate rollout pool running vLLM, with partial rollouts
    checked every engine step: every trained sample's oldest version is within the bound, its newest
    never ahead of the trainer, and the rollout log-probs stay those of the sampling weights."""
    from tests.trainer.test_main_ppo_async import _cmd, _trained, assert_partial_rollout_tags

    steps = 3
    cmd = _cmd(
        tmp_path,
        steps,
        1,
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.max_num_seqs=64",
        "async_training.partial_rollout=true",
        "async_training.partial_rollout_check_steps=1",
    )
    run_main_ppo(cmd, tmp_path, timeout=900)
    assert_partial_rollout_tags(_trained(tmp_path), steps)
    records = {r["step"]: r["data"] for r in read_metrics(tmp_path)}
    for step in range(1, steps + 1):
        data = records[step]
        assert 0.0 <= data["async/mixed_version_frac"] <= 1.0
        # decoupled correction: behaviour log-probs from vLLM, per token of the version that sampled it
        assert "off_policy/is_weight_mean" in data
    # step 1 trains samples of version 0 with version 0: the engines agree to rounding (later steps
    # differ by one update, which is what the correction is for)
    assert records[1]["training/rollout_probs_diff_mean"] < 1e-3, records[1]["training/rollout_probs_diff_mean"]
    print(
        {s: (records[s]["training/rollout_probs_diff_mean"], records[s]["async/mixed_version_frac"]) for s in records}
    )
