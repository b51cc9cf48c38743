"""Data preparation runs one way, down: data/prepare.py alone decides "prepared and fresh, else convert" and calls
the converter (data/preprocess.py), the record of its sources (data/sources.py) and the binary layout
(data/binary.py) beneath it; none of those imports a module above it, and prepare.py names no file of the layout.

Checked on the source text (ast), so the check can be shown to fail on a made-up tree."""

from __future__ import annotations

import ast
import sys

from helpers.paths import SRC
from helpers.source_tree import made_up_tree, modules

# Each module of the preparation path by its layer, top first; every other module of data/ (the format readers,
# the binary layout, what reads batches) lies beneath them all.
LAYERS = {"data/prepare.py": 3, "data/preprocess.py": 2, "data/sources.py": 1}
# A call of these names decides whether data is current or converts it: only the deciding module makes one, and
# the command that converts on request (`bagpipe preprocess`) calls the converter itself.
DECISIONS = {"preprocess": {"data/prepare.py", "cli.py"}, "why_stale": {"data/prepare.py"},
             "ensure_preprocessed": {"data/prepare.py", "preflight.py"}}
# What the deciding module leaves to data.binary: the names of the layout's files and its writing and reading.
LAYOUT_TEXTS = (".json", ".f32", "ids.")
LAYOUT_CALLS = {"read_record", "write_record", "SplitWriter", "BinarySplit", "file_checksum"}


def _layer(where: str) -> int:
    return LAYERS.get(where, 0)


def _data_imports(tree: ast.AST) -> set[str]:
    """The data/ modules a module imports, as paths under src/bagpipe (``data/binary.py``)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = ([f"{node.module}.{alias.name}" for alias in node.names] if node.module == "bagpipe.data"
                     else [node.module])
        else:
            continue
        found |= {"data/" + name.split(".")[2] + ".py" for name in names if name.startswith("bagpipe.data.")}
    return found


def _called(node: ast.Call) -> str | None:
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def layering_faults() -> list[str]:
    """Every import of a module above the importer, call of a decision outside its places, and layout detail in
    the deciding module, under SRC."""
    faults = []
    for module in modules(SRC):
        where, tree = module.where, module.tree
        prose = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}  # docstrings
        if where.startswith("data/"):
            for target in sorted(_data_imports(tree)):
                if _layer(target) > _layer(where):
                    faults.append(f"{where} imports {target}, which lies above it")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (name := _called(node)) in DECISIONS and where not in DECISIONS[name]:
                faults.append(f"{where}:{node.lineno} calls {name}, which only {sorted(DECISIONS[name])} may")
            if where != "data/prepare.py":
                continue
            if isinstance(node, ast.Call) and _called(node) in LAYOUT_CALLS:
                faults.append(f"{where}:{node.lineno} calls {_called(node)}: the layout's own (data/binary.py)")
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose
                    and any(text in node.value for text in LAYOUT_TEXTS)):
                faults.append(f"{where}:{node.lineno} names a file of the layout: {node.value!r}")
    return faults


def test_data_preparation_is_layered_one_way():
    assert layering_faults() == []


def test_the_check_finds_each_kind_of_fault(tmp_path, monkeypatch):
    """(The check itself can fail.)"""
    fake = made_up_tree(tmp_path, {
        "data/binary.py": "from bagpipe.data.prepare import converted_path\n",
        "data/sources.py": "from bagpipe.data import preprocess\n"
                           "def f(path):\n    return preprocess.preprocess(path, path)\n",
        "data/prepare.py": "from bagpipe.data.binary import read_record\n"
                           "def f(cached):\n    return read_record(cached / 'meta.json')\n",
        "runner.py": "from bagpipe.data.sources import why_stale\ndef g():\n    return why_stale(None)\n"})
    monkeypatch.setattr(sys.modules[__name__], "SRC", fake)
    assert layering_faults() == [
        "data/binary.py imports data/prepare.py, which lies above it",
        "data/prepare.py:3 calls read_record: the layout's own (data/binary.py)",
        "data/prepare.py:3 names a file of the layout: 'meta.json'",
        "data/sources.py imports data/preprocess.py, which lies above it",
        "data/sources.py:3 calls preprocess, which only ['cli.py', 'data/prepare.py'] may",
        "runner.py:3 calls why_stale, which only ['data/prepare.py'] may",
    ]
