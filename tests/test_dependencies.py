"""Every package gspo_trl imports is declared in pyproject.toml: in `dependencies`, or in the extra of the feature
that imports it. An undeclared import works only where something else happened to install it."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def normalised(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def declared_distributions() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    return {normalised(re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0)) for requirement in requirements}


def imported_top_level_names() -> dict[str, str]:
    """Each third-party top-level name gspo_trl imports -> one module importing it."""
    found = {}
    for path in sorted((ROOT / "gspo_trl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "gspo_trl":
                    found.setdefault(top, path.relative_to(ROOT).as_posix())
    return found


def distributions_of(import_name: str) -> set[str]:
    """The distributions that provide `import_name` here, or the name itself where none is installed (vllm)."""
    provided = importlib.metadata.packages_distributions().get(import_name)
    return {normalised(d) for d in provided} if provided else {normalised(import_name)}


def test_every_imported_package_is_declared():
    declared = declared_distributions()
    undeclared = {
        name: where for name, where in imported_top_level_names().items() if not distributions_of(name) & declared
    }
    assert undeclared == {}


def test_the_check_sees_imports_that_differ_from_their_distribution_names():
    names = imported_top_level_names()
    assert {"torch", "requests", "yaml", "PIL"} <= set(names)
    assert "pyyaml" in distributions_of("yaml") and "pillow" in distributions_of("PIL")
