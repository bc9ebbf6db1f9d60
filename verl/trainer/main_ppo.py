"""`python -m verl.trainer.main_ppo key=value ...`: the PPO/GRPO entry point.

Overrides use Hydra's grammar against `config/ppo_trainer.yaml`; the config is validated before
Ray starts (a typo fails in a second with a did-you-mean, not after model loading). The driver then connects to Ray (a
local cluster by default, an existing one through RAY_ADDRESS or `ray_kwargs.ray_init.address`)
and runs everything inside a `TaskRunner` actor, so a job submitted to a cluster (`ray job
submit ... -- python -m verl.trainer.main_ppo ...`) behaves the same as a local run.

With no overrides it runs the embedded task: the bundled tiny model learns 2-digit addition with
GRPO on CPU, with the data generated on first use.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> None:
    """Parse Hydra-style overrides (`key=value`, `+key=value`, `--config-path/--config-name`),
    validate, and train. A config mistake exits with status 2 and one message listing every problem;
    a cluster too small for the run (a missing node, too few devices) exits with status 1 and the
    message that says what is missing."""
    from verl.trainer.config import ConfigError, load_ppo_config, parse_cli_args

    try:
        config_path, overrides = parse_cli_args(sys.argv[1:] if argv is None else argv)
        config = load_ppo_config(overrides, config_path)
    except ConfigError as e:
        print(f"verl: invalid configuration\n{e}", file=sys.stderr)
        raise SystemExit(2) from None
    from verl.single_controller.base import ResourceUnavailableError

    try:
        run_ppo(config)
    except ResourceUnavailableError as e:  # raised in the TaskRunner: print the message, not Ray's traceback
        print(f"verl: the Ray cluster cannot hold this run\n{getattr(e, 'cause', None) or e}", file=sys.stderr)
        raise SystemExit(1) from None


def _job_runtime_env() -> dict:
    """The runtime_env of the Ray job this driver runs in (`ray job submit --runtime-env-json`), or {}."""
    import json

    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")  # set by Ray's job manager for the entrypoint
    return (json.loads(raw).get("runtime_env") or {}) if raw else {}


def _ray_init_kwargs(config) -> dict:
    """`ray_kwargs.ray_init` plus a runtime_env that makes workers import this checkout's verl.

    Inside a submitted job, Ray merges the job's runtime_env with the one given to `ray.init` and
    refuses any env var set by both; our env vars are only defaults, so those the job sets are left
    to the job.
    """
    from verl.trainer.config import ray_init_kwargs

    kwargs = ray_init_kwargs(config)
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pythonpath = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
    defaults = {
        "TOKENIZERS_PARALLELISM": "true",
        "VERL_LOGGING_LEVEL": os.environ.get("VERL_LOGGING_LEVEL", "WARNING"),
        "VERL_DEVICE": os.environ.get("VERL_DEVICE", "auto"),
        "PYTHONPATH": pythonpath,
    }
    job_env_vars = _job_runtime_env().get("env_vars") or {}
    env_vars = {k: v for k, v in defaults.items() if k not in job_env_vars}
    runtime_env = dict(kwargs.pop("runtime_env", None) or {})
    runtime_env["env_vars"] = {**env_vars, **(runtime_env.get("env_vars") or {})}
    kwargs.setdefault("include_dashboard", False)
    if not kwargs.get("address") and not os.environ.get("RAY_ADDRESS"):  # we start the cluster: tune it
        from verl.single_controller.ray import RAY_SYSTEM_CONFIG

        kwargs.setdefault("_system_config", RAY_SYSTEM_CONFIG)
    return {"runtime_env": runtime_env, **kwargs}


def run_ppo(config, task_runner_cls=None) -> dict:
    """Start or join Ray and train in a TaskRunner actor; returns the final step's metrics."""
    import ray

    from verl.trainer.config import validate_ppo_config
    from verl.utils.device import set_device_preference

    validate_ppo_config(config)
    set_device_preference(config.trainer.get("device", "auto"))
    if not ray.is_initialized():
        ray.init(**_ray_init_kwargs(config))
    runner_cls = ray.remote(num_cpus=0)(task_runner_cls or TaskRunner)
    runner = runner_cls.remote()
    return ray.get(runner.run.remote(config))


def build_role_worker_mapping(config):
    """Roles -> worker classes. The reference policy shares the actor's worker (the hybrid engine)."""
    from verl.trainer.config import need_critic, need_reference_policy
    from verl.trainer.ppo.ray_trainer import Role
    from verl.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker

    actor_role = Role.ActorRolloutRef if need_reference_policy(config) else Role.ActorRollout
    mapping = {actor_role: ActorRolloutRefWorker}
    if need_critic(config):
        mapping[Role.Critic] = CriticWorker
    if config.reward_model.get("enable", False):
        mapping[Role.RewardModel] = RewardModelWorker
    return mapping


def build_datasets(config, tokenizer) -> tuple:
    """(train, validation or None) prompt datasets: `data.custom_cls` swaps in a user Dataset class
    (RLHFDataset's constructor), `data.train_max_samples` / `data.val_max_samples` cap the rows.
    Multi-turn rollouts always get the prompt messages (`data.return_raw_chat`)."""
    from omegaconf import OmegaConf

    from verl.utils.dataset.rl_dataset import create_rl_dataset

    data = config.data
    if config.actor_rollout_ref.rollout.get("multi_turn", {}).get("enable", False):
        # agent loops render the prompt messages with the tool schemas and check tokenization against them
        data = OmegaConf.merge(data, {"return_raw_chat": True})
    train = create_rl_dataset(data.train_files, data, tokenizer, is_train=True)
    val_files = data.get("val_files")
    val = create_rl_dataset(val_files, data, tokenizer, is_train=False) if val_files else None
    return train, val


def _ensure_default_data(config) -> None:
    """Generate the embedded arithmetic task on first use when the config points at its cache files."""
    from verl.utils.dataset.arith import default_cache_dir, ensure_arith_data

    defaults = {os.path.realpath(os.path.join(default_cache_dir(), name)) for name in ("train.parquet", "test.parquet")}
    files = []
    for key in ("train_files", "val_files"):
        value = config.data.get(key)
        files.extend([value] if isinstance(value, str) else list(value or []))
    if any(os.path.realpath(os.path.expanduser(f)) in defaults for f in files):
        ensure_arith_data()


class TaskRunner:
    """Builds tokenizer, datasets, reward functions, worker roles and pools, then trains."""

    def run(self, config) -> dict:
        from verl.single_controller.ray import ResourcePoolManager
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer
        from verl.trainer.ppo.reward import load_reward_manager
        from verl.utils.tokenizer import hf_tokenizer

        _ensure_default_data(config)
        model_path = config.actor_rollout_ref.model.path
        tokenizer = hf_tokenizer(config.actor_rollout_ref.model.get("tokenizer_path") or model_path)

        mapping = build_role_worker_mapping(config)
        trainer_cfg = config.trainer
        pool_spec = {"global_pool": [trainer_cfg.n_gpus_per_node] * trainer_cfg.nnodes}
        pool_manager = ResourcePoolManager(
            resource_pool_spec=pool_spec, mapping={role: "global_pool" for role in mapping}
        )

        reward_fn = load_reward_manager(config, tokenizer, num_examine=0)
        val_reward_fn = load_reward_manager(config, tokenizer, num_examine=1)
        train_dataset, val_dataset = build_datasets(config, tokenizer)

        trainer = RayPPOTrainer(
            config=config,
            tokenizer=tokenizer,
            role_worker_mapping=mapping,
            resource_pool_manager=pool_manager,
            reward_fn=reward_fn,
            val_reward_fn=val_reward_fn,
            train_dataset=train_dataset,
            val_dataset=val_dataset,
        )
        try:
            trainer.init_workers()
            return trainer.fit()  # the tracker writes metrics.jsonl and training_curves.png into trainer.run_dir
        finally:
            # Placement groups live as long as the driver's job, not this actor: give the devices
            # back now (removing a group also ends its worker actors), so a second run_ppo in the
            # same driver can place its workers.
            for pool in pool_manager.resource_pool_dict.values():
                pool.remove_placement_groups()


if __name__ == "__main__":
    main()
