"""Build the trainer's rule-based reward function from the config (upstream verl's entry points).

- ``get_custom_reward_fn(config)``: the user function named by ``custom_reward_function.path`` /
  ``.name`` (default name ``compute_score``), with ``custom_reward_function.reward_kwargs`` bound as
  keyword arguments; None when no path is set. Loading errors name the setting and say how to fix it
  (missing file with the working directory, import failure with the original exception, missing
  function with the callables the file does define).
- ``load_reward_manager(config, tokenizer, num_examine, **reward_kwargs)``: imports the custom reward
  file first (as upstream, so a manager that file registers with ``@register(name)`` can be named), then the manager named by
  ``reward_manager.name`` (which follows ``reward_model.reward_manager``; default "naive"), or the
  class ``reward_manager.module.name`` of the file ``module.path`` with ``source=importlib``, around that function or
  ``default_compute_score``; manager options come from ``reward_model.reward_kwargs``, overridden by
  explicit keyword arguments. What a failing reward function does is ``custom_reward_function.on_error``
  (raise | zero); ``reward_model.reward_kwargs.on_error``, the older spelling, still works.
- With ``reward_model.reward_loop_source=importlib``, ``load_reward_manager`` returns instead the
  custom reward loop class ``reward_loop_class_name`` of the file ``reward_loop_module_path``
  (upstream's reward-loop interface) run as the reward manager (verl.workers.reward_manager.reward_loop).
- A ``reward_manager`` name the driver's registry lacks but the reward loop's has
  (verl.experimental.reward_loop.reward_manager: ``remote``, or a class the custom reward file registers
  with that package's ``@register(name)``, as upstream's reward-loop doc tells users) runs that class the
  same way.
- ``compute_reward(data, reward_fn)`` -> ``(reward_tensor, reward_extra_info)``; errors propagate
  (upstream's silent fallback to a second call is deliberately not reproduced).
- ``compute_reward_async``: ``compute_reward`` as a Ray task (``compute_reward_async.remote(data,
  reward_fn)``), created on first use so importing this module does not import ray.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

from verl.experimental.reward_loop.reward_model import (
    reward_model_args,
    uses_generative_reward_model,
    with_reward_model,
)
from verl.trainer.config.config import CustomRewardFunctionConfig, RewardManagerConfig
from verl.trainer.config.loader import data_value
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import RewardModelConfig, SandboxFusionConfig
from verl.workers.reward_manager.reward_loop import load_reward_loop_class


def _effective(config):
    """`config` with its reward spellings resolved (verl.trainer.config.reward_migration): a config that did
    not come through the loader (composed by a caller) still holds the older keys' null defaults."""
    if "reward" not in config:
        return config
    from verl.trainer.config.reward_migration import resolve_reward_spellings

    return resolve_reward_spellings(copy.deepcopy(config))


def _section(config, key: str, cls: type):
    """The typed `cls` of the trainer config's section `key`, built once here; a config without the
    section (a partial one a caller composes) gets the class's defaults, which are the YAML's."""
    return omega_conf_to_dataclass(config.get(key), cls)


def get_custom_reward_fn(config) -> Callable | None:
    """The custom reward function of ``config.custom_reward_function``, or None if no path is set."""
    from verl.utils.import_utils import load_extern_object

    section = _section(_effective(config), "custom_reward_function", CustomRewardFunctionConfig)
    if not section.path:
        return None
    fn = load_extern_object(section.path, section.name, config_key="custom_reward_function")
    if not callable(fn):
        raise TypeError(
            f"custom_reward_function.name={section.name!r} in {section.path!r} is a {type(fn).__name__}, not a "
            "function; point it at a function compute_score(data_source, solution_str, ground_truth, extra_info=None)"
        )
    reward_kwargs = dict(section.reward_kwargs)
    return functools.partial(fn, **reward_kwargs) if reward_kwargs else fn


def _reward_manager_class(config) -> tuple[str, type]:
    """(name, class) of upstream's ``reward_manager`` section: the registered manager ``name`` (which
    follows ``reward_model.reward_manager``), or with ``source=importlib`` the class ``module.name`` of
    the file ``module.path``. A config without that section reads ``reward_model.reward_manager``."""
    from verl.workers.reward_manager import get_reward_manager_cls

    if "reward_manager" not in config:
        name = _section(config, "reward_model", RewardModelConfig).reward_manager
        return name, get_reward_manager_cls(name)
    section = _section(config, "reward_manager", RewardManagerConfig)
    if section.source == "importlib":
        from verl.utils.import_utils import load_extern_object

        module = section.module
        cls = load_extern_object(module.path, module.name, config_key="reward_manager.module")
        if not isinstance(cls, type):
            raise TypeError(
                f"reward_manager.module.name={module.name!r} in {module.path!r} is a {type(cls).__name__}, not a "
                "class; point it at a reward-manager class (verl.workers.reward_manager.AbstractRewardManager)"
            )
        return module.name, cls
    return section.name, get_reward_manager_cls(section.name)


class _ProcessSemaphore:
    """A bound on concurrent requests that survives pickling (to a Ray worker): each process gets its
    own `threading.Semaphore(value)` on first use, so the bound holds per scoring process."""

    def __init__(self, value: int):
        self.value = int(value)
        self._sem = None

    def __getstate__(self):
        return {"value": self.value, "_sem": None}

    def _get(self):
        import threading

        if self._sem is None:
            self._sem = threading.Semaphore(self.value)
        return self._sem

    def __enter__(self):
        return self._get().__enter__()

    def __exit__(self, *exc):
        return self._get().__exit__(*exc)


def _default_scorer(sandbox: SandboxFusionConfig) -> Callable | None:
    """The built-in scorer with the SandboxFusion service of `reward_model.sandbox_fusion` (its `url`,
    at most `max_concurrent` requests in flight per scoring process, `memory_limit_mb`), or None
    (the manager's own default) when no url is set. As upstream: only without a custom function."""
    if not sandbox.url:
        return None
    from verl.utils.reward_score import default_compute_score

    return functools.partial(
        default_compute_score,
        sandbox_fusion_url=sandbox.url,
        concurrent_semaphore=_ProcessSemaphore(sandbox.max_concurrent),
        memory_limit_mb=sandbox.memory_limit_mb,
    )


def _registered_reward_loop_class(config) -> type | None:
    """The reward-loop class (verl.experimental.reward_loop.reward_manager's registry) registered under the
    manager name the config gives, or None; only for `source=register` (the reward-loop classes score one
    sample per call and run through verl.workers.reward_manager.reward_loop)."""
    if "reward_manager" in config:
        section = _section(config, "reward_manager", RewardManagerConfig)
        if section.source != "register":
            return None
        name = section.name
    else:
        name = _section(config, "reward_model", RewardModelConfig).reward_manager
    from verl.experimental.reward_loop.reward_manager.registry import REWARD_LOOP_MANAGER_REGISTRY
    from verl.workers.reward_manager.reward_loop import check_reward_loop_class

    cls = REWARD_LOOP_MANAGER_REGISTRY.get(name)
    if cls is not None:
        check_reward_loop_class(cls, f"the reward loop class registered as {name!r}")
    return cls


def load_reward_manager(config, tokenizer, num_examine: int, **reward_kwargs):
    """The reward manager described by ``config`` (the full trainer config)."""
    config = _effective(config)
    reward_model = _section(config, "reward_model", RewardModelConfig)
    custom = _section(config, "custom_reward_function", CustomRewardFunctionConfig)
    # the custom reward file is imported first, as upstream does: it may register the manager it names
    # (`@register("collabllm")` beside its function, then reward_model.reward_manager=collabllm)
    compute_score = get_custom_reward_fn(config)
    generative = compute_score is not None and uses_generative_reward_model(config)
    plain_score = compute_score  # a reward-loop class passes the reward model to the function itself

    def as_reward_loop(loop_cls):  # a reward-loop class (one sample per run_single) run as the manager
        from verl.workers.reward_manager.reward_loop import RewardLoopManager

        on_error = {"on_error": custom.on_error} if custom.on_error != "raise" else {}
        return RewardLoopManager(
            loop_cls,
            config,
            tokenizer,
            num_examine,
            compute_score=plain_score,
            reward_model=reward_model_args(config) if generative else None,
            reward_fn_key=data_value(config.get("data"), "reward_fn_key"),
            **on_error,
        )

    if reward_model.reward_loop_source == "importlib":  # upstream's custom reward loop class
        return as_reward_loop(load_reward_loop_class(reward_model))
    if generative:  # upstream's reward loop: the function is handed the reward model (reward_router_address, ...)
        compute_score = with_reward_model(compute_score, config)
    try:
        name, manager_cls = _reward_manager_class(config)
    except ValueError as e:
        loop_cls = _registered_reward_loop_class(config)
        if loop_cls is not None:
            return as_reward_loop(loop_cls)
        if not custom.path:
            raise
        raise ValueError(
            f"{e}. custom_reward_function.path={custom.path!r} was imported before the look-up and registers no "
            "manager under that name (neither with verl.workers.reward_manager.register nor with the reward loop's "
            "verl.experimental.reward_loop.reward_manager.register)"
        ) from e
    kwargs = {**reward_model.reward_kwargs, **reward_kwargs}
    if custom.on_error != "raise":  # "raise" is every manager's default; leave the older spelling in charge
        kwargs.setdefault("on_error", custom.on_error)
    # `data` has no typed class (upstream keeps it a DictConfig): a partial config may leave out the two
    # keys read here, which then take the data YAML's values
    data = config.get("data")
    if name == "rate_limited":  # its limits are reward_model keys (upstream's manager reads them there)
        kwargs.setdefault("config", config)
    if name == "dapo":  # DAPO's overlong shaping reads two trainer keys, as upstream's recipe passes them
        kwargs.setdefault("max_resp_len", data_value(data, "max_response_length"))
        kwargs.setdefault("overlong_buffer_cfg", reward_model.overlong_buffer)
    try:
        return manager_cls(
            tokenizer=tokenizer,
            num_examine=num_examine,
            compute_score=compute_score or _default_scorer(reward_model.sandbox_fusion),
            reward_fn_key=data_value(data, "reward_fn_key"),
            **kwargs,
        )
    except TypeError as e:
        if kwargs and "unexpected keyword argument" in str(e):
            raise TypeError(
                f"reward manager {name!r} ({manager_cls.__name__}) does not take the options {sorted(kwargs)} "
                f"(from reward_model.reward_kwargs or the trainer): {e}"
            ) from e
        raise


def compute_reward(data, reward_fn) -> tuple:
    """Score a batch: ``(reward_tensor [B, R], reward_extra_info {name: list of B values})``."""
    result = reward_fn(data, return_dict=True)
    return result["reward_tensor"], result.get("reward_extra_info", {})


def __getattr__(name):
    if name == "compute_reward_async":
        import ray

        remote = ray.remote(num_cpus=1)(compute_reward)
        globals()[name] = remote
        return remote
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
