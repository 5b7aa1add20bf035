"""The package's shape: every module opens with a docstring, none is longer than a reader holds in mind, and no
module imports, directly or through others, a module that imports it.

In the import graph every import counts, those deferred into a function body included (a deferred import hides a
cycle, it does not remove it); only imports under `if TYPE_CHECKING:` are left out, since they never run. A
package's `__init__` is a module like any other; importing a submodule is not counted as importing its package.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "gspo_trl"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE_ROOT.rglob("*.py")}


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST):
    for node in ast.iter_child_nodes(tree):
        if _is_type_checking_block(node):
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        yield from _imports(node)


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module `name` imports."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in _imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            # `from package import submodule` imports the submodule; `from module import name`, the module.
            targets = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source for alias in node.names
            ]
        found.update(target for target in targets if target in modules)
    found.discard(name)
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_cycle_finder_finds_a_cycle_through_three_modules_and_nothing_in_a_tree():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_relative_and_deferred_imports_are_resolved_and_type_checking_ones_left_out(tmp_path):
    source = (
        "from typing import TYPE_CHECKING\nfrom . import b\nfrom .c import thing\n"
        "if TYPE_CHECKING:\n    from .d import Other\n"
        "def later():\n    from .sub import leaf\n"
    )
    modules = dict.fromkeys(
        ["gspo_trl.a", "gspo_trl.b", "gspo_trl.c", "gspo_trl.d", "gspo_trl.sub", "gspo_trl.sub.leaf"]
    )
    path = tmp_path / "a.py"
    path.write_text(source)
    assert imported_modules("gspo_trl.a", path, modules) == {"gspo_trl.b", "gspo_trl.c", "gspo_trl.sub.leaf"}


def test_gspo_trl_has_no_import_cycle():
    modules = package_modules()
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert "gspo_trl.rollout.hf" in graph["gspo_trl.rollout"]  # the walk sees the package's imports
    assert import_cycles(graph) == []


# The project's limits (CONTRIBUTING.md): a module a reader holds in mind; the trainer orchestrates only.
MAX_MODULE_LINES = 600
MAX_TRAINER_LINES = 500


def test_every_module_opens_with_a_docstring_saying_what_it_owns():
    missing = [name for name, path in package_modules().items() if not ast.get_docstring(ast.parse(path.read_text()))]
    assert missing == []


def test_no_module_is_longer_than_the_limit_and_the_trainer_stays_an_orchestrator():
    lengths = {name: len(path.read_text().splitlines()) for name, path in package_modules().items()}
    assert {name: n for name, n in lengths.items() if n > MAX_MODULE_LINES} == {}
    assert lengths["gspo_trl.trainer"] <= MAX_TRAINER_LINES


# The top level a newcomer reads as the pipeline, and the order the stages import each other in: a module imports only
# from its own entry or from entries below it (the trainer from everything, `models` from none of the others). The
# package's `__init__` imports nothing when it loads (its names load on first use); the trainer reads its version.
ENTRIES_TOP_DOWN = [
    "demo",  # the `gspo-trl` command and its default run: drives the trainer
    "trainer",
    "data",  # what the user hands the trainer, checked
    "config",
    "scoring",  # completions -> rewards -> advantages
    "training",  # a scored rollout -> optimizer steps
    "objective",  # the loss's math
    "reporting",
    "rollout",  # prompts -> completions, by any engine, with its decoding loops and environments
    "vllm",
    "models",
]
MAX_TOP_LEVEL_ENTRIES = 12


def top_level_entry(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_the_top_level_shows_the_pipeline_in_at_most_a_dozen_entries():
    entries = sorted(path.name for path in PACKAGE_ROOT.iterdir() if path.name != "__pycache__")
    assert len(entries) <= MAX_TOP_LEVEL_ENTRIES, entries
    named = {name.removesuffix(".py") for name in entries} - {"__init__"}
    assert named == set(ENTRIES_TOP_DOWN), "a new top-level entry needs its place in ENTRIES_TOP_DOWN (and a reason)"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """The arrows of `graph` from an entry to an entry above it in `ENTRIES_TOP_DOWN`."""
    rank = {entry: position for position, entry in enumerate(ENTRIES_TOP_DOWN)}
    upward = []
    for name, targets in sorted(graph.items()):
        source = top_level_entry(name)
        for target in sorted(targets):
            destination = top_level_entry(target)
            if source in rank and destination in rank and rank[destination] < rank[source]:
                upward.append(f"{name} -> {target}")
    return upward


def test_an_arrow_back_up_is_found_and_arrows_down_or_within_an_entry_are_not():
    graph = {
        "gspo_trl.models.loading": {"gspo_trl.training.schedule", "gspo_trl.models.precision"},
        "gspo_trl.trainer": {"gspo_trl.models.loading", "gspo_trl"},
    }
    assert upward_imports(graph) == ["gspo_trl.models.loading -> gspo_trl.training.schedule"]


def test_imports_run_down_the_stages_never_back_up():
    modules = package_modules()
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert upward_imports(graph) == []
