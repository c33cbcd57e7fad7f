"""The import graph of our packages, read from source, and its cycles.

Every module's AST is parsed (nothing is imported): each ``import`` and ``from ... import`` anywhere in
the file counts, function-level ones included, because a function-level import that closes a circle
still ties the modules together (and runs in whatever order the first call happens), and those under
``if TYPE_CHECKING:`` too: they never run, but the annotations they serve tie the modules together all
the same (a type from a higher layer is a dependency on it). Imports of other packages (optional
third-party ones included) are not edges. A package's ``__init__.py`` is the module named after the package.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

PACKAGES = ("lora_runner", "adapters", "punica_kernels", "kernel_tools")


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """{dotted module name: file} of every .py file under ``root``/<package> (``__init__`` -> the package)."""
    files = {}
    for package in packages:
        for path in sorted((Path(root) / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(parts)] = path
    return files


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``: module level, in functions and classes, under any ``if``
    (``if TYPE_CHECKING:`` included)."""
    for child in ast.walk(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child


def _from_base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from X import ...`` reads from (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    # level 1 is the module's own package: the module itself for an __init__, its parent otherwise
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _known(name: str, modules: set[str]) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules`` (``import a.b.C`` style names)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def import_graph(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    """{module: the modules of ``packages`` it imports (anywhere in it)}, read from the sources under ``root``.

    ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``.
    """
    files = module_files(root, packages)
    modules = set(files)
    graph: dict[str, set[str]] = {module: set() for module in files}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [_known(alias.name, modules) for alias in node.names]
            else:
                base = _from_base(module, is_package, node)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else _known(base, modules)
                           for alias in node.names]
            graph[module].update(t for t in targets if t is not None and t != module)
    return graph


def strongly_connected_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): every component, each sorted, in no particular order."""
    index, lowlink, on_stack, stack, components = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = lowlink[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = lowlink[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.get(successor, ())))))
                    break
                if successor in on_stack:
                    lowlink[node] = min(lowlink[node], index[successor])
            else:  # every successor done: pop the node, close its component if it is a root
                work.pop()
                if work:
                    lowlink[work[-1][0]] = min(lowlink[work[-1][0]], lowlink[node])
                if lowlink[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The components of two or more modules (each a set of modules that import each other in a circle)."""
    return sorted(component for component in strongly_connected_components(graph) if len(component) > 1)


def cycle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One circle through the component's first module, as ``[a, b, ..., a]`` (breadth-first, shortest)."""
    members, start = set(component), component[0]
    previous, frontier = {start: None}, [start]
    while frontier:
        next_frontier = []
        for node in frontier:
            for successor in sorted(graph[node] & members):
                if successor == start:
                    path = [node]
                    while previous[path[-1]] is not None:
                        path.append(previous[path[-1]])
                    return path[::-1] + [start]  # start, ..., node, start
                if successor not in previous:
                    previous[successor] = node
                    next_frontier.append(successor)
        frontier = next_frontier
    raise AssertionError(f"{component} is not a cycle of the graph")
