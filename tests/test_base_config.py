"""BaseConfig: frozen after construction (except `_mutable_fields`) and readable as a mapping."""

import dataclasses
import pickle
from collections.abc import Mapping

import pytest

from verl.base_config import BaseConfig, ConfigKeyError


@dataclasses.dataclass
class _Optim(BaseConfig):
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)


@dataclasses.dataclass
class _Actor(BaseConfig):
    _mutable_fields = {"ppo_mini_batch_size"}

    ppo_mini_batch_size: int = 256
    clip_ratio: float = 0.2
    optim: _Optim = dataclasses.field(default_factory=_Optim)


def test_fields_are_frozen_after_construction():
    cfg = _Actor()
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"_Actor.clip_ratio is frozen.*dataclasses.replace"):
        cfg.clip_ratio = 0.3
    with pytest.raises(dataclasses.FrozenInstanceError):
        del cfg.clip_ratio
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optim.lr = 1.0
    assert cfg.clip_ratio == 0.2 and cfg.optim.lr == 1e-6


def test_mutable_fields_can_be_reassigned():
    cfg = _Actor(ppo_mini_batch_size=256)
    cfg.ppo_mini_batch_size = 256 * 4 // 8
    assert cfg.ppo_mini_batch_size == 128


def test_replace_builds_a_new_section_and_leaves_the_old_one():
    cfg = _Actor()
    new = dataclasses.replace(cfg, clip_ratio=0.28)
    assert (cfg.clip_ratio, new.clip_ratio) == (0.2, 0.28)


def test_reads_like_a_mapping():
    cfg = _Actor(clip_ratio=0.3)
    assert isinstance(cfg, Mapping)
    assert cfg["clip_ratio"] == 0.3
    assert cfg.get("clip_ratio", 9.0) == 0.3
    assert cfg.get("no_such_key") is None
    assert cfg.get("no_such_key", 7) == 7
    assert list(cfg) == ["_target_", "ppo_mini_batch_size", "clip_ratio", "optim"]
    assert len(cfg) == 4
    assert "clip_ratio" in cfg and "no_such_key" not in cfg and 3 not in cfg
    assert dict(cfg.items())["optim"]["lr"] == 1e-6
    # `**cfg` works like a dict (Mapping gives keys() + __getitem__)
    assert (lambda **kw: kw["ppo_mini_batch_size"])(**cfg) == 256


def test_missing_key_is_both_key_error_and_attribute_error_and_lists_fields():
    cfg = _Actor()
    for exc in (KeyError, AttributeError, ConfigKeyError):
        with pytest.raises(exc):
            cfg["clip_ration"]
    with pytest.raises(KeyError, match=r"_Actor has no field 'clip_ration'; its fields are: .*clip_ratio"):
        cfg["clip_ration"]
    with pytest.raises(TypeError, match="keys are field names"):
        cfg[0]


def test_equality_is_field_wise_and_sections_are_unhashable():
    assert _Actor() == _Actor()
    assert _Actor(clip_ratio=0.3) != _Actor()
    with pytest.raises(TypeError):
        hash(_Actor())


def test_target_is_keyword_only_so_subclasses_may_have_required_fields():
    @dataclasses.dataclass
    class Required(BaseConfig):
        path: str

    assert Required("x").path == "x"
    assert Required("x", _target_="a.B")._target_ == "a.B"
    with pytest.raises(TypeError):
        Required()


def test_pickles_round_trip_and_stays_frozen():
    cfg = pickle.loads(pickle.dumps(_Actor(clip_ratio=0.25)))
    assert cfg == _Actor(clip_ratio=0.25)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.clip_ratio = 0.1


def test_attribute_set_after_construction_reads_by_key_but_is_not_a_field():
    cfg = _Actor()
    cfg.extra_note = "hello"  # not a declared field: allowed once, as upstream
    assert cfg["extra_note"] == "hello" and cfg.get("extra_note") == "hello" and "extra_note" in cfg
    assert "extra_note" not in list(cfg) and len(cfg) == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.extra_note = "again"
    # methods and class attributes are not keys
    for name in ("get", "_mutable_fields"):
        assert name not in cfg
        with pytest.raises(KeyError):
            cfg[name]
