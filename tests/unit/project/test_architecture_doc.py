"""docs/architecture.md names only what exists, and stays readable.

Every class-like name in its inline code (`RowCache`, `cache.RowCache`, `RowCache.install`, ...) must be a class
defined under src/ (or one of the few torch classes listed below), every `.py` path it names must exist, and no
line may pass 200 characters. Pure text: torch is not imported (its classes are looked up in its source files).
"""

from __future__ import annotations

import importlib.util
import keyword
import re
from functools import cache
from pathlib import Path
from helpers.paths import REPO as ROOT, TESTS

DOC = ROOT / "docs" / "architecture.md"
SRC = ROOT / "src"
PATH_BASES = (SRC / "bagpipe", SRC, ROOT, TESTS)  # a path in the document is relative to one of these
MAX_LINE = 200

# Class-like names the document may use that are not bagpipe's: torch's classes, each with the file of the torch
# package that defines it (checked there). Keep this short: a name of the project's belongs in src/.
TORCH_CLASSES = {
    "EmbeddingBag": "nn/modules/sparse.py",  # `nn.EmbeddingBag`: what bagpipe.nn equals bit for bit
}

_FENCED = re.compile(r"^```.*?^```", re.M | re.S)
_SPAN = re.compile(r"`([^`\n]+)`")
# A name that starts with a capital (after at most one underscore) and has a lower-case letter: `RowCache`,
# `_OnceScan`, `Oracle`; not constants (`REDO_DEPTH`, `PAD`) nor store keys (`bagpipe/replace/RANK`).
_CLASS_LIKE = re.compile(r"(?<![\w])_?[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*(?![\w])")
_PY_PATH = re.compile(r"[\w./<>*-]*\.py\b")
_MODULE_ATTR = re.compile(r"^((?:[a-z_]\w*/)+[a-z_]\w*)\.[A-Za-z_]\w*")  # `planner/evict.OnlineHistory`
_CLASS_DEF = re.compile(r"^\s*class\s+(\w+)\s*[(:]|^(\w+) = dataclasses\.make_dataclass\(", re.M)  # (config.ModelConfig)


def code_spans(text: str) -> list[str]:
    """The inline code of a Markdown text (fenced blocks left out)."""
    return _SPAN.findall(_FENCED.sub("", text))


@cache
def source_classes() -> frozenset[str]:
    return frozenset(name for path in SRC.rglob("*.py") for names in _CLASS_DEF.findall(path.read_text())
                     for name in names if name)


def torch_defines(name: str) -> bool:
    spec = importlib.util.find_spec("torch")  # finds the package without importing it
    if name not in TORCH_CLASSES or spec is None or spec.origin is None:
        return False
    source = Path(spec.origin).parent / TORCH_CLASSES[name]
    return source.is_file() and re.search(rf"^class\s+{name}\b", source.read_text(), re.M) is not None


def missing_classes(text: str) -> list[str]:
    names = {name for span in code_spans(text) for name in _CLASS_LIKE.findall(span) if not keyword.iskeyword(name)}
    return sorted(name for name in names if name not in source_classes() and not torch_defines(name))


def _exists(relative: str) -> bool:
    return any((base / relative).exists() for base in PATH_BASES)


def missing_paths(text: str) -> list[str]:
    """`.py` paths, and the module of `dir/module.name` forms, that exist under none of PATH_BASES
    (placeholders and patterns such as `models/<name>.py` and `examples/*.py` left out)."""
    missing = set()
    for span in code_spans(text):
        for path in _PY_PATH.findall(span):
            if not re.search(r"[<*]", path) and not _exists(path):
                missing.add(path)
        module = _MODULE_ATTR.match(span)
        if module and ".py" not in span and not _exists(module.group(1) + ".py"):
            missing.add(module.group(1) + ".py")
    return sorted(missing)


def long_lines(text: str) -> list[str]:
    return [f"line {n}: {len(line)} characters" for n, line in enumerate(text.splitlines(), 1) if len(line) > MAX_LINE]


def test_every_class_the_document_names_exists():
    assert missing_classes(DOC.read_text()) == [], "classes named in docs/architecture.md that no longer exist"


def test_every_module_path_the_document_names_exists():
    assert missing_paths(DOC.read_text()) == [], f"paths relative to none of {[str(b) for b in PATH_BASES]}"


def test_no_line_of_the_document_is_longer_than_200_characters():
    assert long_lines(DOC.read_text()) == []


def test_the_checks_find_what_does_not_exist():
    text = ("The cache is `RowCache` (`cache.RowCache.install`) over `nn.EmbeddingBag(sparse=True)`; once it was "
            "`MemoryTable`, then `nn/host.DiskTable.read` in `nn/hosts.py` and `planner/evicts.highest`; "
            "`models/<name>.py`, `examples/*.py`, `REDO_DEPTH` and `bagpipe/replace/RANK` are no classes or paths.\n"
            "```\nFencedAway  not inline code\n```\n")
    assert missing_classes(text) == ["DiskTable", "MemoryTable"]
    assert missing_paths(text) == ["nn/hosts.py", "planner/evicts.py"]
    assert long_lines("x" * MAX_LINE + "\n" + "y" * (MAX_LINE + 1)) == [f"line 2: {MAX_LINE + 1} characters"]
    assert not torch_defines("Tensor")  # only the listed torch names count
