"""Each algorithm's example script, driven in-process: the script's own config (its overrides,
composed and validated as `main_ppo` does), trained for two steps by `RayPPOTrainer.fit()` in
pytest's process, on worker groups built once for the module.

Why in-process: a `python -m verl.trainer.main_ppo` run per algorithm pays an interpreter, Ray's
job and TaskRunner, and two worker processes loading the model (~25 s each on 2 cores) to check a
few metrics of two steps. Here the workers are built once per family (below) and each algorithm
costs its two steps. One real `main_ppo` run through Ray (the GRPO script, with the log lines and
exit status only a process shows) stays in `test_main_ppo_e2e.py`.

What is shared and what is not: the trainer (driver) of each test is built from the script's
config, so what each algorithm does on the driver (advantage estimator, KL in the reward,
ReMax's greedy baseline, DAPO's dynamic sampling and overlong penalty, the critic) is the script's.
The workers are a module fixture, built from one script's config (its family's, `FAMILIES`) and
reused by several trainers (`init_workers(groups=...)`). A trainer's workers are its own script's in
everything they read: `test_each_script_s_worker_settings_are_its_family_s` checks that the
worker-side config of each script equals its family's, but for the group size and the mini-batch
in prompts, whose product is the same 16 rows a step (`ROWS`) for every script. So the scripts
that differ on the worker side get families of their own: REINFORCE++ (an actor with
`use_kl_loss` needs reference log-probs in every batch) and DAPO (its actor clips higher).

Results do not depend on test order: the assertions are on what each algorithm logs and saves,
not on values that move as the shared workers train.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from tests.trainer.main_ppo_runs import ROOT, common_overrides, model_path, read_metrics

ROWS = 16  # samples a step (prompts x group size): 8 a rank, one mini-batch
GRPO = "examples/grpo_trainer/run_arith_tiny_cpu.sh"
GAE = "examples/ppo_trainer/run_arith_tiny_gae_cpu.sh"
REINFORCE_PP = "examples/reinforce_plus_plus_trainer/run_arith_tiny_cpu.sh"
DAPO = "recipes/dapo/run_dapo_arith_tiny_cpu.sh"

# script -> (a metric only that algorithm produces, the worker family it runs on)
EXAMPLES = {
    GRPO: ("actor/pg_loss", "reference_and_critic"),
    GAE: ("critic/vf_loss", "reference_and_critic"),
    "examples/rloo_trainer/run_arith_tiny_cpu.sh": ("actor/pg_loss", "reference_and_critic"),
    "examples/remax_trainer/run_arith_tiny_cpu.sh": ("actor/reward_kl_penalty", "reference_and_critic"),
    REINFORCE_PP: ("actor/kl_loss", "kl_loss"),
    DAPO: ("train/num_gen_batches", "dapo"),
}

# family -> (the script whose config builds its workers, the roles they hold)
FAMILIES = {
    # the reference in the actor's processes (ReMax's KL in the reward) and GAE's critic; a trainer
    # whose algorithm needs neither leaves them uncalled
    "reference_and_critic": (GAE, ("ActorRolloutRef", "Critic")),
    "kl_loss": (REINFORCE_PP, ("ActorRolloutRef",)),  # its actor needs reference log-probs in every batch
    "dapo": (DAPO, ("ActorRollout",)),  # its actor clips higher (clip_ratio_high, clip_ratio_c)
}

# worker-side keys a script may differ in from its family's script: the group size and the
# mini-batch in prompts, whose product (the rows a worker trains on, ROWS) is the same for all
ROWS_EQUIVALENT = (".rollout.n", ".rollout_n", ".ppo_mini_batch_size")
# the names the rollout's traces are filed under follow each script's trainer.project/experiment_name
NAMES_ONLY = (".trace.project_name", ".trace.experiment_name")


def script_cli_args(script: str) -> list[str]:
    """The arguments `script` passes to `python -m verl.trainer.main_ppo` (without "$@"), its
    `--config-path "$HERE/config"` resolved to the script's folder."""
    path = ROOT / script
    body = path.read_text().split("-m verl.trainer.main_ppo", 1)[1].split('"$@"', 1)[0]
    body = body.replace('"$HERE/config"', str(path.parent / "config"))
    return shlex.split(body.replace("\\\n", " "))


def script_config(script: str, tmp_path: Path, data: tuple[str, str], steps: int = 2):
    """`script`'s config as main_ppo composes it, for `steps` steps of `ROWS` samples on the data
    files `data`, writing under `tmp_path`."""
    from verl.trainer.config import load_ppo_config, parse_command_line

    cmd = parse_command_line(script_cli_args(script))
    n = int(next(a.split("=", 1)[1] for a in cmd.overrides if a.startswith("actor_rollout_ref.rollout.n=")))
    prompts = ROWS // n
    sizes = [
        f"data.train_batch_size={prompts}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
        f"critic.ppo_mini_batch_size={prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={ROWS // 2}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={ROWS // 2}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={ROWS // 2}",
        f"critic.ppo_micro_batch_size_per_gpu={ROWS // 2}",
        # the shared workers' rollout generates this many tokens, whatever the script asks
        "data.max_prompt_length=32",
        "data.max_response_length=8",
    ]
    if "data.gen_batch_size" in " ".join(cmd.overrides):  # DAPO draws 2 batches of prompts per generation
        sizes.append(f"data.gen_batch_size={2 * prompts}")
    return load_ppo_config(
        [
            *cmd.overrides,
            *common_overrides(tmp_path, steps),
            *sizes,
            f"data.train_files={data[0]}",
            f"data.val_files={data[1]}",
            "trainer.progress_bar=false",
        ],
        cmd.config_dir,
        config_name=cmd.config_name,
    )


@pytest.fixture(scope="module")
def arith_data(tmp_path_factory):
    from verl.utils.dataset.arith import ensure_arith_data

    return ensure_arith_data(str(tmp_path_factory.mktemp("arith")))


@pytest.fixture(scope="module")
def workers_of(ray_session, arith_data, tmp_path_factory):
    """`workers_of(family)`: that family's worker groups, built from its script's config on first
    use, then reset to the state they were built in (weights, optimizer, RNGs: a checkpoint saved
    right after the build and loaded before every later use), so that no test trains on what an
    earlier one left and the order of the tests changes nothing. (Without the reset, GRPO after four
    other algorithms' steps once scored 0 on all 16 samples of its second step: no advantage, no
    update, no actor/pg_loss.) One family is held at a time (the previous one's placement groups and
    actors are removed first), so tests ordered by family build each once."""
    from verl.single_controller.ray import RayWorkerGroup, ResourcePoolManager
    from verl.trainer.ppo.worker_groups import Role, spawn_worker_groups
    from verl.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker

    held: dict[str, tuple] = {}  # family -> (groups, pools, the checkpoint of their built state)

    def release() -> None:
        for _, pools, _ in held.values():
            for pool in pools.resource_pool_dict.values():
                pool.remove_placement_groups()
        held.clear()

    def trained_groups(groups: dict) -> list[tuple[str, object]]:
        return [(name, groups[name]) for name in ("actor_rollout_wg", "critic_wg") if name in groups]

    def get(family: str) -> dict:
        if family in held:
            groups, _, snapshot = held[family]
            for name, group in trained_groups(groups):
                group.load_checkpoint(str(snapshot / name))
            return groups
        release()
        script, roles = FAMILIES[family]
        root = tmp_path_factory.mktemp(family)
        config = script_config(script, root, arith_data)
        classes = {"ActorRolloutRef": ActorRolloutRefWorker, "ActorRollout": ActorRolloutRefWorker}
        classes["Critic"] = CriticWorker
        mapping = {Role[name]: classes[name] for name in roles}
        pools = ResourcePoolManager(
            resource_pool_spec={"global_pool": [2]}, mapping=dict.fromkeys(mapping, "global_pool")
        )
        groups = spawn_worker_groups(config, mapping, pools, RayWorkerGroup)
        for name, group in trained_groups(groups):
            group.save_checkpoint(str(root / "built" / name))
        held[family] = (groups, pools, root / "built")
        return groups

    yield get
    release()


def _fit(config, groups, tmp_path, monkeypatch) -> list[dict]:
    """`trainer.fit()` of `config` on `groups`, as main_ppo's TaskRunner builds it; the step records."""
    from verl.trainer.main_ppo import build_datasets, build_role_worker_mapping
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.reward import load_reward_manager
    from verl.utils.tokenizer import hf_tokenizer

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "metrics.jsonl"))
    tokenizer = hf_tokenizer(model_path())
    train, val = build_datasets(config, tokenizer)
    trainer = RayPPOTrainer(
        config=config,
        tokenizer=tokenizer,
        role_worker_mapping=build_role_worker_mapping(config),
        resource_pool_manager=None,  # the workers exist: nothing to place
        reward_fn=load_reward_manager(config, tokenizer, num_examine=0),
        val_reward_fn=load_reward_manager(config, tokenizer, num_examine=1),
        train_dataset=train,
        val_dataset=val,
    )
    trainer.init_workers(groups=groups)
    trainer.fit()
    return read_metrics(tmp_path)


def _worker_settings(config) -> dict:
    """The resolved config the workers of `config`'s trainer read, flattened: the actor, rollout and
    reference sections, and the critic's when the algorithm has one."""
    from omegaconf import OmegaConf

    from verl.trainer.config import need_critic

    sections = ["actor_rollout_ref", *(["critic"] if need_critic(config) else [])]
    flat: dict = {}

    def walk(prefix: str, node) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(f"{prefix}.{key}", value)
        else:
            flat[prefix] = node

    for name in sections:
        walk(name, OmegaConf.to_container(config[name], resolve=True))
    return flat


@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_each_script_s_worker_settings_are_its_family_s(script, tmp_path):
    data = (str(tmp_path / "train.parquet"), str(tmp_path / "test.parquet"))  # composed, never read
    config = script_config(script, tmp_path, data)
    family_config = script_config(FAMILIES[EXAMPLES[script][1]][0], tmp_path, data)
    ours, theirs = _worker_settings(config), _worker_settings(family_config)
    differ = {k: (ours[k], theirs.get(k)) for k in ours if ours[k] != theirs.get(k)}
    assert {k for k in differ if not k.endswith(ROWS_EQUIVALENT + NAMES_ONLY)} == set(), differ
    for section in ("actor_rollout_ref.actor", *(["critic"] if "critic.ppo_mini_batch_size" in ours else [])):
        rows = ours[f"{section}.ppo_mini_batch_size"] * ours["actor_rollout_ref.rollout.n"]
        family_rows = theirs[f"{section}.ppo_mini_batch_size"] * theirs["actor_rollout_ref.rollout.n"]
        assert rows == family_rows == ROWS, (section, rows, family_rows)


# ordered by family, so that each family's workers are built once; the slow tier (make test-all, CI),
# docs/testing.md: the default tier keeps test_main_ppo_e2e's GRPO run
@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(EXAMPLES, key=lambda s: (EXAMPLES[s][1], s)))
def test_example_script_algorithm_trains_two_steps_and_logs_its_metrics(
    script, workers_of, arith_data, tmp_path, monkeypatch
):
    import yaml

    groups = workers_of(EXAMPLES[script][1])
    records = _fit(script_config(script, tmp_path, arith_data), groups, tmp_path, monkeypatch)
    assert [r["step"] for r in records] == [1, 2]
    last = records[-1]["data"]
    metric = EXAMPLES[script][0]
    # the algorithm's own metric comes with an update: a step whose groups all scored alike skips it
    # (actor/skipped_zero_adv), so it is looked for in every step's record
    assert any(metric in r["data"] for r in records), f"{metric} missing from every step of {script}: {sorted(last)}"
    for key in ("critic/score/mean", "response_length/mean", "timing_s/gen", "perf/throughput"):
        assert key in last, f"{key} missing from step metrics of {script}: {sorted(last)}"
    # DAPO's overlong penalty takes scores below 0
    assert 0.0 <= last["critic/score/mean"] <= 1.0 or script.startswith("recipes/dapo"), last["critic/score/mean"]
    run_dir = tmp_path / "run"
    assert (run_dir / "config.yaml").read_text().count("adv_estimator") == 1  # the resolved config
    # the speed paths: a metric each step, recorded beside the config (the start-up log line is
    # a process's output: test_main_ppo_e2e's subprocess run checks it)
    assert last["perf/shared_prompt_forward"] == 1.0, {k: v for k, v in last.items() if k.startswith("perf/")}
    recorded = yaml.safe_load((run_dir / "speed_paths.yaml").read_text())
    assert recorded["shared_prompt_forward"] == {"requested": True, "active": True, "reason": ""}, recorded
    assert set(recorded) >= {"remove_padding", "fused_kernels", "cuda_graphs", "shm_transport"}, recorded
    assert (run_dir / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_recipe_style_driver_trains_through_upstream_s_trainer_surface(workers_of, arith_data, tmp_path, monkeypatch):
    """A `RayPPOTrainer` subclass with its own `fit()` loop, written as verl-recipe's trainers are
    (tests/trainer/recipe_style_trainer.py), trains two GRPO steps on the last family's workers (held
    from the tests above): its advantages are GRPO's (float64, by hand), its update moves the policy,
    it checkpoints and validates."""
    import torch

    from tests.trainer.recipe_style_trainer import RecipeStyleTrainer, grpo_reference
    from verl.trainer.main_ppo import build_role_worker_mapping
    from verl.trainer.ppo.reward import load_reward_manager
    from verl.utils.tokenizer import hf_tokenizer

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "metrics.jsonl"))
    config = script_config(GRPO, tmp_path, arith_data)
    tokenizer = hf_tokenizer(model_path())
    trainer = RecipeStyleTrainer(  # no datasets given: built from data.train_files / val_files, as upstream
        config=config,
        tokenizer=tokenizer,
        role_worker_mapping=build_role_worker_mapping(config),
        resource_pool_manager=None,
        reward_fn=load_reward_manager(config, tokenizer, num_examine=0),
        val_reward_fn=load_reward_manager(config, tokenizer, num_examine=1),
    )
    trainer.init_workers(groups=workers_of("reference_and_critic"))
    from verl.experimental.agent_loop import AgentLoopManager

    assert isinstance(trainer.async_rollout_manager, AgentLoopManager)  # upstream's class, as recipes expect
    final = trainer.fit()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    n = config.actor_rollout_ref.rollout.n
    moved = False
    for seen in trainer.seen:
        batch = seen["batch"]
        assert len(batch) == config.data.train_batch_size * n  # every prompt of the draw, n samples each
        mask = batch.batch["response_mask"]
        assert torch.equal(batch.batch["input_ids"][:, -mask.shape[1] :], batch.batch["responses"])
        uids = list(batch.non_tensor_batch["uid"])
        want = grpo_reference(batch.batch["token_level_rewards"].sum(-1), uids)[:, None] * mask
        torch.testing.assert_close(batch.batch["advantages"].double(), want, atol=1e-5, rtol=1e-5)
        if want.abs().max() == 0:  # every group scored alike: the update is skipped, saying so
            assert seen["metrics"].get("actor/skipped_zero_adv") == 1.0, seen["metrics"]
            continue
        assert "actor/pg_loss" in seen["metrics"] and seen["metrics"]["actor/grad_norm"] > 0
        if want.abs().max() > 0:  # a step with any advantage changes the policy's log-probs
            diff = (seen["after"] - batch.batch["old_log_probs"]).abs() * mask
            moved |= bool(diff.max() > 1e-4)
    assert moved
    assert (tmp_path / "ckpt" / "global_step_2" / "actor").is_dir()
    assert any(k.startswith("val-core/") for k in final), sorted(final)
