"""Load user code from a Python file given by path (custom reward functions, custom dataset classes).

The file is imported under a module name derived from its absolute path and registered in
``sys.modules``, so the objects it defines can be pickled by reference (process pools forked from this
process find the module) and two different files never shadow each other. Each failure names the
config key that pointed at the file and says how to fix it: a missing file (with the working
directory relative paths are resolved from), a file that raises while importing (the original
exception is chained), a name that the file does not define (with the callables it does define).

Upstream's path forms are accepted: `pkg://verl.utils.dataset.rl_dataset` (or with slashes) imports
an installed module, `file://path/to/file.py` is a file path. No path at all (None or "") means
"nothing to load", as upstream: `load_module` and `load_extern_type` return None, and
`load_extern_object` raises AttributeError naming the object it could not find.
`import_external_libs` imports modules by name for their side effects (registering reward
managers, workers, ...).

Also upstream's availability checks (`is_vllm_available`, `is_sglang_available`,
`is_megatron_core_available`, `is_trl_available`, `is_nvtx_available`: looked up, never imported),
its `deprecated` decorator and `load_class_from_fqn`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import os
import sys
import warnings
from types import ModuleType

_PKG_PREFIX = "pkg://"
_FILE_PREFIX = "file://"
EXTERN_MODULE_PREFIX = "verl_extern_"
"""The module-name prefix of files `load_module` imports by path: no other process can import such a module
by its name, so what it defines travels pickled by value (`ray.cloudpickle.register_pickle_by_value`)."""


def import_external_libs(external_libs: str | list[str] | None = None) -> None:
    """Import each named module (a name or a list of names) for its side effects."""
    if external_libs is None:
        return
    for name in [external_libs] if isinstance(external_libs, str) else list(external_libs):
        importlib.import_module(name)


def load_module(file_path: str | None, config_key: str = "path") -> ModuleType | None:
    """Import the Python file at ``file_path`` (or the ``pkg://`` module); ``config_key`` names the
    setting it came from, for errors. None or "" gives None."""
    if not file_path:
        return None
    file_path = str(file_path)
    if file_path.startswith(_PKG_PREFIX):
        return importlib.import_module(file_path[len(_PKG_PREFIX) :].replace("/", "."))
    if file_path.startswith(_FILE_PREFIX):
        file_path = file_path[len(_FILE_PREFIX) :]
    path = os.path.abspath(os.path.expanduser(file_path))
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{config_key}={file_path!r} does not exist (resolved to {path!r}; relative paths are resolved from "
            f"the working directory {os.getcwd()!r}); set {config_key} to an existing .py file"
        )
    stem = os.path.splitext(os.path.basename(path))[0]
    module_name = f"{EXTERN_MODULE_PREFIX}{hashlib.sha1(path.encode()).hexdigest()[:10]}_{stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{config_key}={file_path!r} cannot be imported as Python source; give a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise RuntimeError(
            f"importing {config_key}={file_path!r} raised {type(e).__name__}: {e} (see the traceback above); "
            "fix the file, or check that its dependencies are installed in this environment"
        ) from e
    return module


def _public_callables(module: ModuleType) -> list[str]:
    return sorted(name for name, value in vars(module).items() if callable(value) and not name.startswith("_"))


def load_extern_object(file_path: str | None, name: str, config_key: str = "custom") -> object:
    """The object called ``name`` defined in the Python file ``file_path``.

    ``config_key`` is the config section the two values came from (``custom_reward_function``), so errors
    can name ``<config_key>.path`` and ``<config_key>.name``.
    """
    module = load_module(file_path, config_key=f"{config_key}.path")
    if module is None:
        raise AttributeError(
            f"cannot load {name!r}: {config_key}.path is not set; point it at the Python file (or pkg:// module) "
            "that defines it"
        )
    if not name or not hasattr(module, name):
        raise AttributeError(
            f"{config_key}.name={name!r} is not defined in {config_key}.path={file_path!r}; the file defines "
            f"these callables: {_public_callables(module)}. Set {config_key}.name to one of them"
        )
    return getattr(module, name)


def load_extern_type(file_path: str | None, type_name: str, config_key: str = "custom_cls") -> type | None:
    """A class defined in a Python file (upstream's name for ``load_extern_object`` restricted to types);
    None when no file is given, as upstream's ``load_extern_type``."""
    if not file_path:
        return None
    obj = load_extern_object(file_path, type_name, config_key=config_key)
    if not isinstance(obj, type):
        raise TypeError(f"{config_key}.name={type_name!r} in {file_path!r} is a {type(obj).__name__}, not a class")
    return obj


def is_nvtx_available() -> bool:
    """Whether the `nvtx` package (NVIDIA's range markers for Nsight Systems) is installed."""
    try:
        return importlib.util.find_spec("nvtx") is not None
    except (ImportError, ValueError):
        return False


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


@functools.cache
def is_megatron_core_available() -> bool:
    """Whether `megatron.core` is installed (looked up once, not imported)."""
    return _has_module("megatron.core")


@functools.cache
def is_vllm_available() -> bool:
    """Whether `vllm` is installed (looked up once, not imported)."""
    return _has_module("vllm")


@functools.cache
def is_sglang_available() -> bool:
    """Whether `sglang` is installed (looked up once, not imported)."""
    return _has_module("sglang")


@functools.cache
def is_trl_available() -> bool:
    """Whether `trl` is installed (looked up once, not imported)."""
    return _has_module("trl")


def deprecated(replacement: str = ""):
    """Mark a function or class deprecated: calling it (or constructing the class) warns with a
    FutureWarning naming it by module and qualified name, and `replacement` when given."""

    def decorator(obj):
        qualified = f"{obj.__module__}.{obj.__qualname__}"
        kind = "Class" if isinstance(obj, type) else "Function"
        message = f"Warning: {kind} '{qualified}' is deprecated."
        if replacement:
            message += f" Please use '{replacement}' instead."
        if isinstance(obj, type):
            original_init = obj.__init__

            @functools.wraps(original_init)
            def init(self, *args, **kwargs):
                warnings.warn(message, category=FutureWarning, stacklevel=2)
                original_init(self, *args, **kwargs)

            obj.__init__ = init
            return obj

        @functools.wraps(obj)
        def wrapped(*args, **kwargs):
            warnings.warn(message, category=FutureWarning, stacklevel=2)
            return obj(*args, **kwargs)

        return wrapped

    return decorator


def load_class_from_fqn(fqn: str, description: str = "class") -> type:
    """The class `package.module.ClassName` names (`description` names it in errors): ValueError
    without a dot, ImportError when the module cannot be imported, AttributeError when it lacks
    the class."""
    if "." not in fqn:
        raise ValueError(
            f"Invalid {description} '{fqn}'. Expected fully qualified class name (e.g., 'mypackage.module.ClassName')."
        )
    module_path, class_name = fqn.rsplit(".", 1)
    try:
        module = importlib.import_module(module_path)
    except ImportError as e:
        raise ImportError(f"Failed to import module '{module_path}' for {description}: {e}") from e
    if not hasattr(module, class_name):
        raise AttributeError(
            f"Class '{class_name}' not found in module '{module_path}' (for {description}); it defines "
            f"{_public_callables(module)}"
        )
    return getattr(module, class_name)
