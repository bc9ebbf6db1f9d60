"""`python -m verl.trainer.main_ppo key=value ...`: the PPO/GRPO entry point.

Hydra parses the overrides against `config/ppo_trainer.yaml`; the config is validated before Ray
starts (a typo fails in a second, not after model loading). The driver then connects to Ray (a
local cluster by default, an existing one through RAY_ADDRESS or `ray_kwargs.ray_init.address`)
and runs everything inside a `TaskRunner` actor, so a job submitted to a cluster (`ray job
submit ... -- python -m verl.trainer.main_ppo ...`) behaves the same as a local run.

With no overrides it runs the embedded task: the bundled tiny model learns 2-digit addition with
GRPO on CPU, with the data generated on first use.
"""

from __future__ import annotations

import os

import hydra


@hydra.main(config_path="config", config_name="ppo_trainer", version_base=None)
def main(config) -> None:
    run_ppo(config)


def _ray_init_kwargs(config) -> dict:
    from omegaconf import OmegaConf

    ray_init = OmegaConf.to_container(config.get("ray_kwargs", {}).get("ray_init", {}) or {}, resolve=True)
    ray_init = {k: v for k, v in ray_init.items() if v is not None}
    env_vars = {
        "TOKENIZERS_PARALLELISM": "true",
        "NCCL_DEBUG": "WARN",
        "VERL_LOGGING_LEVEL": os.environ.get("VERL_LOGGING_LEVEL", "WARNING"),
        "VERL_DEVICE": os.environ.get("VERL_DEVICE", "auto"),
    }
    # Workers must import this checkout's verl, also when it is not pip-installed.
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pythonpath = os.environ.get("PYTHONPATH", "")
    env_vars["PYTHONPATH"] = package_root + (os.pathsep + pythonpath if pythonpath else "")
    runtime_env = ray_init.pop("runtime_env", {}) or {}
    runtime_env.setdefault("env_vars", {}).update({k: v for k, v in env_vars.items() if k not in runtime_env["env_vars"]})
    ray_init.setdefault("include_dashboard", False)
    return {"runtime_env": runtime_env, **ray_init}


def run_ppo(config, task_runner_cls=None) -> dict:
    """Validate `config`, start or join Ray, and train in a TaskRunner actor; returns final metrics."""
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
    """Roles -> worker classes, and every role -> the one shared pool (the hybrid engine)."""
    from verl.trainer.ppo.ray_trainer import Role
    from verl.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker

    algo = config.algorithm
    arc = config.actor_rollout_ref
    needs_ref = bool(arc.actor.get("use_kl_loss", False) or algo.get("use_kl_in_reward", False))
    actor_role = Role.ActorRolloutRef if needs_ref else Role.ActorRollout
    mapping = {actor_role: ActorRolloutRefWorker}
    if use_critic(config):
        mapping[Role.Critic] = CriticWorker
    if config.reward_model.get("enable", False):
        mapping[Role.RewardModel] = RewardModelWorker
    return mapping


def use_critic(config) -> bool:
    """A critic runs when the estimator needs values (gae), unless critic.enable says otherwise."""
    enable = config.critic.get("enable", None)
    return bool(enable) if enable is not None else config.algorithm.adv_estimator == "gae"


class TaskRunner:
    """Builds tokenizer, datasets, reward functions, worker roles and pools, then trains."""

    def run(self, config) -> dict:
        from verl.single_controller.ray import ResourcePoolManager
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer
        from verl.trainer.ppo.reward import load_reward_manager
        from verl.utils.dataset.arith import ensure_default_data
        from verl.utils.dataset.rl_dataset import RLHFDataset
        from verl.utils.tokenizer import hf_tokenizer

        ensure_default_data(config)
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
        train_dataset = RLHFDataset(config.data.train_files, tokenizer, config.data)
        val_dataset = RLHFDataset(config.data.val_files, tokenizer, config.data) if config.data.get("val_files") else None

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
        trainer.init_workers()
        metrics = trainer.fit()
        self._plot(config, trainer)
        return metrics

    @staticmethod
    def _plot(config, trainer) -> None:
        from verl.utils.plotting import plot_training_curves

        path = trainer.tracker.jsonl_path if hasattr(trainer.tracker, "jsonl_path") else None
        if path and os.path.exists(path):
            out = os.path.join(os.path.dirname(path), "training_curves.png")
            plot_training_curves(path, out)
            trainer.tracker.log_artifact(out) if hasattr(trainer.tracker, "log_artifact") else None


if __name__ == "__main__":
    main()
