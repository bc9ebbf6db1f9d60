"""PPO/GRPO trainer configuration: the YAML defaults, their typed schema, loading and validation.

    from verl.trainer.config import load_ppo_config
    cfg = load_ppo_config(["data.train_batch_size=64", "trainer.logger=[console,mlflow]"])

Importing this package registers the `${verl_asset:NAME}` and `${verl_cache:REL}` resolvers used
by `ppo_trainer.yaml`, so Hydra's CLI (`@hydra.main(config_path="config",
config_name="ppo_trainer")`) resolves them too once this package is imported.
"""

from verl.trainer.config.errors import ConfigError, ConfigWarning
from verl.trainer.config.loader import (
    CONFIG_DIR,
    apply_overrides,
    cache_dir,
    load_ppo_config,
    parse_cli_args,
    ray_init_kwargs,
    register_resolvers,
    save_resolved_config,
)
from verl.trainer.config.schema import PPOConfig
from verl.trainer.config.validate import need_critic, need_reference_policy, validate_ppo_config, world_size

__all__ = [
    "CONFIG_DIR",
    "ConfigError",
    "ConfigWarning",
    "PPOConfig",
    "apply_overrides",
    "cache_dir",
    "load_ppo_config",
    "need_critic",
    "need_reference_policy",
    "parse_cli_args",
    "ray_init_kwargs",
    "register_resolvers",
    "save_resolved_config",
    "validate_ppo_config",
    "world_size",
]
