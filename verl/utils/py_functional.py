"""Small Python helpers that upstream verl's recipes and workers import (`verl.utils.py_functional`).

- `timeout_limit(seconds, use_signals=False)`: a decorator that bounds a call's wall time. By default
  the call runs in a child process, which is killed at the deadline: the only way to stop code that
  does not return (a C extension, a sympy simplification that explodes) without leaving it running.
  The function and its arguments must be picklable unless the platform forks (Linux: the child
  inherits them). `use_signals=True` runs the call in this process under a SIGALRM timer instead:
  cheaper, main thread only, and it can only interrupt Python code.
- Dict helpers: `union_two_dict` (keys of both; a key present in both must have equal values),
  `rename_dict` (prefix every key), `append_to_dict` (collect per-key lists, `Metric`-aware).
- `NestedNamespace` (attribute access to a nested dict), `DynamicEnum` (an enum that code can
  extend at run time, pickled by name), `temp_env_var` (set an environment variable for a block),
  `convert_to_regular_types` (OmegaConf containers to plain dicts and lists).
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import pickle
import queue
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from types import SimpleNamespace
from typing import Any

from verl.utils.metric import Metric

__all__ = [
    "DynamicEnum",
    "DynamicEnumMeta",
    "NestedNamespace",
    "append_to_dict",
    "convert_to_regular_types",
    "rename_dict",
    "temp_env_var",
    "timeout_limit",
    "union_two_dict",
]


def _run_and_report(func: Callable, results, args: tuple, kwargs: dict) -> None:
    """Child-process side of `timeout_limit`: put (True, result) or (False, exception) on the queue."""
    try:
        outcome = (True, func(*args, **kwargs))
    except Exception as e:
        outcome = (False, e)
    try:
        pickle.dumps(outcome)
    except Exception as e:  # an unpicklable result or exception still reaches the parent as an error
        outcome = (False, RuntimeError(f"{type(outcome[1]).__name__} from {func.__name__} cannot be pickled: {e}"))
    results.put(outcome)


def _process_context():
    # fork keeps closures and the caller's imports usable in the child; elsewhere spawn needs picklable input
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else None)


def _call_in_child(func: Callable, seconds: float, args: tuple, kwargs: dict):
    ctx = _process_context()
    results = ctx.Queue(maxsize=1)
    process = ctx.Process(target=_run_and_report, args=(func, results, args, kwargs), daemon=True)
    process.start()
    try:
        try:
            # wait on the queue, not on the process: a large result blocks the child's exit until read
            success, value = results.get(timeout=seconds)
        except queue.Empty:
            if process.is_alive():
                raise TimeoutError(
                    f"{func.__name__} timed out after {seconds} seconds (its process was killed)"
                ) from None
            raise RuntimeError(
                f"{func.__name__} ended its process (exit code {process.exitcode}) without returning a result"
            ) from None
    finally:
        if process.is_alive():
            process.kill()
        process.join()
        results.close()
    if success:
        return value
    raise value


class _SignalTimeout(Exception):
    pass


def _call_under_alarm(func: Callable, seconds: float, args: tuple, kwargs: dict):
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            f"timeout_limit(use_signals=True) on {func.__name__} needs the main thread (SIGALRM is delivered "
            "there only); use the default use_signals=False from other threads"
        )

    def on_alarm(signum, frame):
        raise _SignalTimeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return func(*args, **kwargs)
    except _SignalTimeout:
        raise TimeoutError(f"{func.__name__} timed out after {seconds} seconds (interrupted by SIGALRM)") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def timeout_limit(seconds: float, use_signals: bool = False):
    """Decorator: the call raises `TimeoutError` when it runs longer than `seconds` (see the module
    docstring for the two ways it is enforced). An exception raised by the call is re-raised."""
    if not seconds > 0:
        raise ValueError(f"timeout_limit needs a positive number of seconds, got {seconds!r}")
    if use_signals and os.name != "posix":
        raise NotImplementedError(f"timeout_limit(use_signals=True) needs POSIX signals; this OS is {os.name!r}")

    def decorator(func: Callable) -> Callable:
        @wraps(func)
        def wrapper(*args, **kwargs):
            if use_signals:
                return _call_under_alarm(func, seconds, args, kwargs)
            return _call_in_child(func, seconds, args, kwargs)

        return wrapper

    return decorator


def union_two_dict(dict1: dict, dict2: dict) -> dict:
    """Add the entries of `dict2` to `dict1` (in place) and return it; a key in both must have equal values."""
    for key, value in dict2.items():
        if key in dict1 and dict1[key] != value:
            raise ValueError(f"union_two_dict: {key!r} is {dict1[key]!r} in the first dict but {value!r} in the second")
        dict1[key] = value
    return dict1


def rename_dict(data: dict, prefix: str = "") -> dict:
    """A copy of `data` with `prefix` put in front of every key that does not already start with it."""
    return {(key if key.startswith(prefix) else f"{prefix}{key}"): value for key, value in data.items()}


def append_to_dict(data: dict, new_data: dict, prefix: str = "") -> None:
    """Collect `new_data` into per-key lists of `data` (in place), keys prefixed as in `rename_dict`.

    A list value extends the key's list; anything else is appended. A key first seen with a `Metric`
    value starts as an empty Metric of the same aggregation, so the collected values keep it.
    """
    for key, value in new_data.items():
        name = key if key.startswith(prefix) else f"{prefix}{key}"
        if name not in data:
            data[name] = value.init_list() if isinstance(value, Metric) else []
        if isinstance(value, list):
            data[name].extend(value)
        else:
            data[name].append(value)


class NestedNamespace(SimpleNamespace):
    """`NestedNamespace({"a": 1, "b": {"c": 2}})` gives `.a == 1` and `.b.c == 2` (nested dicts become
    namespaces); keyword arguments become further attributes."""

    def __init__(self, dictionary: dict, **kwargs):
        super().__init__(**kwargs)
        for key, value in dictionary.items():
            setattr(self, key, NestedNamespace(value) if isinstance(value, dict) else value)


class DynamicEnumMeta(type):
    """Class-level behaviour of `DynamicEnum`: iteration, `in`, `[name]`, and pickling by module + name."""

    def __iter__(cls) -> Iterator[Any]:
        return iter(cls._registry.values())

    def __contains__(cls, item: Any) -> bool:
        if isinstance(item, str):
            return item in cls._registry
        return item in cls._registry.values()

    def __getitem__(cls, name: str) -> Any:
        try:
            return cls._registry[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a member of {cls.__name__}; members: {list(cls._registry)}") from None

    def __reduce_ex__(cls, protocol):
        return getattr, (importlib.import_module(cls.__module__), cls.__name__)

    def names(cls) -> list[str]:
        return list(cls._registry)

    def values(cls) -> list[Any]:
        return list(cls._registry.values())


class DynamicEnum(metaclass=DynamicEnumMeta):
    """An enum whose members are added at run time with `register(name)` (names are upper-cased).

    Subclass it and give the subclass its own `_registry = {}` and `_next_value = 0`. A member pickles
    as "attribute `NAME` of the class in its module", so unpickling returns the existing member of the
    receiving process instead of a copy.
    """

    _registry: dict[str, DynamicEnum] = {}
    _next_value: int = 0

    def __init__(self, name: str, value: int):
        self.name = name
        self.value = value

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}: {self.value}>"

    def __reduce_ex__(self, protocol):
        enum_cls = getattr(importlib.import_module(type(self).__module__), type(self).__name__)
        return getattr, (enum_cls, self.name)

    @classmethod
    def register(cls, name: str) -> DynamicEnum:
        key = name.upper()
        if key in cls._registry:
            raise ValueError(f"{cls.__name__}.{key} is already registered")
        member = cls(key, cls._next_value)
        cls._registry[key] = member
        setattr(cls, key, member)
        cls._next_value += 1
        return member

    @classmethod
    def remove(cls, name: str) -> DynamicEnum:
        key = name.upper()
        if key not in cls._registry:
            raise KeyError(f"{key!r} is not a member of {cls.__name__}")
        member = cls._registry.pop(key)
        delattr(cls, key)
        return member

    @classmethod
    def from_name(cls, name: str) -> DynamicEnum | None:
        return cls._registry.get(name.upper())


@contextmanager
def temp_env_var(key: str, value: str):
    """Set the environment variable `key` to `value` inside the block; restore (or remove) it after."""
    original = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if original is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = original


def convert_to_regular_types(obj):
    """OmegaConf `DictConfig`/`ListConfig` (also inside lists, tuples and dicts) as plain dicts and lists."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(obj, (DictConfig, ListConfig)):
        return OmegaConf.to_container(obj, resolve=True)
    if isinstance(obj, (list, tuple)):
        return [convert_to_regular_types(x) for x in obj]
    if isinstance(obj, dict):
        return {k: convert_to_regular_types(v) for k, v in obj.items()}
    return obj
