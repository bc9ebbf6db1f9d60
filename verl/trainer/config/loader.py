"""Load `ppo_trainer.yaml` plus command-line style overrides, without Hydra's CLI.

Design decisions:
- Overrides use Hydra's own grammar (`key=value`, `+key=value`, `++key=value`, `~key`; values
  parsed exactly as `python -m verl.trainer.main_ppo key=value` parses them), but are applied here
  so that a misspelled key fails with the full dotted key and the closest valid key, rather than
  Hydra's bare "not in struct" message.
- A config file with a `defaults:` list (a recipe that starts from `ppo_trainer` and changes a few
  keys) is composed the simple way: each listed config is looked up beside the file, then among
  the bundled configs, and merged in order, `_self_` marking where the file's own keys go.
  Config-group entries (`- group@pkg: option`) are not supported and say so.
- The returned config is resolved (interpolations and the `verl_asset`/`verl_cache` resolvers
  evaluated), so it can be pickled to Ray workers that never import this package, and it is in
  struct mode like Hydra's: reading a key that does not exist raises.
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from verl.trainer.config.errors import ConfigError, did_you_mean

CONFIG_DIR = Path(__file__).resolve().parent
DEFAULT_CONFIG_NAME = "ppo_trainer"
ASSETS_DIR = CONFIG_DIR.parent.parent / "assets"


def cache_dir() -> Path:
    """`$VERL_CACHE_DIR`, else `~/.cache/verl` (generated data sets live here)."""
    return Path(os.path.expanduser(os.environ.get("VERL_CACHE_DIR") or "~/.cache/verl")).resolve()


def _asset_path(name: str) -> str:
    return str(ASSETS_DIR / name)


def _cache_path(rel: str) -> str:
    return str(cache_dir() / rel)


def register_resolvers() -> None:
    """Register `${verl_asset:NAME}` and `${verl_cache:REL}` (idempotent)."""
    OmegaConf.register_new_resolver("verl_asset", _asset_path, replace=True)
    OmegaConf.register_new_resolver("verl_cache", _cache_path, replace=True)


register_resolvers()


# --------------------------------------------------------------------------------- composition


def _find_config(name: str, search: list[Path]) -> Path:
    for directory in search:
        for candidate in (directory / f"{name}.yaml", directory / name):
            if candidate.is_file():
                return candidate
    raise ConfigError(
        f"config {name!r} listed in a defaults list was not found in {[str(d) for d in search]}; "
        "name a YAML file (without .yaml) that sits beside the including file or among verl's bundled configs"
    )


def _compose_file(path: Path, seen: tuple[Path, ...] = ()) -> DictConfig:
    if path in seen:
        raise ConfigError(f"config {path} includes itself through its defaults list {[str(p) for p in seen]}")
    cfg = OmegaConf.load(path)
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path} must hold a mapping at top level, found {type(cfg).__name__}")
    defaults = cfg.pop("defaults", None)
    cfg.pop("hydra", None)  # Hydra's own settings (searchpath, run dir) mean nothing here
    if defaults is None:
        return cfg
    search = [path.parent, CONFIG_DIR]
    parts: list[DictConfig] = []
    self_seen = False
    for entry in defaults:
        if entry == "_self_":
            parts.append(cfg)
            self_seen = True
        elif isinstance(entry, str):
            parts.append(_compose_file(_find_config(entry, search), (*seen, path)))
        else:
            raise ConfigError(
                f"{path}: defaults entry {OmegaConf.to_container(entry) if isinstance(entry, DictConfig) else entry!r} "
                "selects a config group, which verl's loader does not support; list plain config names "
                "(e.g. `- ppo_trainer` then `- _self_`) or run through Hydra's CLI"
            )
    if not self_seen:  # Hydra's rule: without `_self_`, the file's own keys come last
        parts.append(cfg)
    return OmegaConf.merge(*parts)


def _base_config(config_path: str | os.PathLike | None) -> DictConfig:
    if config_path is None:
        path = CONFIG_DIR / f"{DEFAULT_CONFIG_NAME}.yaml"
    else:
        path = Path(config_path).expanduser()
        if path.is_dir():
            path = path / f"{DEFAULT_CONFIG_NAME}.yaml"
        if not path.is_file():
            raise ConfigError(
                f"config file {str(path)!r} does not exist; pass a YAML file or a directory holding ppo_trainer.yaml"
            )
    return _compose_file(path.resolve())


# ------------------------------------------------------------------------------------ overrides


def _all_keys(cfg, prefix: str = "") -> list[str]:
    keys = []
    for k in cfg:
        full = f"{prefix}{k}"
        keys.append(full)
        v = cfg._get_node(k)
        if isinstance(v, DictConfig) and not v._is_missing() and not v._is_none():
            keys.extend(_all_keys(v, full + "."))
    return keys


def _has_key(cfg: DictConfig, key: str) -> bool:
    """Whether dotted `key` exists, without resolving anything (a ??? value still exists)."""
    node = cfg
    for part in key.split("."):
        # `.keys()` on purpose: `in` on a DictConfig reports a ??? value as absent
        if not isinstance(node, DictConfig) or node._is_none() or part not in node.keys():  # noqa: SIM118
            return False
        node = node._get_node(part)
    return True


def _missing_key_error(cfg: DictConfig, key: str, override: str) -> ConfigError:
    parts = key.split(".")
    node = cfg
    for i, part in enumerate(parts):
        if isinstance(node, DictConfig) and not node._is_none() and part in node.keys():  # noqa: SIM118
            node = node._get_node(part)
            continue
        parent = ".".join(parts[:i])
        if not isinstance(node, DictConfig):
            return ConfigError(
                f"override {override!r}: {parent} is a value, not a section, so it has no key {part!r}; "
                f"set {parent}=... directly"
            )
        siblings = [str(k) for k in node]
        hint = did_you_mean(
            part, siblings, prefix=f"{parent}." if parent else "", all_keys=_all_keys(cfg), full_key=key
        )
        return ConfigError(
            f"override {override!r}: unknown config key {key!r} (no {part!r} under "
            f"{parent or 'the top level'}).{hint} To add a new key on purpose write +{key}=..."
        )
    raise AssertionError(f"{key} exists")  # only called for keys that are absent


def apply_overrides(cfg: DictConfig, overrides: list[str]) -> None:
    """Apply Hydra-grammar overrides to `cfg` in place."""
    if not overrides:
        return
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for text in overrides:
        try:
            (ov,) = parser.parse_overrides([text])
        except HydraException as e:
            raise ConfigError(
                f"cannot parse override {text!r}: {e}; write key=value, e.g. data.train_batch_size=64"
            ) from e
        key = ov.key_or_group
        if key.startswith("hydra.") or key == "hydra":
            continue  # Hydra's own settings (run dir, job logging) have no meaning here
        if ov.package is not None or ov.is_sweep_override():
            raise ConfigError(
                f"override {text!r}: config-group and sweep overrides are not supported; set one value per key"
            )
        exists = _has_key(cfg, key)
        if ov.is_delete():
            if not exists:
                raise _missing_key_error(cfg, key, text)
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(cfg, parent) if parent else cfg
            with _unlocked(cfg):
                del node[leaf]
            continue
        if ov.is_add() and exists:
            raise ConfigError(
                f"override {text!r}: {key} already exists, so it cannot be added; write {key}=... (or ++{key}=...)"
            )
        if not (ov.is_add() or ov.is_force_add()) and not exists:
            raise _missing_key_error(cfg, key, text)
        value = ov.value()
        with _unlocked(cfg):
            OmegaConf.update(cfg, key, value, merge=True, force_add=True)


_ABSENT = object()


class _unlocked:
    """Temporarily lift struct mode so overrides may add keys."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.was_struct = OmegaConf.is_struct(cfg)

    def __enter__(self):
        OmegaConf.set_struct(self.cfg, False)

    def __exit__(self, *exc):
        OmegaConf.set_struct(self.cfg, self.was_struct)


# --------------------------------------------------------------------------------------- public


def resolve(cfg: DictConfig) -> DictConfig:
    """Evaluate every interpolation in place, turning resolver failures into a ConfigError."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigError(
            f"config key {key} could not be resolved: {getattr(e, 'msg', e)}; "
            "check the ${...} interpolation it uses (the key it points at must exist)"
        ) from e
    return cfg


def load_ppo_config(
    overrides: list[str] | None = None,
    config_path: str | os.PathLike | None = None,
    *,
    validate: bool = True,
) -> DictConfig:
    """The PPO config: `config_path` (default: the bundled ppo_trainer.yaml) + `overrides`.

    Returns a resolved DictConfig in struct mode; validated with `validate_ppo_config` unless
    `validate=False`.
    """
    cfg = _base_config(config_path)
    apply_overrides(cfg, list(overrides or []))
    if validate:  # before resolving, so errors name the key a bad value was written to
        from verl.trainer.config.validate import validate_ppo_config

        validate_ppo_config(cfg)
    resolve(cfg)
    OmegaConf.set_struct(cfg, True)
    return cfg


def parse_cli_args(argv: list[str]) -> tuple[str | None, list[str]]:
    """Split `main_ppo`'s argv into (config file, overrides).

    Understands Hydra's `--config-path/-cp DIR` and `--config-name/-cn NAME` (both forms,
    `--opt=value` and `--opt value`); everything else is an override.
    """
    config_dir = config_name = None
    overrides: list[str] = []
    it = iter(argv)
    for arg in it:
        opt, eq, val = arg.partition("=")
        if opt in ("--config-path", "-cp", "--config-name", "-cn"):
            if not eq:
                val = next(it, None)
                if val is None:
                    raise ConfigError(f"{opt} needs a value, e.g. {opt}=my_config")
            if opt in ("--config-path", "-cp"):
                config_dir = val
            else:
                config_name = val
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option {arg!r}; pass --config-path/--config-name or key=value overrides")
        else:
            overrides.append(arg)
    if config_dir is None and config_name is None:
        return None, overrides
    directory = Path(config_dir).expanduser() if config_dir else CONFIG_DIR
    name = config_name or DEFAULT_CONFIG_NAME
    if not name.endswith(".yaml"):
        name += ".yaml"
    return str(directory / name), overrides


def save_resolved_config(cfg: DictConfig, run_dir: str | os.PathLike) -> Path:
    """Write the fully resolved config to `<run_dir>/config.yaml` and return that path."""
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.yaml"
    container = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig | ListConfig) else cfg
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(container)))
    return path


def ray_init_kwargs(cfg: DictConfig) -> dict:
    """Keyword arguments for `ray.init`: `ray_kwargs.ray_init`, overlaid by non-null legacy `ray_init` keys."""
    kwargs = dict(OmegaConf.to_container(cfg.ray_kwargs.ray_init, resolve=True))
    legacy = OmegaConf.to_container(cfg.get("ray_init") or {}, resolve=True)
    kwargs.update({k: v for k, v in legacy.items() if k != "timeline_json_file" and v is not None})
    return {k: v for k, v in kwargs.items() if v is not None}
