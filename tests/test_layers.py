"""The package's layering, checked: imports point down, and no module grows past ~800 lines.

Layers, bottom to top (a module may import its own top-level package or any package of the same
or a lower rank; docs/architecture.md draws them):

    rank 5  trainer/, model_merger/   the driver and the entry points
    rank 4  experimental/             the agent loop and other pipelines that compose the layers below
    rank 3  workers/                  role workers, actors, critics, rollout engines
            checkpoint_engine/        upstream's weight-transfer API between worker groups
    rank 2  algorithms/, tools/, interactions/   the loss/advantage math; tools; simulated users
    rank 1  models/                   model factory, bundled models, megatron model pieces
    rank 0  protocol, single_controller/, utils/, verl/__init__   the base: imports nothing above it

Placement decisions: `interactions/` (simulated users) ranks with `tools/`: the agent loop drives both.
`tools/` (the tool implementations) sits below the workers: it imports only
the base, and what drives tools (the agent loop, the tool model's build script) sits above it. `experimental/` sits above the
workers: the agent loop wraps a worker's rollout engine (`workers.rollout.base`) and drives tools,
so it composes workers rather than being used by them; the trainer may import it. `model_merger/`
is an entry point (`python -m verl.model_merger`) and ranks with the trainer. `recipes/` (outside
`verl/`) is configs and scripts on top of everything; nothing in `verl/` may import it.

Every import counts: top level, inside functions, under `if TYPE_CHECKING`. Inside a layer, two
modules that import each other (a cycle, usually hidden by a lazy import) fail the same way. A crossing that is
not a layering problem, or one that cannot be fixed yet, is listed in `EXCEPTIONS` (cycles in
`MUTUAL_IMPORT_EXCEPTIONS`, long modules in `SIZE_EXCEPTIONS`) with its justification; an entry
that no longer matches fails the test, so the tables only shrink.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "verl"

LAYERS = {
    "": 0,  # verl/__init__.py
    "base_config": 0,  # BaseConfig, the base of every typed config section
    "protocol": 0,
    "single_controller": 0,
    "utils": 0,
    "models": 1,
    "algorithms": 2,
    "tools": 2,
    "interactions": 2,
    "workers": 3,
    "checkpoint_engine": 3,
    "experimental": 4,
    "trainer": 5,
    "model_merger": 5,
}
"""Top-level package under verl/ -> rank. A new package must be placed here explicitly."""

NON_PYTHON = {"assets"}
"""Folders under verl/ that hold data, not code."""

EXCEPTIONS = {
    (
        "verl/experimental/reward_loop/reward_loop.py",
        "verl.trainer.ppo.reward",
    ): "upstream's RewardLoopWorker loads the custom reward function as the trainer does "
    "(`get_custom_reward_fn`, which reads the trainer's CustomRewardFunctionConfig section); moving both down "
    "a layer is a larger change than the reward loop",
    (
        "verl/experimental/reward_loop/reward_loop.py",
        "verl.trainer.config.reward_migration",
    ): "upstream v0.9's public `migrate_legacy_reward_impl` at its upstream module; it is the config loader's "
    "migration of the older reward keys, defined once beside the loader that runs it",
    (
        "verl/models/build_bundled_tool.py",
        "verl.trainer",
    ): "a build script of the bundled arith-tool-tiny checkpoint (run as __main__, imported by nothing but "
    "its test): it trains the asset with the SFT trainer and lives beside the model factory that loads it",
    (
        "verl/models/build_bundled_tool.py",
        "verl.tools",
    ): "the same build script: its evaluation gives the model the calculator tool",
    (
        "verl/models/build_bundled_tool.py",
        "verl.experimental",
    ): "the same build script: measures the tool model with the real agent loop (evaluate_tool_use)",
    (
        "verl/models/build_bundled_tool.py",
        "verl.workers",
    ): "the same build script: the agent loop's evaluation runs on the built-in rollout engine",
    (
        "verl/utils/config.py",
        "verl.trainer.config",
    ): "upstream's name `verl.utils.config.validate_config` (recipes' drivers call it): a call, inside the "
    "function, into the trainer's config check, which lives with the schema it checks",
    (
        "verl/experimental/one_step_off_policy/main_ppo.py",
        "verl.trainer",
    ): "upstream's entry point by its module name (`python -m verl.experimental.one_step_off_policy.main_ppo`): "
    "an entry point ranks with the trainer, whose main_ppo it runs with its own config and key translation",
    (
        "verl/experimental/fully_async_policy/fully_async_main.py",
        "verl.trainer",
    ): "upstream's entry point by its module name (`python -m verl.experimental.fully_async_policy."
    "fully_async_main`): an entry point, as the one-step-off one",
    (
        "verl/experimental/agent_loop/__init__.py",
        "verl.trainer",
    ): "upstream's public name `verl.experimental.agent_loop.AgentLoopManager`: a module __getattr__ hands out "
    "the trainer's manager (it drives the trainer's worker groups), imported only when asked for",
    (
        "verl/experimental/agent_loop/agent_loop.py",
        "verl.trainer",
    ): "the same name at upstream's module path `verl.experimental.agent_loop.agent_loop.AgentLoopManager`",
}
"""(importing file, imported package prefix) -> why this arrow against the layers is allowed."""

MUTUAL_IMPORT_EXCEPTIONS: dict[tuple[str, str], str] = {}
"""Pairs of modules that import each other (a cycle inside one layer) -> why, for now."""

MAX_LINES = 800

SIZE_EXCEPTIONS: dict[str, str] = {}
"""Module -> why it may pass MAX_LINES for now (each names the issue that removes it)."""


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file, wherever it sits (`from m import x`
    gives both `m` and `m.x`)."""
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from package import name` may name a submodule: record both, resolved later
            found.append((node.lineno, target))
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names if alias.name != "*"]
    return found


def _top_package(module: str) -> str | None:
    """The package under verl/ a module belongs to ('' for verl itself); None outside verl."""
    parts = module.split(".")
    if parts[0] != "verl":
        return None
    return parts[1] if len(parts) > 1 else ""


def _python_files(root: Path = ROOT) -> list[Path]:
    return sorted((root / "verl").rglob("*.py"))


def _crossings(root: Path = ROOT) -> list[tuple[str, int, str]]:
    """(file, line, imported module) for every import that points up the layers."""
    crossings = []
    for path in _python_files(root):
        file = str(path.relative_to(root))
        source = _top_package(_module_name(path, root))
        for line, target in _imported_modules(path, root):
            dest = _top_package(target)
            if target.split(".")[0] == "recipes" or (dest not in (None, source) and LAYERS[dest] > LAYERS[source]):
                crossings.append((file, line, target))
    return sorted(crossings)


def _exception_for(file: str, target: str) -> tuple[str, str] | None:
    for key in EXCEPTIONS:
        excepted_file, prefix = key
        if file == excepted_file and (target == prefix or target.startswith(prefix + ".")):
            return key
    return None


def test_every_package_under_verl_has_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("__")}
    packages |= {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    unplaced = sorted(packages - set(LAYERS) - NON_PYTHON)
    assert unplaced == [], f"place these in LAYERS (tests/test_layers.py) and docs/architecture.md: {unplaced}"


def test_imports_point_down_the_layers():
    unexplained = [
        f"{file}:{line} imports {target}" for file, line, target in _crossings() if _exception_for(file, target) is None
    ]
    assert unexplained == [], (
        "imports against the layer order (see the docstring of tests/test_layers.py); move the code "
        "down a layer, or list the arrow in EXCEPTIONS with why:\n" + "\n".join(unexplained)
    )


def test_every_layer_exception_is_still_needed():
    used = {_exception_for(file, target) for file, _, target in _crossings()}
    stale = sorted(set(EXCEPTIONS) - used)
    assert stale == [], f"these EXCEPTIONS no longer match any import; delete them: {stale}"


def test_the_checker_sees_imports_inside_functions_and_relative_ones(tmp_path):
    # the checker itself must catch what the layering forbids, or the tests above cannot fail
    package = tmp_path / "verl" / "utils"
    package.mkdir(parents=True)
    (tmp_path / "verl" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("from . import fs\n")
    (package / "leaky.py").write_text(
        "import verl.utils.fs\n"
        "from verl.protocol import DataProto\n"
        "def f():\n"
        "    from verl.trainer import main_ppo\n"
        "from ..workers import fsdp_workers\n"
        "import recipes.dapo\n"
    )
    assert _crossings(tmp_path) == [
        ("verl/utils/leaky.py", 4, "verl.trainer"),
        ("verl/utils/leaky.py", 4, "verl.trainer.main_ppo"),
        ("verl/utils/leaky.py", 5, "verl.workers"),
        ("verl/utils/leaky.py", 5, "verl.workers.fsdp_workers"),
        ("verl/utils/leaky.py", 6, "recipes.dapo"),
    ]


def test_no_module_passes_800_lines_unless_listed():
    too_long = {
        str(path.relative_to(ROOT)): n
        for path in _python_files()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    unlisted = {path: n for path, n in too_long.items() if path not in SIZE_EXCEPTIONS}
    assert unlisted == {}, f"modules over {MAX_LINES} lines; split them (or list them with a reason): {unlisted}"
    stale = sorted(set(SIZE_EXCEPTIONS) - set(too_long))
    assert stale == [], f"these SIZE_EXCEPTIONS are now under {MAX_LINES} lines; delete them: {stale}"


def _mutual_imports(root: Path = ROOT) -> list[tuple[str, str]]:
    """Pairs (a, b), a < b, of modules that import each other; a package importing its own
    submodule and back (re-exports in an `__init__`) is the package's own business and not listed."""
    paths = {_module_name(path, root): path for path in _python_files(root)}
    edges = set()
    for module, path in paths.items():
        for _, target in _imported_modules(path, root):
            parts = target.split(".")
            while parts and ".".join(parts) not in paths:
                parts.pop()
            if parts and ".".join(parts) != module:
                edges.add((module, ".".join(parts)))

    def package_and_member(a: str, b: str) -> bool:
        return b.startswith(a + ".") or a.startswith(b + ".")

    return sorted((a, b) for a, b in edges if a < b and (b, a) in edges and not package_and_member(a, b))


def test_no_two_modules_import_each_other_unless_listed():
    found = _mutual_imports()
    unlisted = [pair for pair in found if pair not in MUTUAL_IMPORT_EXCEPTIONS]
    assert unlisted == [], f"modules that import each other (a hidden cycle); break the cycle: {unlisted}"
    stale = sorted(set(MUTUAL_IMPORT_EXCEPTIONS) - set(found))
    assert stale == [], f"these MUTUAL_IMPORT_EXCEPTIONS no longer import each other; delete them: {stale}"


def test_the_cycle_checker_sees_a_lazy_import_back(tmp_path):
    package = tmp_path / "verl" / "trainer"
    package.mkdir(parents=True)
    (tmp_path / "verl" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("from verl.trainer import a\n")
    (package / "a.py").write_text("from verl.trainer import b\n")
    (package / "b.py").write_text("def f():\n    from verl.trainer.a import g\n")
    assert _mutual_imports(tmp_path) == [("verl.trainer.a", "verl.trainer.b")]
