"""omega_conf_to_dataclass: YAML values override dataclass defaults; `_target_` picks the class."""

import dataclasses
from typing import Any

import pytest
from omegaconf import OmegaConf

import verl.utils
from verl.base_config import BaseConfig
from verl.utils.config import ConfigError, omega_conf_to_dataclass

HERE = __name__


@dataclasses.dataclass
class _Engine(BaseConfig):
    param_offload: bool = False
    wrap_policy: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _FSDPEngine(_Engine):
    fsdp_size: int = -1


@dataclasses.dataclass
class _Optim(BaseConfig):
    lr: float = 1e-6
    betas: tuple[float, ...] = (0.9, 0.999)
    min_lr_ratio: float | None = None


@dataclasses.dataclass
class _Actor(BaseConfig):
    strategy: str = "fsdp"
    ppo_epochs: int = 1
    clip_ratio: float = 0.2
    optim: _Optim = dataclasses.field(default_factory=_Optim)
    engine: _Engine = dataclasses.field(default_factory=_Engine)
    override_config: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not 0 < self.clip_ratio < 1:
            raise ValueError(f"actor.clip_ratio={self.clip_ratio} must lie in (0, 1)")


@dataclasses.dataclass
class _PlainRequired:  # not a BaseConfig: no `_target_` field
    path: str
    n: int = 1


def test_yaml_values_override_defaults_and_nested_sections_become_dataclasses():
    cfg = OmegaConf.create({"ppo_epochs": 2, "optim": {"lr": 1, "betas": [0.9, 0.95]}, "engine": {}})
    actor = omega_conf_to_dataclass(cfg, _Actor)
    assert isinstance(actor, _Actor) and isinstance(actor.optim, _Optim) and isinstance(actor.engine, _Engine)
    assert actor.ppo_epochs == 2 and actor.clip_ratio == 0.2  # set / default
    assert actor.optim.lr == 1.0 and isinstance(actor.optim.lr, float)  # int written for a float field
    assert actor.optim.betas == (0.9, 0.95) and actor.optim.min_lr_ratio is None


def test_target_picks_the_class_when_no_type_is_given():
    cfg = OmegaConf.create(
        {
            "_target_": f"{HERE}._Actor",
            "clip_ratio": 0.28,
            "engine": {"_target_": f"{HERE}._FSDPEngine", "fsdp_size": 4},
        }
    )
    actor = omega_conf_to_dataclass(cfg)
    assert type(actor) is _Actor and actor.clip_ratio == 0.28
    assert actor._target_ == f"{HERE}._Actor"
    # a nested `_target_` naming a subclass of the field's type builds that subclass
    assert type(actor.engine) is _FSDPEngine and actor.engine.fsdp_size == 4


def test_interpolations_are_resolved():
    root = OmegaConf.create({"lr": 3e-6, "actor": {"optim": {"lr": "${lr}"}}})
    assert omega_conf_to_dataclass(root.actor, _Actor).optim.lr == 3e-6


def test_open_dicts_stay_plain_dicts():
    actor = omega_conf_to_dataclass({"override_config": {"attn_implementation": "eager", "n": {"a": 1}}}, _Actor)
    assert actor.override_config == {"attn_implementation": "eager", "n": {"a": 1}}
    assert type(actor.override_config["n"]) is dict


def test_empty_or_none_config_gives_defaults_and_objects_pass_through():
    assert omega_conf_to_dataclass(None, _Actor) == _Actor()
    assert omega_conf_to_dataclass(OmegaConf.create({}), _Actor) == _Actor()
    assert omega_conf_to_dataclass({}) is None
    built = _Actor(ppo_epochs=3)
    assert omega_conf_to_dataclass(built, _Actor) is built


def test_plain_dataclass_with_required_field():
    assert omega_conf_to_dataclass({"path": "x", "n": 2}, _PlainRequired) == _PlainRequired("x", 2)
    with pytest.raises(ConfigError, match=r"_PlainRequired needs 'path'.*add them"):
        omega_conf_to_dataclass({"n": 2}, _PlainRequired)


def test_unknown_key_names_the_path_and_lists_valid_keys():
    with pytest.raises(ConfigError, match=r"optim: unknown key\(s\) 'learning_rate' for _Optim; its keys are: .*lr"):
        omega_conf_to_dataclass({"optim": {"learning_rate": 1e-5}}, _Actor)


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"ppo_epochs": "2"}, r"ppo_epochs='2' \(str\) must be a int"),
        ({"ppo_epochs": True}, r"ppo_epochs=True \(bool\) must be a int"),
        ({"ppo_epochs": 1.5}, r"ppo_epochs=1.5 \(float\) must be a int"),
        ({"optim": {"lr": None}}, r"optim.lr is null but must be a float"),
        ({"optim": {"min_lr_ratio": "x"}}, r"optim.min_lr_ratio='x' matches none of float \| None"),
        ({"clip_ratio": None}, r"clip_ratio is null"),
        ({"optim": 3}, r"optim=3 must be a mapping of _Optim's fields"),
        ({"optim": {"betas": 0.9}}, r"optim.betas=0.9 must be a list"),
    ],
)
def test_wrong_types_are_refused_with_the_key_path(cfg, match):
    with pytest.raises(ConfigError, match=match):
        omega_conf_to_dataclass(cfg, _Actor)


def test_post_init_checks_run_on_the_built_section():
    with pytest.raises(ValueError, match=r"actor.clip_ratio=1.5 must lie in \(0, 1\)"):
        omega_conf_to_dataclass({"clip_ratio": 1.5}, _Actor)


def test_target_errors_are_clear():
    with pytest.raises(ConfigError, match="without `_target_`.*pass dataclass_type"):
        omega_conf_to_dataclass({"ppo_epochs": 1})
    with pytest.raises(ConfigError, match=r"_target_='no.such.Class' does not name an importable class"):
        omega_conf_to_dataclass({"_target_": "no.such.Class"})
    with pytest.raises(ConfigError, match=r"engine._target_=.*names _Optim, which is not a _Engine"):
        omega_conf_to_dataclass({"engine": {"_target_": f"{HERE}._Optim"}}, _Actor)
    with pytest.raises(ConfigError, match="must be a dataclass class"):
        omega_conf_to_dataclass({"a": 1}, dict)


def test_target_naming_the_declared_class_imported_under_another_module_name_builds_it(tmp_path, monkeypatch):
    """A test module pytest imported by its file name, or a script run as __main__, whose YAML names the
    class by its package path: importing that path makes a second class object of the same name."""
    import importlib.util

    (tmp_path / "twice_cfg.py").write_text(
        "import dataclasses\n"
        "from verl.base_config import BaseConfig\n\n"
        "@dataclasses.dataclass\n"
        "class Inner(BaseConfig):\n    width: int = 0\n\n"
        "@dataclasses.dataclass\n"
        "class Outer(BaseConfig):\n"
        "    size: int = 0\n"
        "    inner: Inner = dataclasses.field(default_factory=Inner)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = importlib.util.spec_from_file_location("__copy_of_twice_cfg__", tmp_path / "twice_cfg.py")
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    config = {"_target_": "twice_cfg.Outer", "size": 3, "inner": {"_target_": "twice_cfg.Inner", "width": 7}}
    built = omega_conf_to_dataclass(config, copy.Outer)
    assert type(built) is copy.Outer and type(built.inner) is copy.Inner
    assert (built.size, built.inner.width, built._target_) == (3, 7, "twice_cfg.Outer")
    # a class of another name is still no stand-in for the declared one
    with pytest.raises(ConfigError, match=r"inner._target_='twice_cfg.Outer' names Outer, which is not a Inner"):
        omega_conf_to_dataclass({"inner": {"_target_": "twice_cfg.Outer"}}, copy.Outer)


def test_non_dataclass_target_is_called_with_its_keys():
    built = omega_conf_to_dataclass({"_target_": "fractions.Fraction", "numerator": 3, "denominator": 6})
    assert built == 0.5


def test_exported_from_verl_utils():
    assert verl.utils.omega_conf_to_dataclass is omega_conf_to_dataclass
