"""No module of src/ keeps state that grows or changes while the program runs, beyond the few listed here with
their reasons: state belongs to objects with a lifetime (a group's sums thread closes with it, runtime/reduce.py).
Beyond `global` statements, any function that mutates a module-level container (item assignment or deletion,
append, add, update, setdefault, pop, clear, ...) is found."""

from __future__ import annotations

import ast
from helpers.paths import SRC
from helpers.source_tree import modules

MUTATORS = {"append", "extend", "insert", "add", "update", "setdefault", "pop", "popitem", "clear", "remove",
            "discard", "appendleft", "popleft"}
# module:name -> why it is process state by nature
ALLOWED = {
    "storage/tiers.py:TIERS": "the tier registry, filled by @tier as the tier modules are imported",
    "cli.py:_WAKEUP": "the one socket pair Ctrl-C's wakeup byte travels through, for the process's life",
    "runtime/world.py:_LISTENERS": "the sockets the process's master store serves on, open for its life",
    "runtime/transport.py:_RENDEZVOUS": "torch keeps rendezvous handlers process-wide: the store of the RPC world "
                                        "being joined, replaced at each join",
    "faults.py:_FAULTS": "the process's faults, read from its environment (again in a forked child)",
    "faults.py:_ROLE": "the process's name in the job, for its faults",
}


def module_state() -> dict[str, list[str]]:
    """Each module-level name that a function of its module rebinds (``global``) or mutates, with where."""
    found: dict[str, list[str]] = {}
    for module in modules(SRC):
        where, tree = module.where, module.tree
        names = {target.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                 for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                 if isinstance(target, ast.Name)}
        functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for function in functions:
            local = {arg.arg for arg in function.args.args + function.args.kwonlyargs}
            for node in ast.walk(function):
                hit = None
                if isinstance(node, ast.Global):
                    for name in node.names:
                        found.setdefault(f"{where}:{name}", []).append(f"line {node.lineno}: global")
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and node.func.attr in MUTATORS and isinstance(node.func.value, ast.Name)):
                    hit = node.func.value.id
                elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                    targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                    hit = next((t.value.id for t in targets if isinstance(t, ast.Subscript)
                                and isinstance(t.value, ast.Name)), None)
                if hit is not None and hit in names and hit not in local and not _bound_in(function, hit):
                    found.setdefault(f"{where}:{hit}", []).append(f"line {node.lineno}")
    return found


def _bound_in(function: ast.AST, name: str) -> bool:
    """Whether ``function`` binds ``name`` itself (a local of the same name shadows the module's)."""
    return any(isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store)
               for node in ast.walk(function))


def test_no_module_keeps_state_beyond_the_listed_few():
    found = module_state()
    assert {name: lines for name, lines in found.items() if name not in ALLOWED} == {}
    assert sorted(set(ALLOWED) - set(found)) == [], "listed, but no longer module state: take it off the list"
