"""Modes, storage tiers, cache policies, row optimizers and models are each named in one place, their registry, and
the code asks the registry what a name means (config.RUN_MODES' Mode, a tier class's attributes, planner.plan's
plans_ahead and evict.ONLINE_SCORES, a RowOptimizer class's, a model's ModelCard) instead of comparing names: a new
one is then added in its registry alone."""

from __future__ import annotations

import ast
import sys

from bagpipe.config import CACHE_MODES, MODES, OPTIMIZERS, POLICIES, STORAGE_KINDS
from bagpipe.models import CARDS
from helpers.paths import SRC
from helpers.source_tree import made_up_tree, modules

# name kind -> (its names, words that mark an expression as one of them, the files that may compare them)
REGISTRIES = {
    "mode": (set(MODES), ("mode",), set()),
    "storage kind": (set(STORAGE_KINDS), ("storage", "kind"), set()),
    "cache policy": (set(POLICIES), ("policy",), {"planner/plan.py", "planner/evict.py"}),
    "row optimizer": (set(OPTIMIZERS), ("optim", "name"), {"optim.py"}),
    "cache mode": (set(CACHE_MODES), ("cache_mode",), {"config.py"}),
    "model": (set(CARDS), ("model", "name"), {"models/__init__.py"}),
}


def _strings(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_strings(element) for element in node.elts)) if node.elts else set()
    return set()


def comparisons_of_names() -> list[str]:
    """Every comparison in src/ of an expression about a mode, a tier or a policy with one of their names."""
    found = []
    for module in modules(SRC):
        where, source = module.where, module.source
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            strings = set().union(*(_strings(operand) for operand in operands))
            if not strings:
                continue
            about = [ast.get_source_segment(source, operand) or "" for operand in operands if not _strings(operand)]
            for kind, (names, words, homes) in REGISTRIES.items():
                if where in homes:
                    continue
                if strings & names and any(word in text.lower() for text in about for word in words):
                    found.append(f"{where}:{node.lineno}: a {kind} compared by name: {ast.get_source_segment(source, node)}")
    return found


def test_no_mode_tier_or_policy_is_compared_by_name_outside_its_registry():
    assert comparisons_of_names() == []


def test_the_check_finds_a_comparison_by_name(tmp_path, monkeypatch):
    """(The check itself can fail.)"""
    fake = made_up_tree(tmp_path, {"x.py": 'def f(config):\n    return config.mode == "bagpipe" or config.storage in '
                                           '("disk",) or config.model.name != "external"\n'})
    monkeypatch.setattr(sys.modules[__name__], "SRC", fake)
    assert [line.split(": ")[1] for line in comparisons_of_names()] == ["a mode compared by name",
                                                                       "a storage kind compared by name",
                                                                       "a model compared by name"]
