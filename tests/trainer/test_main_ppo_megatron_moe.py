"""`main_ppo --config-name=arith_demo_megatron` end to end with a mixture-of-experts model on CPU:
the tiny Qwen3-MoE preset on 2 megatron workers with expert parallelism 2 (each holds 2 of the 4
experts; tokens reach them by megatron's all-to-all over gloo) and the router load-balancing loss
on, checkpointed at step 1, then resumed at ep=1 (the checkpoint reshards the experts, and the Adam
state, whole on each rank at ep=2, is split over the 2 data-parallel ranks there)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.main_ppo_runs import common_overrides, main_ppo_cmd, read_metrics, run_main_ppo, start_module_runs

pytestmark = pytest.mark.slow  # the slow tier (make test-all, CI): see docs/testing.md


def _overrides(model_path: str, tmp_path: Path, steps: int, ep: int) -> list[str]:
    return [
        f"actor_rollout_ref.actor.megatron.expert_model_parallel_size={ep}",
        "+actor_rollout_ref.model.override_config.output_router_logits=True",
        "+actor_rollout_ref.model.override_config.router_aux_loss_coef=0.01",
        # a random-init model never solves the task, so every GRPO advantage is 0 and the update would be
        # skipped before any forward; run it, so the load-balancing loss alone trains the router
        "actor_rollout_ref.actor.skip_zero_advantage_step=False",
        "actor_rollout_ref.actor.skip_zero_advantage_rows=False",
        "trainer.save_freq=1",
        *common_overrides(tmp_path, steps, model=model_path),
    ]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    """The tiny Qwen3-MoE preset (seed 0), built once: every run of the file starts from it."""
    from verl.models.factory import make_tiny

    return make_tiny("tiny-moe", str(tmp_path_factory.mktemp("tiny-moe")))


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, shared_ray_cluster, tiny_moe):
    """The runs of this module's selected tests, started at once: {name: future} (see start_module_runs).
    They are defined below, beside the tests that read them."""
    from functools import partial

    runs_ = {name: partial(run, tiny_moe) for name, run in RUNS.items()}
    # two at a time: each holds 2-4 Megatron workers (about a GB each)
    with start_module_runs(request, runs_, TEST_RUNS, tmp_path_factory, shared_ray_cluster, 2) as started:
        yield started


def _ep2(model_path: str, run: Path, cluster, started: dict) -> Path:
    run_main_ppo(main_ppo_cmd("arith_demo_megatron", *_overrides(model_path, run, steps=1, ep=2)), run, cluster=cluster)
    return run


def _resumed_at_ep1(model_path: str, resumed: Path, cluster, started: dict):
    first = started["ep2"].result()
    return resumed, run_main_ppo(
        main_ppo_cmd(
            "arith_demo_megatron",
            *_overrides(model_path, resumed, steps=2, ep=1),
            "trainer.resume_mode=resume_path",
            f"trainer.resume_from_path={first / 'ckpt' / 'global_step_1'}",
        ),
        resumed,
        cluster=cluster,
    )


def test_grpo_trains_a_moe_model_at_ep2_and_resumes_at_ep1(runs):
    first = runs["ep2"].result()
    (row,) = [r["data"] for r in read_metrics(first) if "actor/pg_loss" in r["data"]]
    assert row["actor/grad_norm"] > 0
    assert 1.0 < row["actor/load_balancing_loss"] < 4.0, row["actor/load_balancing_loss"]  # k=2 .. E*k=8
    assert (first / "ckpt" / "global_step_1" / "actor" / "dist_ckpt" / "metadata.json").is_file()

    resumed, proc = runs["ep1"].result()
    assert "resuming from" in proc.stdout + proc.stderr
    rows = [r for r in read_metrics(resumed) if "actor/pg_loss" in r["data"]]
    assert [r["step"] for r in rows] == [2]  # step 1 came from the checkpoint
    assert rows[0]["data"]["actor/grad_norm"] > 0 and "actor/load_balancing_loss" in rows[0]["data"]


def _pp2(model_path: str, run: Path, cluster, started: dict) -> Path:
    overrides = [o for o in _overrides(model_path, run, steps=2, ep=1) if o != "trainer.save_freq=1"]
    run_main_ppo(
        main_ppo_cmd(
            "arith_demo_megatron", "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2", *overrides
        ),
        run,
        cluster=cluster,
    )
    return run


def test_grpo_trains_a_moe_model_with_the_load_balancing_loss_on_two_pipeline_stages(runs):
    """pp=2 (one MoE layer a stage): the loss's router statistics are summed over the stages inside
    megatron's 1F1B schedule, and both stages' routers get its gradient (that it equals the pp=1
    update is tests/workers/actor/test_megatron_actor_moe.py's); logged in the same range as at ep=2."""
    run = runs["pp2"].result()
    rows = [r["data"] for r in read_metrics(run) if "actor/pg_loss" in r["data"]]
    assert len(rows) == 2
    for row in rows:
        assert row["actor/grad_norm"] > 0
        assert 1.0 < row["actor/load_balancing_loss"] < 4.0, row["actor/load_balancing_loss"]


def _tp2ep2etp2(model_path: str, run: Path, cluster, started: dict) -> Path:
    run_main_ppo(
        main_ppo_cmd(
            "arith_demo_megatron",
            *_overrides(model_path, run, steps=1, ep=2),
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=2",
            "trainer.n_gpus_per_node=4",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        ),
        run,
        cluster=cluster,
    )
    return run


def test_grpo_trains_a_moe_model_at_tp2_ep2_etp2_on_four_workers(runs):
    """4 workers, tp=2 x dp=2, the experts over 2 expert-parallel ranks and each expert's MLP over 2
    expert-tensor ranks: the token dispatcher gathers uneven token counts over the expert-tensor
    ranks (gloo's form, verl/utils/megatron/gloo_collectives.py) in the old-log-prob, reference and
    update passes; the step trains and checkpoints."""
    run = runs["tp2ep2etp2"].result()
    (row,) = [r["data"] for r in read_metrics(run) if "actor/pg_loss" in r["data"]]
    assert row["actor/grad_norm"] > 0
    assert 1.0 < row["actor/load_balancing_loss"] < 4.0, row["actor/load_balancing_loss"]  # k=2 .. E*k=8
    assert (run / "ckpt" / "global_step_1" / "actor" / "dist_ckpt" / "metadata.json").is_file()


def test_grpo_with_router_replay_r2_records_and_replays_the_routing_at_ep2(runs):
    """Two mini-batches a step, so the old-log-prob pass runs (it records `routed_experts`) and the
    second mini-batch's forward replays routing recorded before the first one's optimizer step; the
    actor refuses an update whose batch has old log-probs without the recording, so a finished run
    shows it travelled from compute_log_prob through the driver to update_actor."""
    _assert_two_updates_after_an_old_log_prob_pass(runs["r2"].result())


def _r2(model_path: str, run: Path, cluster, started: dict) -> Path:
    run_main_ppo(
        main_ppo_cmd(
            "arith_demo_megatron",
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
            "actor_rollout_ref.actor.router_replay.mode=R2",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
            # a random-init model never solves the task (every GRPO advantage is 0): an entropy bonus gives
            # the update a gradient, so the replayed forwards matter
            "actor_rollout_ref.actor.entropy_coeff=0.01",
            *common_overrides(run, 2, model=model_path),
        ),
        run,
        cluster=cluster,
    )
    return run


def test_grpo_with_router_replay_r3_replays_the_built_in_engines_routing_at_ep2(runs):
    """R3: the built-in engine records the routing while it generates, and the batch carries it to
    the old-log-prob pass and both mini-batches of the update, which replay it. The actor refuses an
    R3 forward whose batch has no `routed_experts` (or one of another model's shape), so a finished
    run shows it travelled from generate_sequences through the driver to compute_log_prob and
    update_actor."""
    _assert_two_updates_after_an_old_log_prob_pass(runs["r3"].result())


def _r3(model_path: str, run: Path, cluster, started: dict) -> Path:
    run_main_ppo(
        main_ppo_cmd(
            "arith_demo_megatron",
            "actor_rollout_ref.rollout.name=hf",
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=True",
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
            "actor_rollout_ref.actor.router_replay.mode=R3",
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


def _assert_two_updates_after_an_old_log_prob_pass(run) -> None:
    """Two logged updates, each with a gradient, each after an old-log-prob pass (`actor/entropy`:
    the pass that records, or replays, the routing)."""
    rows = [r["data"] for r in read_metrics(run) if "actor/pg_loss" in r["data"]]
    assert len(rows) == 2
    for row in rows:
        assert "actor/entropy" in row and row["actor/grad_norm"] > 0, {
            k: row.get(k) for k in ("actor/entropy", "actor/grad_norm")
        }


def _lora(model_path: str, run: Path, cluster, started: dict) -> Path:
    run_main_ppo(
        main_ppo_cmd(
            "arith_demo_megatron",
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
            "actor_rollout_ref.model.lora.rank=8",
            "actor_rollout_ref.model.lora.alpha=16",
            "actor_rollout_ref.model.lora.lora_B_init_method=kaiming",  # the adapters act from step 1
            "actor_rollout_ref.actor.optim.lr=1e-2",
            "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.actor.skip_zero_advantage_step=False",
            "actor_rollout_ref.actor.skip_zero_advantage_rows=False",
            "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
            "trainer.save_freq=2",
            *common_overrides(run, 2, model=model_path),
        ),
        run,
        cluster=cluster,
    )
    return run


def test_grpo_with_lora_on_the_expert_layers_at_ep2_trains_only_adapters_and_saves_merged_experts(runs, tiny_moe):
    """`model.lora.rank=8` with the default targets on the MoE model at ep=2: every expert's fc1/fc2
    and the attention get adapters; the KL loss against the reference (the base model, adapters off)
    turns positive after the first update, and the saved HF weights differ from the base model's in
    the experts and attention only (the router, norms and embeddings are frozen)."""
    import torch
    from safetensors.torch import load_file

    from verl.utils.model import load_causal_lm

    model_path, run = tiny_moe, runs["lora"].result()
    rows = [r["data"] for r in read_metrics(run) if "actor/pg_loss" in r["data"]]
    assert len(rows) == 2 and rows[0]["actor/grad_norm"] > 0
    assert rows[0]["actor/kl_loss"] > 0, "B starts non-zero: the adapted policy is off the reference already"

    merged = load_file(run / "ckpt" / "global_step_2" / "actor" / "huggingface" / "model.safetensors")
    base_model = load_causal_lm(model_path)
    base = base_model.state_dict()  # HF's 3-D expert tensors, as the export names them
    tied = {"lm_head.weight"} if base_model.config.tie_word_embeddings else set()  # written once, as HF files
    assert set(merged) == set(base) - tied, sorted(set(merged) ^ set(base))
    moved = {n for n, t in merged.items() if not torch.equal(t, base[n].to(t.dtype))}
    assert any(".experts." in n for n in moved) and any(".q_proj." in n for n in moved), sorted(moved)
    assert not any("norm" in n or "embed" in n or ".gate." in n for n in moved), sorted(moved)


# Every run of the file, by name: a function of (the tiny MoE model, its own directory, the shared
# cluster, the started runs' futures) -> what its test reads; the ep=1 resume waits for the ep=2 run.
RUNS = {
    "ep2": _ep2,
    "tp2ep2etp2": _tp2ep2etp2,
    "pp2": _pp2,
    "ep1": _resumed_at_ep1,  # after a run it need not wait for: it holds a slot while it waits
    "r2": _r2,
    "r3": _r3,
    "lora": _lora,
}
# test -> the runs it reads (with the runs those wait for)
TEST_RUNS = {
    "test_grpo_trains_a_moe_model_at_ep2_and_resumes_at_ep1": ("ep2", "ep1"),
    "test_grpo_trains_a_moe_model_with_the_load_balancing_loss_on_two_pipeline_stages": ("pp2",),
    "test_grpo_trains_a_moe_model_at_tp2_ep2_etp2_on_four_workers": ("tp2ep2etp2",),
    "test_grpo_with_router_replay_r2_records_and_replays_the_routing_at_ep2": ("r2",),
    "test_grpo_with_router_replay_r3_replays_the_built_in_engines_routing_at_ep2": ("r3",),
    "test_grpo_with_lora_on_the_expert_layers_at_ep2_trains_only_adapters_and_saves_merged_experts": ("lora",),
}
