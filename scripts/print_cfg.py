"""Print the composed PPO trainer config, with upstream verl's script name and command line.

    python scripts/print_cfg.py [key=value ...] [--config-name NAME] [Hydra's other flags]

Composes `ppo_trainer` (or `--config-name`) from verl/trainer/config with the overrides, as
`python -m verl.trainer.main_ppo` would, prints it, then prints the critic's profiler section built
into its typed class (`ProfilerConfig`), which shows a section's `_target_` resolving.

This prints the config only; `python -m verl.trainer.main_ppo ... --cfg job` also runs every check
the trainer runs before it starts.
"""

import sys
from pathlib import Path

# The repository this script lives in: its config directory is composed, so its code is imported
# (not another installed copy of verl).
REPO = Path(__file__).resolve().parent.parent
if (REPO / "verl" / "__init__.py").is_file():
    sys.path.insert(0, str(REPO))

try:
    import hydra
except ImportError as e:
    raise ImportError("print_cfg.py needs hydra-core: pip install hydra-core") from e


@hydra.main(config_path=str(REPO / "verl" / "trainer" / "config"), config_name="ppo_trainer", version_base=None)
def main(config) -> None:
    """Print the composed config, then the critic's profiler section as its dataclass."""
    from verl.utils.config import omega_conf_to_dataclass

    print(config)
    print(omega_conf_to_dataclass(config.critic.profiler))


if __name__ == "__main__":
    main()
