"""Every import the README, docs and examples show works, and the flat module names of earlier releases still
import (the same module object, with a FutureWarning naming the new place)."""

from __future__ import annotations

import ast
import importlib
import re
import sys
import warnings
from pathlib import Path

import pytest

import gspo_trl

ROOT = Path(__file__).resolve().parents[1]
CODE_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def documented_imports() -> list[tuple[str, str]]:
    """(where, statement) for each `import gspo_trl...` / `from gspo_trl... import` in the user-facing files."""
    sources = [
        (path, CODE_BLOCK.findall(path.read_text())) for path in [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))]
    ]
    sources += [(path, [path.read_text()]) for path in sorted(ROOT.glob("examples/*.py"))]
    found = []
    for path, blocks in sources:
        for block in blocks:
            for node in ast.walk(ast.parse(block)):
                names = [node.module] if isinstance(node, ast.ImportFrom) else []
                names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
                if any(name and name.split(".")[0] == "gspo_trl" for name in names):
                    found.append((path.relative_to(ROOT).as_posix(), ast.unparse(node)))
    return found


def test_the_docs_show_imports_to_check():
    shown = {statement for _, statement in documented_imports()}
    assert "from gspo_trl import GSPOConfig, GSPOTrainer" in shown
    assert len(shown) >= 5  # README, the docs' examples and the example scripts


@pytest.mark.parametrize(("where", "statement"), documented_imports())
def test_every_documented_import_works_without_a_warning(where, statement):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the docs show the current places, not the earlier names
        exec(statement, {})


@pytest.mark.parametrize("old", sorted(gspo_trl._MOVED))
def test_an_earlier_flat_name_imports_the_module_at_its_new_place(old):
    new = importlib.import_module(gspo_trl.moved_to(f"gspo_trl.{old}"))
    sys.modules.pop(f"gspo_trl.{old}", None)
    with pytest.warns(FutureWarning, match=re.escape(new.__name__)):
        earlier = importlib.import_module(f"gspo_trl.{old}")
    assert earlier is new


def test_a_submodule_of_a_moved_package_follows_it_and_unknown_names_still_fail():
    assert gspo_trl.moved_to("gspo_trl.decoding.cpu.kernel") == "gspo_trl.rollout.decoding.cpu.kernel"
    assert gspo_trl.moved_to("gspo_trl.environments.calculator") == "gspo_trl.demo.calculator"
    assert gspo_trl.moved_to("gspo_trl.objective.loss") is None
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("gspo_trl.no_such_module")


DOTTED = re.compile(r"gspo_trl(?:\.[A-Za-z_][A-Za-z_0-9]*)+")


def resolves(dotted: str) -> bool:
    """Whether `dotted` names a module of gspo_trl or an attribute of one (a function, a class, a constant)."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:end]))
        except ModuleNotFoundError:
            continue
        for name in parts[end:]:
            if not hasattr(target, name):
                return False
            target = getattr(target, name)
        return True
    return False


def test_every_dotted_name_the_docs_mention_resolves_at_its_current_place():
    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted(ROOT.glob("docs/*.md"))]
    mentioned = {(path.name, name) for path in files for name in DOTTED.findall(path.read_text())}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        broken = sorted((where, name) for where, name in mentioned if not resolves(name))
    assert len(mentioned) >= 5
    assert broken == []
