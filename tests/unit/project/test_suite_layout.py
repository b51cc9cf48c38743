"""The suite's own shape: a test module imports what tests share from tests/helpers, never from another test
module (which would run that module's tests' imports and fixtures in this one, and tie two files' layouts)."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers.paths import TESTS
from helpers.source_tree import modules


def imports_of_test_modules(root: Path) -> list[str]:
    """Every import, anywhere in a module under ``root`` (in a function too), of a test module (``test_*``)."""
    found = []
    for module in modules(root):
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                if name.split(".")[-1].startswith("test_") or name.split(".")[0].startswith("test_"):
                    found.append(f"{module.where}:{node.lineno}: imports {name}")
    return found


def test_no_test_module_imports_another():
    assert imports_of_test_modules(TESTS) == []


def test_the_check_finds_a_test_module_importing_another(tmp_path):
    """(The check itself can fail.)"""
    (tmp_path / "test_a.py").write_text("def test_x():\n    from test_b import helper\n")
    (tmp_path / "test_b.py").write_text("import helpers.jobs\n")
    assert imports_of_test_modules(tmp_path) == ["test_a.py:2: imports test_b"]


def test_every_test_module_is_in_a_tier_and_the_unit_tier_mirrors_src():
    """tests/unit/ holds the tests that start no process, in folders named as src/bagpipe's packages (and project/:
    the repository's own rules, docs, layout); tests/integration/ the ones that start processes (tests/conftest.py
    marks them and fails any other test that starts one)."""
    from helpers.paths import SRC

    modules = [path.relative_to(TESTS) for path in TESTS.rglob("test_*.py")]
    assert modules and all(path.parts[0] in ("unit", "integration") for path in modules), \
        [str(path) for path in modules if path.parts[0] not in ("unit", "integration")]
    packages = {path.relative_to(SRC).parent for path in SRC.rglob("__init__.py")} | {Path("project")}
    folders = {Path(*path.parts[1:]).parent for path in modules if path.parts[0] == "unit"}
    assert folders <= packages, sorted(map(str, folders - packages))
    assert not list((TESTS / "integration").rglob("*/test_*.py")), "tests/integration/ is one folder"
