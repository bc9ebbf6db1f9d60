"""verl.utils.py_functional: timeouts, dict helpers, DynamicEnum, env and config helpers."""

import os
import pickle
import threading
import time

import pytest
from omegaconf import OmegaConf

from verl.utils.metric import Metric
from verl.utils.py_functional import (
    DynamicEnum,
    NestedNamespace,
    append_to_dict,
    convert_to_regular_types,
    rename_dict,
    temp_env_var,
    timeout_limit,
    union_two_dict,
)


def _square(x):
    return x * x


def _sleep_then(seconds, value):
    time.sleep(seconds)
    return value


def _fail():
    raise KeyError("boom")


@pytest.mark.parametrize("use_signals", [False, True])
def test_timeout_limit_returns_result_and_reraises(use_signals):
    assert timeout_limit(5, use_signals=use_signals)(_square)(7) == 49
    with pytest.raises(KeyError, match="boom"):
        timeout_limit(5, use_signals=use_signals)(_fail)()


@pytest.mark.parametrize("use_signals", [False, True])
def test_timeout_limit_stops_a_slow_call_near_the_deadline(use_signals):
    slow = timeout_limit(0.3, use_signals=use_signals)(_sleep_then)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="0.3 s"):
        slow(30, "never")
    elapsed = time.monotonic() - start
    assert elapsed < 10, f"the call was stopped after {elapsed:.1f} s, not at the 0.3 s deadline"


def test_timeout_limit_with_signals_refuses_other_threads():
    errors = []

    def run():
        try:
            timeout_limit(1, use_signals=True)(_square)(2)
        except RuntimeError as e:
            errors.append(str(e))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert errors and "main thread" in errors[0]


def test_union_two_dict_adds_keys_and_rejects_conflicts():
    assert union_two_dict({"a": 1}, {"a": 1, "b": 2}) == {"a": 1, "b": 2}
    with pytest.raises(ValueError, match="'a' is 1 in the first dict but 3"):
        union_two_dict({"a": 1}, {"a": 3})


def test_rename_and_append_to_dict_with_prefix():
    assert rename_dict({"loss": 1, "actor/kl": 2}, "actor/") == {"actor/loss": 1, "actor/kl": 2}
    collected = {}
    append_to_dict(collected, {"loss": 1.0, "lens": [3, 4]}, prefix="actor/")
    append_to_dict(collected, {"loss": 2.0, "lens": [5]}, prefix="actor/")
    append_to_dict(collected, {"tok": Metric("sum", 2.0)})
    append_to_dict(collected, {"tok": Metric("sum", 3.0)})
    assert collected["actor/loss"] == [1.0, 2.0] and collected["actor/lens"] == [3, 4, 5]
    assert isinstance(collected["tok"], Metric) and collected["tok"].aggregate() == 5.0


def test_nested_namespace():
    ns = NestedNamespace({"a": 1, "b": {"c": 2, "d": {"e": 3}}}, extra=4)
    assert (ns.a, ns.b.c, ns.b.d.e, ns.extra) == (1, 2, 3, 4)


class Color(DynamicEnum):
    _registry = {}
    _next_value = 0


def test_dynamic_enum_registers_iterates_and_pickles_by_name():
    red = Color.register("red")
    blue = Color.register("Blue")
    try:
        assert Color.RED is red and Color["BLUE"] is blue and (red.value, blue.value) == (0, 1)
        assert "RED" in Color and blue in Color and list(Color) == [red, blue] and Color.names() == ["RED", "BLUE"]
        assert pickle.loads(pickle.dumps(blue)) is blue
        assert pickle.loads(pickle.dumps(Color)) is Color
        with pytest.raises(ValueError, match="already registered"):
            Color.register("RED")
        assert Color.from_name("blue") is blue and Color.from_name("green") is None
    finally:
        Color.remove("red")
        Color.remove("blue")
    assert "RED" not in Color and not hasattr(Color, "RED")


def test_temp_env_var_restores_previous_value_and_absence():
    os.environ["VERL_TEST_TEMP_A"] = "old"
    os.environ.pop("VERL_TEST_TEMP_B", None)
    with temp_env_var("VERL_TEST_TEMP_A", "new"), temp_env_var("VERL_TEST_TEMP_B", "x"):
        assert os.environ["VERL_TEST_TEMP_A"] == "new" and os.environ["VERL_TEST_TEMP_B"] == "x"
    assert os.environ.pop("VERL_TEST_TEMP_A") == "old" and "VERL_TEST_TEMP_B" not in os.environ


def test_convert_to_regular_types():
    cfg = OmegaConf.create({"a": {"b": [1, {"c": 2}]}, "d": "${a.b}"})
    out = convert_to_regular_types([cfg, (OmegaConf.create([3]),), {"k": cfg.a}])
    assert out == [{"a": {"b": [1, {"c": 2}]}, "d": [1, {"c": 2}]}, [[3]], {"k": {"b": [1, {"c": 2}]}}]
    assert type(out[0]["a"]) is dict
