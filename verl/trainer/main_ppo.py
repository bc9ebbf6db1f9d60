"""`python -m verl.trainer.main_ppo key=value ...`: the PPO/GRPO entry point.

Overrides use Hydra's grammar against `config/ppo_trainer.yaml`; the config is validated before
Ray starts (a typo fails in a second with a did-you-mean, not after model loading). The driver then connects to Ray (a
local cluster by default, an existing one through RAY_ADDRESS or `ray_kwargs.ray_init.address`)
and runs everything inside a `TaskRunner` actor, so a job submitted to a cluster (`ray job
submit ... -- python -m verl.trainer.main_ppo ...`) behaves the same as a local run.

With no overrides it runs the embedded task: the bundled tiny model learns 2-digit addition with
GRPO on CPU, with the data generated on first use.

How a run ends (docs/reliability.md): 0 when training completes; 2 when the config or the run's
inputs are wrong (checked before Ray starts: `validate_ppo_config`, then `verl.trainer.preflight`);
1 when training fails, with the cause's message as the last line of stderr (a worker that died,
a reward function that raised, NaN losses in a row, ...); 130 after Ctrl-C and 143 after SIGTERM
(`kill`, `timeout`, a scheduler's preemption, `ray job stop`), once the workers are stopped.
Failures the user can fix print only their message; anything else also prints its
traceback (set VERL_LOGGING_LEVEL=DEBUG to get it for every failure).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading


def main(argv: list[str] | None = None, *, entry=None) -> None:
    """Parse Hydra-style arguments (`key=value`, `+key=value`, `--config-path/--config-name`,
    `--cfg job`), validate, and train. A config or input mistake exits with status 2 and one message
    listing every problem; a failed run (a dead worker, a cluster too small for the run, ...) exits
    with status 1 and the message that says what went wrong; Ctrl-C stops the workers and exits with 130.

    `--cfg job` (Hydra's flag) prints the composed config and runs every check that needs no model,
    data or Ray (the config's own rules, then this machine's devices and engines), exiting 0 or 2.

    entry: another entry point's `EntryPoint` (its module directory, default config and the function that
    turns its composed config into this trainer's, e.g. upstream's async entry points); default main_ppo's."""
    from verl.trainer.config import ConfigError, check_machine, load_ppo_config, parse_command_line

    try:
        cmd = parse_command_line(sys.argv[1:] if argv is None else argv, **(entry.command_line() if entry else {}))
        translate = entry.translate if entry else None
        if cmd.cfg is not None:
            _print_config(cmd, translate)
            return
        config = load_ppo_config(cmd.overrides, cmd.config_dir, config_name=cmd.config_name, translate=translate)
        check_machine(config)
    except ConfigError as e:
        print(f"verl: invalid configuration\n{e}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        run_ppo(config)
    except KeyboardInterrupt as e:
        terminated = isinstance(e, Terminated)
        print(
            f"verl: {'terminated (SIGTERM)' if terminated else 'interrupted'}; the workers were stopped. Checkpoints "
            "up to the last completed save are intact: run the same command again to resume from it "
            "(trainer.resume_mode=auto)",
            file=sys.stderr,
        )
        raise SystemExit(143 if terminated else 130) from None
    except Exception as e:
        raise SystemExit(_report_failure(e)) from None


def _print_config(cmd, translate=None) -> None:
    """`--cfg job`: the composed config on stdout (as Hydra prints it; an entry point's as this trainer
    reads it), then the checks; a failed check raises."""
    from omegaconf import OmegaConf

    from verl.trainer.config import check_machine, compose_config, validate_ppo_config

    config = compose_config(cmd.overrides, cmd.config_dir, config_name=cmd.config_name)
    if translate is not None:
        translate(config)
    print(OmegaConf.to_yaml(config, resolve=cmd.resolve), end="")
    sys.stdout.flush()
    validate_ppo_config(config)
    check_machine(config)
    print("verl: the config passed every check that needs no model, data or Ray", file=sys.stderr)


def _report_failure(error: BaseException) -> int:
    """Print why the run failed (the remote cause, not Ray's wrapper) and return the exit status."""
    import traceback

    from verl.trainer.config import ConfigError
    from verl.trainer.preflight import RunInputError

    cause = getattr(error, "cause", None) or error  # a RayTaskError carries the TaskRunner's exception
    if isinstance(cause, RunInputError):  # its message starts with "cannot start"
        print(f"verl: {cause}", file=sys.stderr)
        return 2
    if isinstance(cause, ConfigError):
        print(f"verl: invalid configuration\n{cause}", file=sys.stderr)
        return 2
    user_fixable = _user_fixable_errors()
    if not isinstance(cause, user_fixable) or os.environ.get("VERL_LOGGING_LEVEL", "").upper() == "DEBUG":
        traceback.print_exception(error, file=sys.stderr)
    from verl.single_controller.base import ResourceUnavailableError

    if isinstance(cause, ResourceUnavailableError):
        print(f"verl: the Ray cluster cannot hold this run\n{cause}", file=sys.stderr)
    else:
        print(f"verl: training failed: {type(cause).__name__}: {cause}", file=sys.stderr)
    return 1


def _user_fixable_errors() -> tuple[type, ...]:
    """Failures whose message says everything (what, where, what to do); their tracebacks are noise."""
    from verl.single_controller.base import ResourceUnavailableError, WorkerDiedError, WorkerTimeoutError
    from verl.trainer.ppo.ray_trainer import NonFiniteLossError
    from verl.utils.checkpoint.safe_load import UnsafeCheckpointError
    from verl.workers.reward_manager.abstract import RewardFunctionError

    return (
        ResourceUnavailableError,
        WorkerDiedError,
        WorkerTimeoutError,
        NonFiniteLossError,
        RewardFunctionError,
        UnsafeCheckpointError,
    )


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
    if not config.trainer.progress_bar:  # the workers' model-loading bars (huggingface_hub's switch)
        defaults["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    job_env_vars = _job_runtime_env().get("env_vars") or {}
    env_vars = {k: v for k, v in defaults.items() if k not in job_env_vars}
    runtime_env = dict(kwargs.pop("runtime_env", None) or {})
    runtime_env["env_vars"] = {**env_vars, **(runtime_env.get("env_vars") or {})}
    # Nothing listens for HTTP unless asked: no dashboard by default, and a dashboard that is turned on
    # serves localhost only (dashboard_host opens it up; docs/reliability.md, Security).
    kwargs.setdefault("include_dashboard", False)
    kwargs.setdefault("dashboard_host", "127.0.0.1")
    if not kwargs.get("address") and not os.environ.get("RAY_ADDRESS"):  # we start the cluster: tune it
        from verl.single_controller.ray import RAY_SYSTEM_CONFIG

        kwargs.setdefault("_system_config", RAY_SYSTEM_CONFIG)
    return {"runtime_env": runtime_env, **kwargs}


class Terminated(KeyboardInterrupt):
    """SIGTERM reached the driver: stopped like Ctrl-C (workers first), exit status 143."""


_sigterm_received = threading.Event()


def _raise_terminated(signum, frame):
    _sigterm_received.set()  # ray.get turns any KeyboardInterrupt raised inside it into a plain one
    raise Terminated()


@contextlib.contextmanager
def _sigterm_stops_the_run():
    """While open (main thread only), SIGTERM raises `Terminated` in the driver instead of Ray's
    default for its driver process (a stack dump and abort that leaves the workers to Ray's cleanup)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _sigterm_received.clear()
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_ppo(config, task_runner_class=None) -> dict:
    """Start or join Ray and train in a TaskRunner actor; returns the final step's metrics.

    task_runner_class: a recipe's TaskRunner (upstream's hook), a plain class or one already wrapped
    with `ray.remote`; default `TaskRunner`. The config and the run's inputs are checked first
    (`ConfigError`, before Ray starts). On KeyboardInterrupt (Ctrl-C) the TaskRunner and its workers
    are stopped before it propagates. With `ray_kwargs.timeline_json_file` the Ray timeline of the
    run (chrome://tracing JSON) is written there at the end.
    """
    import ray

    from verl.trainer.config import validate_ppo_config
    from verl.trainer.preflight import check_run_inputs, skip_reason
    from verl.utils.device import set_device_preference
    from verl.utils.profiler import GlobalProfilerConfig, check_tool_available

    validate_ppo_config(config)
    if skip_reason(config) is None:
        check_run_inputs(config)
    set_device_preference(config.trainer.device)
    profiling = GlobalProfilerConfig.from_config(config.global_profiler)
    if profiling.active:
        check_tool_available(profiling.tool)  # before Ray starts: nsys must be installed
    started_cluster = not ray.is_initialized()
    if started_cluster:
        ray.init(**_ray_init_kwargs(config))
    runner_cls = task_runner_class or TaskRunner
    if not hasattr(runner_cls, "remote"):  # a plain class; upstream's callers pass ray.remote(...)(cls)
        runner_cls = ray.remote(num_cpus=0)(runner_cls)
    if profiling.controller_runtime_env():  # nsys: the driver's TaskRunner runs under nsys too
        runner_cls = runner_cls.options(runtime_env=profiling.controller_runtime_env())
    with _sigterm_stops_the_run():  # installed after ray.init, which sets its own handler
        runner = runner_cls.remote()
        try:
            result = ray.get(runner.run.remote(config))
            write_ray_timeline(config)
            return result
        except KeyboardInterrupt as e:
            terminated = _sigterm_received.is_set()  # set by the handler before it raises
            _stop_run(runner, shutdown=started_cluster, why="terminated" if terminated else "interrupted")
            if terminated and not isinstance(e, Terminated):
                raise Terminated() from None
            raise


def write_ray_timeline(config) -> str | None:
    """`ray_kwargs.timeline_json_file` (or the legacy `ray_init.timeline_json_file`): write the Ray
    timeline of the tasks and actor calls so far there (chrome://tracing JSON); returns the path,
    or None when none is configured."""
    import ray

    from verl.trainer.config.loader import ray_timeline_file

    path = ray_timeline_file(config)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        ray.timeline(filename=path)
        print(f"verl: Ray timeline written to {path}")
    return path


def _stop_run(runner, shutdown: bool, timeout_s: float = 20.0, why: str = "interrupted") -> None:
    """Ctrl-C or SIGTERM: kill the TaskRunner and this job's worker actors, then stop the local cluster if we
    started it, so no worker outlives the driver. Bounded: after a terminal Ctrl-C the Ray daemons
    (same process group as the driver) may already be gone, and nothing here may hang on them."""
    import contextlib
    import threading

    import ray

    def stop() -> None:
        # Worker actors are owned by the TaskRunner and die with it; they are also killed by name, so
        # they are gone before the cluster is, not whenever Ray notices that their owner died. Any of
        # these calls may fail once the cluster is going down; shutting it down is then all that is left.
        with contextlib.suppress(Exception):
            ray.kill(runner, no_restart=True)
            for name in ray.util.list_named_actors():
                if name.startswith("verl_"):
                    with contextlib.suppress(Exception):  # already dead with its owner
                        ray.kill(ray.get_actor(name), no_restart=True)
        if shutdown:
            ray.shutdown()

    print(f"verl: {why}; stopping the workers ...", file=sys.stderr)
    thread = threading.Thread(target=stop, name="verl-stop-run", daemon=True)
    thread.start()
    thread.join(timeout_s)


def build_role_worker_mapping(config):
    """Roles -> worker classes, as `TaskRunner`'s `add_*_worker` methods choose them. The reference
    policy shares the actor's worker (the hybrid engine)."""
    runner = TaskRunner()
    actor_cls, _ = runner.add_actor_rollout_worker(config)
    runner.add_critic_worker(config)
    runner.add_reward_model_worker(config)
    runner.add_ref_policy_worker(config, actor_cls)
    return runner.role_worker_mapping


def _worker_backend(strategy: str):
    """The worker module of a training strategy: megatron_workers or fsdp_workers."""
    if strategy == "megatron":
        from verl.workers import megatron_workers

        return megatron_workers
    from verl.workers import fsdp_workers

    return fsdp_workers


def build_resource_pools(config, mapping) -> tuple[dict, dict]:
    """(pool name -> workers per node, role -> pool name): one global pool, plus a `rollout_pool`
    of `rollout.nnodes x rollout.n_gpus_per_node` when generation has a pool of its own, and a
    `reward_pool` of `reward_model.nnodes x reward_model.n_gpus_per_node` with
    `reward_model.enable_resource_pool` (upstream's names; the trainer spawns one worker group per pool)."""
    from verl.trainer.ppo.ray_trainer import Role

    trainer_cfg = config.trainer
    spec = {"global_pool": [trainer_cfg.n_gpus_per_node] * trainer_cfg.nnodes}
    roles = {role: "global_pool" for role in mapping}
    if Role.Rollout in mapping:
        spec["rollout_pool"] = [config.rollout.n_gpus_per_node] * config.rollout.nnodes
        roles[Role.Rollout] = "rollout_pool"
    rm = config.reward_model
    if Role.RewardModel in mapping and rm.enable_resource_pool:
        spec["reward_pool"] = [rm.n_gpus_per_node] * rm.nnodes
        roles[Role.RewardModel] = "reward_pool"
    return spec, roles


def load_processor(config):
    """The policy's multi-modal processor (upstream's `hf_processor(model.path)`), or None for a
    text-only policy.

    Whether the policy is a vision-language model is read from its HF config. A hub id's config is
    first read here (the driver's config check reads local directories only), so the rules for
    vision-language policies (verl/trainer/config/validate_multimodal.py) are applied here too, before
    any worker starts. A config that cannot be read is left to the workers, which report it with the
    model's path."""
    from omegaconf import OmegaConf

    from verl.trainer.config import ConfigError
    from verl.trainer.config.validate_multimodal import vision_language_problems
    from verl.trainer.preflight import RunInputError
    from verl.utils.tokenizer import hf_processor
    from verl.utils.vision import is_vision_language_config

    model = config.actor_rollout_ref.model
    trust_remote_code = bool(model.get("trust_remote_code", False))
    try:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(
            model.get("hf_config_path") or model.path, trust_remote_code=trust_remote_code
        )
    except Exception:  # the workers load the model and report its error with the path
        return None
    if not is_vision_language_config(hf_config):
        return None
    plain = OmegaConf.to_container(config, resolve=True)
    problems = vision_language_problems(plain, str(model.path), getattr(hf_config, "model_type", None))
    if problems:
        raise ConfigError("\n".join(problems), problems)
    processor = hf_processor(model.path, trust_remote_code=trust_remote_code)
    if processor is None:
        raise RunInputError(
            f"cannot start: {model.path} is a vision-language model but holds no processor files "
            "(preprocessor_config.json); copy them from the model it was trained from, so that images can be "
            "turned into the model's inputs"
        )
    return processor


def build_datasets(config, tokenizer, processor=None) -> tuple:
    """(train, validation or None) prompt datasets: `data.custom_cls` swaps in a user Dataset class
    (RLHFDataset's constructor), `data.train_max_samples` / `data.val_max_samples` cap the rows.
    Multi-turn rollouts and a learned reward model with `input_tokenizer` always get the prompt
    messages (`data.return_raw_chat`). `processor`: a vision-language policy's (`load_processor`),
    which turns each row's images into the model's inputs."""
    from omegaconf import OmegaConf

    from verl.utils.dataset.rl_dataset import create_rl_dataset

    data = config.data
    rm = config.reward_model
    if config.actor_rollout_ref.rollout.multi_turn.enable or (rm.enable and rm.model.input_tokenizer):
        # agent loops render the prompt messages with the tool schemas and check tokenization against
        # them; a reward model with its own tokenizer re-renders them with its chat template
        data = OmegaConf.merge(data, {"return_raw_chat": True})
    train = create_rl_dataset(data.train_files, data, tokenizer, processor=processor, is_train=True)
    val_files = data.val_files
    val = create_rl_dataset(val_files, data, tokenizer, processor=processor, is_train=False) if val_files else None
    return train, val


class TaskRunner:
    """Builds tokenizer, processor (vision-language policies), datasets, reward functions, worker roles and pools, then trains.

    Upstream's surface for recipes that subclass it: `role_worker_mapping` (role -> worker class) and
    `mapping` (role -> pool name) filled by `add_actor_rollout_worker`, `add_critic_worker`,
    `add_reward_model_worker` and `add_ref_policy_worker`, and `init_resource_pool_mgr`, all called
    by `run`, so an override of one of them changes the run. Differences: the reference policy lives
    in the actor's processes (`Role.ActorRolloutRef`), so `add_ref_policy_worker` adds nothing (as
    upstream's new worker implementation); a critic is added only when the config trains one.
    """

    def __init__(self):
        self.role_worker_mapping: dict = {}
        self.mapping: dict = {}

    def add_actor_rollout_worker(self, config):
        """The actor-rollout worker (with the reference in its processes when a KL term needs one),
        and generation's own worker group in `rollout_pool` for asynchronous training. Returns
        (worker class, worker group class)."""
        from verl.single_controller.ray import RayWorkerGroup
        from verl.trainer.config import need_reference_policy
        from verl.trainer.ppo.async_rollout import staleness_threshold
        from verl.trainer.ppo.ray_trainer import Role
        from verl.workers.fsdp_workers import ActorRolloutRefWorker

        role = Role.ActorRolloutRef if need_reference_policy(config) else Role.ActorRollout
        actor_cls = _worker_backend(config.actor_rollout_ref.actor.strategy).ActorRolloutRefWorker
        self.role_worker_mapping[role] = actor_cls
        self.mapping[role] = "global_pool"
        if staleness_threshold(config) > 0:  # generation runs ahead of training in its own pool
            self.role_worker_mapping[Role.Rollout] = ActorRolloutRefWorker
            self.mapping[Role.Rollout] = "rollout_pool"
        return actor_cls, RayWorkerGroup

    def add_critic_worker(self, config):
        from verl.trainer.config import need_critic
        from verl.trainer.ppo.ray_trainer import Role

        if need_critic(config):
            self.role_worker_mapping[Role.Critic] = _worker_backend(config.critic.strategy).CriticWorker
            self.mapping[Role.Critic] = "global_pool"

    def add_reward_model_worker(self, config):
        from verl.experimental.reward_loop.reward_model import uses_generative_reward_model
        from verl.trainer.ppo.ray_trainer import Role

        rm = config.reward_model
        # a reward model served to the custom reward function runs in servers of its own, not in workers
        if rm.enable and not uses_generative_reward_model(config):
            self.role_worker_mapping[Role.RewardModel] = _worker_backend(rm.strategy).RewardModelWorker
            self.mapping[Role.RewardModel] = "reward_pool" if rm.enable_resource_pool else "global_pool"

    def add_ref_policy_worker(self, config, ref_policy_cls):
        """Nothing to add: the reference policy runs in the actor's processes (`Role.ActorRolloutRef`,
        chosen by `add_actor_rollout_worker`)."""

    def init_resource_pool_mgr(self, config):
        """The resource pools of `self.mapping`'s pool names: `global_pool` (nnodes x n_gpus_per_node),
        `rollout_pool` and `reward_pool` (their sections' sizes)."""
        import ray

        from verl.single_controller.ray import ResourcePoolManager
        from verl.single_controller.ray.resource_pool_manager import bundles_hold_gpus

        spec, default_pools = build_resource_pools(config, self.role_worker_mapping)
        # a role an override added to role_worker_mapping alone gets its default pool
        pools = {**default_pools, **self.mapping}
        missing = sorted({pool for pool in pools.values() if pool not in spec})
        if missing:
            raise ValueError(f"TaskRunner.mapping names resource pools {missing} that the config does not size")
        # GPU or CPU bundles as trainer.device asks (this actor may not see the driver's VERL_DEVICE)
        use_gpu = bundles_hold_gpus(config.trainer.device, ray.cluster_resources().get("GPU", 0))
        return ResourcePoolManager(resource_pool_spec=spec, mapping=pools, use_gpu=use_gpu)

    def run(self, config) -> dict:
        from verl.trainer.default_data import ensure_default_data
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer
        from verl.trainer.ppo.reward import load_reward_manager
        from verl.utils.tokenizer import hf_tokenizer

        ensure_default_data(config)
        model_path = config.actor_rollout_ref.model.path
        tokenizer = hf_tokenizer(config.actor_rollout_ref.model.tokenizer_path or model_path)
        processor = load_processor(config)  # None for a text-only policy
        # The datasets first: their checks (malformed rows, over-long prompts with data.truncation=error)
        # are the most likely start-up failures left after the driver's pre-flight checks.
        try:
            train_dataset, val_dataset = build_datasets(config, tokenizer, processor)
        except (ValueError, TypeError, OSError) as e:  # the dataset's messages name the file, row and fix
            from verl.trainer.preflight import RunInputError

            raise RunInputError(f"cannot start: the data is not usable: {e}") from e

        actor_cls, worker_group_cls = self.add_actor_rollout_worker(config)
        self.add_critic_worker(config)
        self.add_reward_model_worker(config)
        self.add_ref_policy_worker(config, actor_cls)
        pool_manager = self.init_resource_pool_mgr(config)

        reward_fn = load_reward_manager(config, tokenizer, num_examine=0)
        val_reward_fn = load_reward_manager(config, tokenizer, num_examine=1)

        trainer = RayPPOTrainer(
            config=config,
            tokenizer=tokenizer,
            role_worker_mapping=self.role_worker_mapping,
            resource_pool_manager=pool_manager,
            ray_worker_group_cls=worker_group_cls,
            processor=processor,
            reward_fn=reward_fn,
            val_reward_fn=val_reward_fn,
            train_dataset=train_dataset,
            val_dataset=val_dataset,
            validate_config=False,  # run_ppo checked it before Ray started
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


def create_rl_dataset(data_paths, data_config, tokenizer, processor=None, is_train: bool = True, max_samples: int = -1):
    """The RL prompt dataset (upstream's entry point): `data.custom_cls` or RLHFDataset over
    `data_paths`; `max_samples` > 0 caps the rows (else `data.train_max_samples` /
    `data.val_max_samples` do)."""
    from omegaconf import OmegaConf

    from verl.utils.dataset.rl_dataset import create_rl_dataset as build

    if max_samples is not None and max_samples > 0:
        key = "train_max_samples" if is_train else "val_max_samples"
        data_config = OmegaConf.merge(data_config, {key: max_samples})
    return build(data_paths, data_config, tokenizer, processor=processor, is_train=is_train)


def create_rl_sampler(data_config, dataset):
    """Upstream's import path for the training sampler (`verl.trainer.ppo.dataloaders`)."""
    from verl.trainer.ppo.dataloaders import create_rl_sampler as create

    return create(data_config, dataset)


if __name__ == "__main__":
    main()
