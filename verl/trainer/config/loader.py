"""Compose `ppo_trainer.yaml` (or a user config built on it) with Hydra, then apply overrides.

Design decisions:
- Composition is Hydra's own (its config loader, without `@hydra.main`'s global state), so config
  groups, `defaults:` lists with `group@package: option` entries, `override` entries, `_self_` and
  `hydra.searchpath` mean exactly what they mean upstream. verl's config directory is always on
  the search path, so a user config anywhere may start with `defaults: [ppo_trainer, _self_]`.
- The bundled YAML files use no custom resolver (only OmegaConf's `oc.select`): they load with
  plain Hydra or OmegaConf without importing verl. The demo's `demo/arith.yaml` is the exception:
  `${verl_asset:NAME}` and `${verl_cache:REL}` (registered on import of this package) point it at
  the bundled model and the generated data.
- Value overrides use Hydra's grammar (`key=value`, `+key=value`, `++key=value`, `~key`, parsed
  exactly as Hydra parses them) but are applied here, so that a misspelled key fails with the
  full dotted key and the closest valid key rather than Hydra's bare "not in struct" message.
  Config-group overrides (`actor@actor_rollout_ref.actor=megatron_actor`) go to Hydra.
- `--config-path` is resolved as Hydra resolves it for `python -m verl.trainer.main_ppo`: an
  absolute path as is, a relative one against the directory of main_ppo.py (so upstream's
  `--config-path=config` is verl/trainer/config). A relative path that does not exist there but
  does exist under the working directory is taken from there (Hydra would fail).
- The returned config is resolved (interpolations and the resolvers evaluated), so it can be
  pickled to Ray workers that never import this package, and it is in struct mode like Hydra's:
  reading a key that does not exist raises.
- `data_value` reads one key of the `data` section, which stays a DictConfig (upstream's too): a
  caller's partial `data` mapping that leaves the key out gets the data YAML's value, so code that
  reads `data` never repeats a default beside the YAML.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
import warnings
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from verl.trainer.config.errors import ConfigError, ConfigWarning, did_you_mean
from verl.trainer.config.interpolation import resolve

CONFIG_DIR = Path(__file__).resolve().parent
DEFAULT_CONFIG_NAME = "ppo_trainer"
DEMO_CONFIG_NAME = "arith_demo"
ASSETS_DIR = CONFIG_DIR.parent.parent / "assets"
# Hydra reads a relative --config-path against the directory of the @hydra.main module (main_ppo.py).
ENTRY_DIR = CONFIG_DIR.parent


def cache_dir() -> Path:
    """`$VERL_CACHE_DIR`, else `~/.cache/verl` (generated data sets live here)."""
    return Path(os.path.expanduser(os.environ.get("VERL_CACHE_DIR") or "~/.cache/verl")).resolve()


def _asset_path(name: str) -> str:
    return str(ASSETS_DIR / name)


def _cache_path(rel: str) -> str:
    return str(cache_dir() / rel)


def register_resolvers() -> None:
    """Register `${verl_asset:NAME}`, `${verl_cache:REL}` and `${verl_cpu_workers:...}` (idempotent;
    the last is `verl.utils.cpu_layout.resolve_cpu_workers`, cached so a run asks once)."""
    from verl.utils.cpu_layout import resolve_cpu_workers

    OmegaConf.register_new_resolver("verl_asset", _asset_path, replace=True)
    OmegaConf.register_new_resolver("verl_cache", _cache_path, replace=True)
    OmegaConf.register_new_resolver("verl_cpu_workers", resolve_cpu_workers, replace=True, use_cache=True)


register_resolvers()


# --------------------------------------------------------------------------------- composition


def resolve_config_dir(
    config_path: str | os.PathLike | None, entry_dir: Path = ENTRY_DIR, default_dir: Path = CONFIG_DIR
) -> Path:
    """The directory a `--config-path` names, as Hydra reads it for `python -m verl.trainer.main_ppo`
    (or for the entry point whose module lives in `entry_dir` and whose own configs are `default_dir`)."""
    if config_path is None:
        return default_dir
    text = str(config_path)
    if text.startswith("pkg://"):
        package = text[len("pkg://") :].strip("/").replace("/", ".")
        import importlib.util

        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(f"--config-path={text}: package {package!r} cannot be imported")
        return Path(list(spec.submodule_search_locations)[0])
    if text.startswith("file://"):
        text = text[len("file://") :]
    path = Path(text).expanduser()
    if path.is_absolute():
        candidates = [path]
    else:
        candidates = [entry_dir / path, Path.cwd() / path]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate.resolve()
    raise ConfigError(
        f"--config-path={config_path}: no such directory (looked in {', '.join(str(c) for c in candidates)}); "
        f"a relative --config-path is read against {entry_dir.relative_to(ENTRY_DIR.parent.parent)}/, as Hydra "
        "reads it for the entry point's module, then against the working directory"
    )


def _config_name(name: str | None, default: str = DEFAULT_CONFIG_NAME) -> str:
    name = name or default
    return name[: -len(".yaml")] if name.endswith(".yaml") else name


def _split_file(config_path: str | os.PathLike) -> tuple[Path, str]:
    """A YAML file given as `config_path`: (its directory, its config name)."""
    path = Path(config_path).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"config file {str(path)!r} does not exist; pass a YAML file, or a directory and a config name"
        )
    return path.resolve().parent, path.stem


def _user_searchpath(config_dir: Path, name: str) -> list[str]:
    """`hydra.searchpath` entries of the primary config file (kept: verl's directory is appended to them)."""
    path = config_dir / f"{name}.yaml"
    if not path.is_file():
        return []
    try:
        raw = OmegaConf.load(path)
    except Exception:  # Hydra reports a malformed file with its own message below
        return []
    entries = OmegaConf.select(raw, "hydra.searchpath", default=None) if isinstance(raw, DictConfig) else None
    if not isinstance(entries, ListConfig):
        return []
    # upstream's configs name its checkout's copy (`file://verl/trainer/config`, relative to where
    # upstream's scripts run); verl's own directory is searched anyway, so it is left out rather than
    # warned about by Hydra when the working directory is elsewhere
    return [str(e) for e in entries if not str(e).rstrip("/").endswith("verl/trainer/config")]


def compose(
    config_name: str | None = None, config_dir: str | os.PathLike | None = None, group_overrides: list[str] = ()
) -> DictConfig:
    """Hydra's composition of `config_name` from `config_dir` (default: verl's config directory),
    with verl's config directory on the search path; the `hydra` node removed. A copy of a cached
    composition: Hydra takes about half a second per call, and tests compose the same configs often."""
    directory = Path(config_dir).resolve() if config_dir is not None else CONFIG_DIR
    name = _config_name(config_name)
    primary = directory / f"{name}.yaml"
    stamp = primary.stat().st_mtime_ns if primary.is_file() else None  # a rewritten user file is read again
    return pickle.loads(_compose(name, str(directory), tuple(group_overrides), stamp))


@functools.lru_cache(maxsize=64)
def _compose(name: str, config_dir: str, group_overrides: tuple, stamp) -> bytes:
    """The composition, pickled (unpickling is the fastest copy of a DictConfig)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.errors import HydraException
    from hydra.types import RunMode

    directory = Path(config_dir)
    searchpath = [*_user_searchpath(directory, name), f"file://{CONFIG_DIR}"]
    listed = ",".join(f"'{entry}'" for entry in searchpath)
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(directory)))
    try:
        cfg = loader.load_configuration(
            config_name=name, overrides=[f"hydra.searchpath=[{listed}]", *group_overrides], run_mode=RunMode.RUN
        )
    except HydraException as e:
        raise ConfigError(
            f"cannot compose config {name!r} from {directory}: {e}. The config name is a YAML file (without "
            f".yaml) in --config-path; its defaults list may name verl's configs ({DEFAULT_CONFIG_NAME}, "
            f"ppo_megatron_trainer, {DEMO_CONFIG_NAME}) and their config groups"
        ) from e
    with _unlocked(cfg):
        cfg.pop("hydra", None)
    return pickle.dumps(cfg)


def _base_config(
    config_path: str | os.PathLike | None, config_name: str | None = None, group_overrides=()
) -> DictConfig:
    if config_path is not None and Path(config_path).expanduser().suffix in (".yaml", ".yml"):
        if config_name is not None:
            raise ConfigError(f"config_path={config_path} is a file, so config_name={config_name} cannot apply")
        directory, name = _split_file(config_path)
    else:
        directory, name = resolve_config_dir(config_path), config_name
    return compose(name, directory, list(group_overrides))


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


@functools.lru_cache(maxsize=4096)
def _parse(text: str):
    """Hydra's parse of one override (cached: the same command line is read twice, by split and apply)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        (ov,) = OverridesParser.create().parse_overrides([text])
    except HydraException as e:
        raise ConfigError(f"cannot parse override {text!r}: {e}; write key=value, e.g. data.train_batch_size=64") from e
    return ov


def _is_group_override(ov) -> bool:
    """`group@package=option` or `group/sub=option`: a choice among a config group's files (Hydra's job)."""
    key = ov.key_or_group
    if ov.package is not None or "/" in key:
        return True
    if ov.is_delete() or ov.is_sweep_override() or not (CONFIG_DIR / key).is_dir():
        return False
    value = ov.value()
    return isinstance(value, str) and (CONFIG_DIR / key / f"{value}.yaml").is_file()


def split_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(config-group overrides for Hydra's composition, value overrides for `apply_overrides`)."""
    groups, values = [], []
    for text in overrides:
        (groups if _is_group_override(_parse(text)) else values).append(text)
    return groups, values


# keys older upstream configs declared and v0.9.0 dropped to an empty `{}`: old scripts set them without `+`
_LEGACY_OPEN_KEYS = (
    "actor_rollout_ref.model.override_config.model_config",
    "actor_rollout_ref.model.override_config.moe_config",
)


def apply_overrides(cfg: DictConfig, overrides: list[str]) -> None:
    """Apply Hydra-grammar value overrides to `cfg` in place."""
    for text in overrides or []:
        ov = _parse(text)
        key = ov.key_or_group
        if key.startswith("hydra.") or key == "hydra":
            continue  # Hydra's own settings (run dir, job logging) have no meaning here
        if ov.is_sweep_override():
            raise ConfigError(f"override {text!r}: sweeps (multirun) are not supported; set one value per key")
        if _is_group_override(ov):
            raise ConfigError(
                f"override {text!r} selects a config group option, which only applies while composing; pass it "
                "on the command line or to load_ppo_config"
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
        value = ov.value()
        if ov.is_add() and exists and not _appendable(cfg, key, value):
            raise ConfigError(
                f"override {text!r}: {key} already exists, so it cannot be added; write {key}=... (or ++{key}=...)"
            )
        if not (ov.is_add() or ov.is_force_add() or exists or key.startswith(_LEGACY_OPEN_KEYS)):
            raise _missing_key_error(cfg, key, text)
        with _unlocked(cfg):
            OmegaConf.update(cfg, key, value, merge=True, force_add=True)


def _appendable(cfg: DictConfig, key: str, value) -> bool:
    """Whether `+key=value` may set a key that exists: Hydra allows it when the key holds null or the
    value is a dict or list (merged in); here also when the key holds an interpolation, i.e. a
    default that follows another key (`rollout.prompt_length`, which follows `data.max_prompt_length`)."""
    if isinstance(value, dict | list):
        return True
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    child = node._get_node(leaf)
    return child._is_none() or child._is_interpolation()


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


def _resolve_critic_fsdp_spelling(cfg: DictConfig) -> None:
    """The FSDP critic's engine keys under both spellings, `critic.fsdp` (upstream v0.9) and v0.7's
    `critic.model.fsdp_config`, hold the effective values (the rule of
    `verl.workers.config.critic.merge_legacy_fsdp_config`), so the saved and printed config says what runs."""
    from verl.workers.config.critic import merge_legacy_fsdp_config

    critic = cfg.get("critic")
    model = critic.get("model") if critic is not None else None
    if critic is None or critic.get("fsdp") is None or model is None or model.get("fsdp_config") is None:
        return
    try:
        adopt = merge_legacy_fsdp_config(model.fsdp_config, critic.fsdp)
    except ValueError as e:
        raise ConfigError(f"invalid config: {e}", [str(e)]) from None
    for key in adopt:
        warnings.warn(
            f"critic.model.fsdp_config.{key} is upstream's spelling before v0.9; it is read as critic.fsdp.{key} "
            f"(write critic.fsdp.{key})",
            ConfigWarning,
            stacklevel=3,
        )
    with _unlocked(cfg):
        for key, value in adopt.items():
            critic.fsdp[key] = value
        for key in critic.fsdp:
            if key != "_target_" and key in model.fsdp_config:
                model.fsdp_config[key] = critic.fsdp[key]


_SAPO_TAU_DEFAULTS = {"tau_pos": 1.0, "tau_neg": 1.05}


def _move_policy_loss_taus(cfg: DictConfig) -> None:
    """`+actor_rollout_ref.actor.policy_loss.tau_pos/tau_neg` (upstream v0.9's SAPO example scripts) are read
    as the actor's `tau_pos/tau_neg`, SAPO's temperatures (upstream's loss reads only the actor's and ignores
    these); the actor's own key set to another value is refused."""
    actor = OmegaConf.select(cfg, "actor_rollout_ref.actor")
    loss = actor.get("policy_loss") if actor is not None else None
    if loss is None or not any(key in loss for key in _SAPO_TAU_DEFAULTS):
        return
    with _unlocked(cfg):
        for key, default in _SAPO_TAU_DEFAULTS.items():
            if key not in loss:
                continue
            value, own = loss[key], actor.get(key, default)
            if own not in (default, value):
                raise ConfigError(
                    f"invalid config: actor_rollout_ref.actor.policy_loss.{key}={value} and "
                    f"actor_rollout_ref.actor.{key}={own} disagree; set only actor_rollout_ref.actor.{key}"
                )
            warnings.warn(
                f"actor_rollout_ref.actor.policy_loss.{key}={value} is read as actor_rollout_ref.actor.{key} (SAPO's "
                f"temperature; upstream's loss reads only that one and would ignore this key): write "
                f"actor_rollout_ref.actor.{key}",
                ConfigWarning,
                stacklevel=3,
            )
            actor[key] = value
            del loss[key]


def _refuse_engines_not_in_this_build(overrides: list[str]) -> None:
    """`model_engine=veomni` (or torchtitan, mindspeed, ...) selects an engine this build does not have:
    one line saying so, before that engine's own keys (`actor.veomni.*`) fail one by one as unknown."""
    from verl.trainer.config.schema import MODEL_ENGINES, MODEL_ENGINES_NOT_IN_THIS_BUILD

    for text in overrides:
        key, sep, value = str(text).lstrip("+~").partition("=")
        if key != "model_engine" or not sep or value in MODEL_ENGINES:
            continue
        what = MODEL_ENGINES_NOT_IN_THIS_BUILD.get(value, f"an engine named {value!r}")
        raise ConfigError(
            f"invalid config: model_engine={value} is for {what}, which this build of verl does not have; use "
            f"model_engine={' or model_engine='.join(MODEL_ENGINES)} (FSDP or Megatron-core)",
            [f"model_engine={value} is for {what}, which this build of verl does not have"],
        )


def compose_config(
    overrides: list[str] | None = None,
    config_path: str | os.PathLike | None = None,
    *,
    config_name: str | None = None,
) -> DictConfig:
    """The composed config with `overrides` applied, unresolved and unvalidated (what `--cfg job` prints)."""
    _refuse_engines_not_in_this_build(overrides or [])
    groups, values = split_overrides(list(overrides or []))
    cfg = _base_config(config_path, config_name, groups)
    apply_overrides(cfg, values)
    return cfg


def load_ppo_config(
    overrides: list[str] | None = None,
    config_path: str | os.PathLike | None = None,
    *,
    config_name: str | None = None,
    validate: bool = True,
    translate=None,
) -> DictConfig:
    """The PPO config: `config_name` (default ppo_trainer) composed from `config_path` + `overrides`.

    `config_path` is a directory (as `--config-path`; default verl's config directory) or a YAML
    file (then `config_name` is its name). `translate(cfg)`, when given, rewrites the composed config in
    place first (an entry point's config in this trainer's keys, `async_recipes`). Returns a resolved
    DictConfig in struct mode, validated with `validate_ppo_config` unless `validate=False`.
    """
    cfg = compose_config(overrides, config_path, config_name=config_name)
    if translate is not None:
        translate(cfg)
    # one effective reward config under both spellings (reward.* and v0.7's), before the checks read it
    from verl.trainer.config.reward_migration import resolve_reward_spellings

    resolve_reward_spellings(cfg)
    _resolve_critic_fsdp_spelling(cfg)
    _move_policy_loss_taus(cfg)
    if validate:  # before resolving, so errors name the key a bad value was written to
        from verl.trainer.config.validate import validate_ppo_config

        validate_ppo_config(cfg)
    resolve(cfg)
    OmegaConf.set_struct(cfg, True)
    return cfg


@dataclasses.dataclass
class CommandLine:
    """`main_ppo`'s argv: Hydra's options and the overrides."""

    config_dir: Path
    config_name: str
    overrides: list[str]
    cfg: str | None = None
    """`--cfg job|all`: print the composed config (and check it) instead of training."""
    resolve: bool = False
    """`--resolve`: print it with interpolations resolved."""

    @property
    def config_file(self) -> str:
        return str(self.config_dir / f"{self.config_name}.yaml")


def parse_command_line(
    argv: list[str],
    *,
    entry_dir: Path = ENTRY_DIR,
    default_dir: Path = CONFIG_DIR,
    default_name: str = DEFAULT_CONFIG_NAME,
) -> CommandLine:
    """Hydra's `--config-path/-cp DIR`, `--config-name/-cn NAME`, `--config-dir/-cd DIR` (a search
    directory: taken as the config directory here), `--cfg/-c job|all` and `--resolve`, both as
    `--opt=value` and `--opt value`; everything else is an override.

    entry_dir / default_dir / default_name: the entry point's `@hydra.main(config_path, config_name)`
    (default main_ppo's: verl/trainer, its config/ and ppo_trainer); a relative `--config-path` is read
    against entry_dir."""
    options = {
        "--config-path": "path", "-cp": "path", "--config-name": "name", "-cn": "name",
        "--config-dir": "dir", "-cd": "dir", "--cfg": "cfg", "-c": "cfg",
    }  # fmt: skip
    found: dict[str, str] = {}
    overrides: list[str] = []
    resolve_flag = False
    it = iter(argv)
    for arg in it:
        opt, eq, val = arg.partition("=")
        if opt in options:
            if not eq:
                val = next(it, None)
                if val is None:
                    raise ConfigError(f"{opt} needs a value, e.g. {opt}=my_config")
            found[options[opt]] = val
        elif arg == "--resolve":
            resolve_flag = True
        elif arg.startswith("-"):
            raise ConfigError(
                f"unknown option {arg!r}; main_ppo takes --config-path/--config-name, --cfg job and key=value overrides"
            )
        else:
            overrides.append(arg)
    cfg_mode = found.get("cfg")
    if cfg_mode is not None and cfg_mode not in ("job", "all"):
        raise ConfigError(
            f"--cfg {cfg_mode}: only `--cfg job` (the composed config; `all` is the same here, there is no "
            "Hydra job config) is available"
        )
    directory = resolve_config_dir(found.get("path") or found.get("dir"), entry_dir, default_dir)
    return CommandLine(directory, _config_name(found.get("name"), default_name), overrides, cfg_mode, resolve_flag)


def parse_cli_args(argv: list[str]) -> tuple[str | None, list[str]]:
    """(config file or None for the default, overrides): the older form of `parse_command_line`."""
    cmd = parse_command_line(argv)
    default = cmd.config_dir == CONFIG_DIR and cmd.config_name == DEFAULT_CONFIG_NAME
    return (None if default else cmd.config_file), cmd.overrides


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


def ray_timeline_file(cfg: DictConfig) -> str | None:
    """Where the run's Ray timeline goes (`ray_kwargs.timeline_json_file`, the legacy
    `ray_init.timeline_json_file` winning when set), or None for none."""
    legacy = (cfg.get("ray_init") or {}).get("timeline_json_file")
    return legacy or cfg.ray_kwargs.get("timeline_json_file") or None


@functools.lru_cache(maxsize=1)
def _data_defaults():
    return OmegaConf.load(CONFIG_DIR / "data" / "legacy_data.yaml")


def data_value(data_config, key: str):
    """`data.<key>` (dotted for a nested key) of a `data` section: the composed config's, or a partial
    mapping a caller passes; a key it leaves out (or a null section on the way) takes the value
    `verl/trainer/config/data/legacy_data.yaml` gives it."""
    node = data_config
    for part in key.split("."):
        if node is None or part not in node:
            return OmegaConf.select(_data_defaults(), key)
        node = node[part]
    return node
