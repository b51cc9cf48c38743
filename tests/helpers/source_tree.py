"""The code read as Python, for the tests that check rules on it (registries, data layers, module state, fault
points, the suite's own imports): each module's path, text and syntax tree; and made-up trees, to show that such a
check can fail."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Module:
    where: str  # its path under the tree's root, as "data/binary.py"
    source: str
    tree: ast.Module


def modules(root: Path) -> list[Module]:
    """Every ``.py`` file under ``root``, in path order."""
    found = []
    for path in sorted(root.rglob("*.py")):
        where = str(path.relative_to(root))
        source = path.read_text()
        found.append(Module(where, source, ast.parse(source, filename=where)))
    return found


def made_up_tree(root: Path, files: dict[str, str]) -> Path:
    """A package folder ``root/bagpipe`` holding ``files`` (its path -> its text), for a check to be shown failing."""
    package = root / "bagpipe"
    for where, text in files.items():
        (package / where).parent.mkdir(parents=True, exist_ok=True)
        (package / where).write_text(text)
    return package
