"""PPO/GRPO trainer configuration: the YAML defaults, their typed schema, loading and validation.

    from verl.trainer.config import load_ppo_config
    cfg = load_ppo_config(["data.train_batch_size=64", "trainer.logger=[console,mlflow]"])

`ppo_trainer.yaml` and `ppo_megatron_trainer.yaml` hold upstream verl's keys and defaults, composed
from the same config groups; they load with plain Hydra/OmegaConf. The bundled demo
(`config_name="arith_demo"`) uses the `${verl_asset:NAME}` and `${verl_cache:REL}` resolvers that
importing this package registers.
"""

from verl.trainer.config.algorithm import (
    AlgoConfig,
    FilterGroupsConfig,
    KLControlConfig,
    RolloutCorrectionConfig,
)
from verl.trainer.config.config import CheckpointConfig, CustomRewardFunctionConfig, ModuleConfig, RewardManagerConfig
from verl.trainer.config.errors import ConfigError, ConfigWarning
from verl.trainer.config.loader import (
    CONFIG_DIR,
    DEMO_CONFIG_NAME,
    CommandLine,
    apply_overrides,
    cache_dir,
    compose_config,
    load_ppo_config,
    parse_cli_args,
    parse_command_line,
    ray_init_kwargs,
    register_resolvers,
    save_resolved_config,
)
from verl.trainer.config.schema import PPOConfig
from verl.trainer.config.validate import (
    check_machine,
    need_critic,
    need_reference_policy,
    validate_ppo_config,
    world_size,
)

__all__ = [
    "AlgoConfig",
    "CONFIG_DIR",
    "CheckpointConfig",
    "CustomRewardFunctionConfig",
    "ModuleConfig",
    "RewardManagerConfig",
    "DEMO_CONFIG_NAME",
    "CommandLine",
    "check_machine",
    "compose_config",
    "parse_command_line",
    "ConfigError",
    "ConfigWarning",
    "FilterGroupsConfig",
    "KLControlConfig",
    "RolloutCorrectionConfig",
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
