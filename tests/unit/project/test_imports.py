"""The package's structure: no import cycle, torch's private state touched in one module, no role in a module
global, and every endpoint a caller may name answered by its role's handlers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers.paths import SRC as PACKAGE

TRANSPORT = "bagpipe.runtime.transport"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _run_time_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:`` (imports for annotations only, never run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at the top or inside a function (an import inside a function
    that completes a cycle is a cycle all the same). A module's own packages are not counted: Python imports them
    first in any case."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _run_time_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            else:
                continue
            for target in targets:
                found = resolve(target) if target.startswith("bagpipe") else None
                if found and found != name and not name.startswith(found + "."):
                    graph[name].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_inside_the_package():
    graph = import_graph()
    assert "bagpipe.runtime.endpoints" in graph["bagpipe.runtime.trainer.runtime"]  # (the graph sees imports at all)
    assert cycles(graph) == []


def _torch_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names
                      if alias.name.split(".")[0] == "torch"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def private_torch_attributes(source: str) -> list[str]:
    """Attribute chains rooted at a name bound to torch (``torch``, ``rpc``, ``dist``, ...) that reach a private
    attribute (``rpc._init_counter``, ``dist.ProcessGroupGloo._Options``)."""
    tree = ast.parse(source)
    torch_names = _torch_names(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain, root = [node.attr], node.value
        while isinstance(root, ast.Attribute):
            chain.append(root.attr)
            root = root.value
        if isinstance(root, ast.Name) and root.id in torch_names and any(
                part.startswith("_") and not part.startswith("__") for part in chain):
            found.append(ast.unparse(node))
    return found


def test_the_private_torch_finder_finds_them():
    source = "import torch.distributed.rpc as rpc\nimport torch\nrpc._init_counter = 0\nx = torch.nn.Linear\n"
    assert private_torch_attributes(source) == ["rpc._init_counter"]


def test_torch_private_state_is_touched_in_the_transport_only():
    modules = _modules()
    touching = {name: found for name, path in modules.items() if (found := private_torch_attributes(path.read_text()))}
    assert set(touching) == {TRANSPORT}, touching


def test_no_role_state_in_module_globals():
    """Role objects live in the objects that run them; a handler finds its role through the object it was served
    with (runtime/transport.py), never through a module global assigned at run time."""
    assigning = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
                 for path in (PACKAGE / "runtime").rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Global)]
    assert assigning == []


@pytest.mark.parametrize("endpoints, handlers", [
    ("ORACLE", ("bagpipe.runtime.oracle.service", "Oracle")),
    ("SERVER", ("bagpipe.runtime.server.handlers", "ServerHandlers")),
    ("TRAINER", ("bagpipe.runtime.trainer.handlers", "TrainerHandlers"))])
def test_every_endpoint_is_answered_by_its_roles_handlers(endpoints, handlers):
    import importlib

    from bagpipe.runtime import endpoints as declared
    from bagpipe.runtime.transport import Endpoint

    module, name = handlers
    served = getattr(importlib.import_module(module), name)
    named = [value for value in vars(getattr(declared, endpoints)).values() if isinstance(value, Endpoint)]
    assert named and {endpoint.service for endpoint in named} == {endpoints.lower()}
    missing = [endpoint.method for endpoint in named if not callable(getattr(served, endpoint.method, None))]
    assert missing == []
