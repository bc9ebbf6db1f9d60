"""Debugging helpers (upstream's `verl.utils.debug`).

`verl.utils.debug.metrics` compares the rollout engine's log-probs with the actor's. Upstream also
re-exports its profiler from this package for backward compatibility; those names are looked up in
`verl.utils.profiler` on first access, so this package imports nothing heavy itself.
"""


def __getattr__(name):
    import importlib

    try:
        profiler = importlib.import_module("verl.utils.profiler")
    except ModuleNotFoundError as e:
        if e.name != "verl.utils.profiler":
            raise
        raise AttributeError(f"module 'verl.utils.debug' has no attribute {name!r}") from None
    try:
        return getattr(profiler, name)
    except AttributeError:
        raise AttributeError(f"module 'verl.utils.debug' has no attribute {name!r}") from None
