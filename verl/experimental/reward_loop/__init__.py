"""Upstream's reward-loop package path.

- `RewardLoopManager`, `RewardLoopWorker` (reward_loop.py): a batch's rewards scored sample by sample in
  Ray actors with a reward-loop class, or by the reward model (`compute_rm_score(data)` -> `rm_scores`).
- `reward_manager`: the reward-loop classes and their registry (`register`, `get_reward_manager_cls`;
  built in: naive, dapo, remote, rate_limited) and their base `RewardManagerBase`. A custom class also runs
  as the driver's reward manager (verl.workers.reward_manager.reward_loop).
- `RewardModelManager` (reward_model.py): a generative reward model served to the custom reward function
  (`reward_model.enable` with `custom_reward_function.path`), reached through `reward_router_address`.
- `migrate_legacy_reward_impl(config)`: upstream v0.9's copy of the older reward keys onto `reward.*`.
- `generation_server`: the HTTP server each of its replicas runs (SGLang's `/generate`, OpenAI's chat and
  completions APIs), also a command: `python -m verl.experimental.reward_loop.generation_server --model DIR`.

The three classes are imported on first use: `reward_loop.py` needs Ray and the trainer's reward module,
which itself imports `reward_model.py` from this package.
"""

import importlib

__all__ = ["RewardLoopManager", "RewardLoopWorker", "RewardModelManager", "migrate_legacy_reward_impl"]

_HOMES = {
    "RewardLoopManager": "verl.experimental.reward_loop.reward_loop",
    "RewardLoopWorker": "verl.experimental.reward_loop.reward_loop",
    "RewardModelManager": "verl.experimental.reward_loop.reward_model",
    # upstream v0.9's migration of the older reward keys onto `reward.*` (defined with the config loader's)
    "migrate_legacy_reward_impl": "verl.trainer.config.reward_migration",
}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
