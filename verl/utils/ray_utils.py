"""Small Ray and asyncio helpers (upstream's `verl.utils.ray_utils`).

- `ray_noset_visible_devices(env)`: whether Ray was told not to set the accelerator-visibility
  variable (CUDA_VISIBLE_DEVICES, ...) of its workers; then a worker sees every device of its node
  and must pick its own by local rank.
- `parallel_put(values, max_workers=None)`: `ray.put` many objects from a thread pool, references in
  input order (serialising large objects is the slow part, and it releases the GIL in places).
- `get_event_loop()`: this thread's event loop, created and installed when it has none (worker
  threads and Ray actor threads start without one).
- `auto_await(fn)`: wrap a coroutine function so that callers without a running loop get the result
  (run to completion) and callers inside a running loop get an awaitable.

Ray is imported inside `parallel_put` only, so the asyncio helpers work without it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import os
import warnings
from collections.abc import Mapping
from typing import Any

__all__ = ["auto_await", "get_event_loop", "node_ip", "parallel_put", "ray_noset_visible_devices"]

# Ray leaves the visibility variable of each accelerator kind alone when the matching variable is set.
NOSET_VISIBLE_DEVICES_ENV_VARS = (
    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",
    "RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES",
    "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES",
    "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES",
    "RAY_EXPERIMENTAL_NOSET_HABANA_VISIBLE_MODULES",
    "RAY_EXPERIMENTAL_NOSET_NEURON_RT_VISIBLE_CORES",
    "RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS",
    "RAY_EXPERIMENTAL_NOSET_ONEAPI_DEVICE_SELECTOR",
)


def node_ip(without_ray: str | None = None) -> str:
    """An address of this node that other nodes reach: Ray's when Ray is running; otherwise
    `without_ray` when given, else the hostname's address (127.0.0.1 if it does not resolve)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    if without_ray is not None:
        return without_ray
    import socket

    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def ray_noset_visible_devices(env_vars: Mapping[str, str] = os.environ) -> bool:
    """True when any `RAY_EXPERIMENTAL_NOSET_*_VISIBLE_*` variable is set to a non-empty value in `env_vars`."""
    return any(env_vars.get(name) for name in NOSET_VISIBLE_DEVICES_ENV_VARS)


def parallel_put(data_list: list[Any], max_workers: int | None = None) -> list:
    """`[ray.put(x) for x in data_list]`, from up to `max_workers` threads (default min(len, 16)).

    An empty `data_list` raises AssertionError, the error upstream's assert gives callers.
    """
    import ray

    if not data_list:
        raise AssertionError("parallel_put needs at least one object to put; data_list is empty")
    workers = max_workers if max_workers is not None else min(len(data_list), 16)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as executor:
        return list(executor.map(ray.put, data_list))


def get_event_loop() -> asyncio.AbstractEventLoop:
    """The running loop, else this thread's loop, else a new loop installed for this thread."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        pass
    try:
        with warnings.catch_warnings():  # Python 3.12+ warns when the main thread has no loop yet
            warnings.simplefilter("ignore", DeprecationWarning)
            loop = asyncio.get_event_loop_policy().get_event_loop()
    except RuntimeError:  # a thread other than the main one has no loop until one is set
        loop = None
    if loop is None or loop.is_closed():
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
    return loop


def run_sync(coro):
    """Run a coroutine to completion from synchronous code and return its result, also when this thread
    already runs an event loop (a notebook, a caller inside a coroutine): then on a fresh loop in a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def auto_await(func):
    """Decorator for a coroutine function: outside a running event loop the call runs the coroutine to
    completion and returns its result; inside one it returns the coroutine for the caller to await.
    A call that returns a non-coroutine value passes it through."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        result = func(*args, **kwargs)
        if not inspect.iscoroutine(result):
            return result
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(result)
        return result

    return wrapper
