"""Config loading for the stand-alone entry points (`main_generation`, `main_eval`).

They take the same command lines as `main_ppo` (Hydra override grammar, `--config-path` /
`--config-name`) and go through the same loader (`verl.trainer.config.loader`), so a misspelled key
fails with the full dotted key and the closest valid one, and a user file may start from a bundled
config through a `defaults:` list. Only the bundled file differs: `generation.yaml` or
`evaluation.yaml` instead of `ppo_trainer.yaml`. The PPO schema validation does not apply; each
tool checks the few values it reads.
"""

from __future__ import annotations

import sys


def load_tool_config(config_name: str, argv: list[str] | None = None):
    """The resolved config of `verl/trainer/config/<config_name>.yaml` plus the overrides in `argv`.

    A config mistake prints one message and exits with status 2, as `main_ppo` does.
    """
    from verl.trainer.config import ConfigError, load_ppo_config, parse_cli_args

    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(arg.partition("=")[0] in ("--config-name", "-cn") for arg in argv):
        argv.append(f"--config-name={config_name}")  # the bundled default, or the same name beside --config-path
    try:
        config_path, overrides = parse_cli_args(argv)
        return load_ppo_config(overrides, config_path, validate=False)
    except ConfigError as e:
        print(f"verl: invalid configuration\n{e}", file=sys.stderr)
        raise SystemExit(2) from None
