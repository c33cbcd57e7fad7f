"""No import cycle among the modules of lora_runner, adapters, punica_kernels and kernel_tools; lora_runner's
layers import downward only; the kernel package imports nothing but itself.

The graph is read from the sources (tests/import_graph.py): every import counts, function-level ones and
those under ``if TYPE_CHECKING:`` included. The checker itself is tested on small packages written to tmp_path.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from import_graph import PACKAGES, cycle_path, import_cycles, import_graph

REPO_ROOT = Path(__file__).resolve().parent.parent


def write_package(root: Path, files: dict[str, str]) -> Path:
    """Write {relative path: source} under ``root`` (``__init__.py`` files included as given)."""
    for relative, source in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root


def describe(graph: dict[str, set[str]], cycles: list[list[str]]) -> str:
    return "\n".join(f"cycle of {len(c)} modules: {', '.join(c)}\n  e.g. {' -> '.join(cycle_path(graph, c))}"
                     for c in cycles)


def test_our_packages_have_no_import_cycle():
    graph = import_graph(REPO_ROOT, PACKAGES)
    assert {"lora_runner.engine.llm_engine", "adapters.tier", "punica_kernels.ops", "kernel_tools.aot"} <= graph.keys()
    cycles = import_cycles(graph)
    assert cycles == [], "import cycles (function-level and TYPE_CHECKING imports count):\n" + describe(graph, cycles)


# lora_runner's layers from the bottom: a module may import its own layer and the layers below it
LAYERS = [
    {"device", "sampling_params", "sampling_checks", "structured_outputs_params", "outputs", "request_times", "distributed"},  # plain values, no engine state; TP rank + collectives
    {"core", "model"},  # scheduling state (no tensors); the decoder (no scheduling)
    {"config", "sample", "spec_decode"},  # EngineConfig (reads core's fairness policies); sampling; speculation
    {"worker"},  # the device side of a step
    {"executor"},  # what runs the steps: the runner in this process, or one worker process per TP rank
    {"engine"},  # the step loop and its seams
    {"entrypoints", "serve", ""},  # LLM, the CLI, the HTTP server, Ray; the package's public names
]


def layer_of(module: str) -> int | None:
    """The LAYERS index of a lora_runner module (None outside lora_runner)."""
    parts = module.split(".")
    if parts[0] != "lora_runner":
        return None
    name = parts[1] if len(parts) > 1 else ""
    for rank, names in enumerate(LAYERS):
        if name in names:
            return rank
    raise AssertionError(f"{module} is in no layer of LAYERS: place lora_runner/{name} in one")


def test_lora_runner_layers_import_downward():
    graph = import_graph(REPO_ROOT, PACKAGES)
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                    if layer_of(a) is not None and layer_of(b) is not None and layer_of(b) > layer_of(a))
    assert upward == [], "imports from a lower layer into a higher one:\n" + "\n".join(upward)
    into_engine = sorted(f"{a} -> {b}" for a in graph if a.startswith("adapters")
                         for b in graph[a] if b.startswith(("lora_runner", "kernel_tools")))
    assert into_engine == [], "adapters never import the engine:\n" + "\n".join(into_engine)


def test_every_kernel_module_imports_only_kernels():
    """punica_kernels stands alone (tools that drive it, such as the AOT compiler, live in kernel_tools)."""
    graph = import_graph(REPO_ROOT, PACKAGES)
    kernels = [m for m in graph if m.split(".")[0] == "punica_kernels"]
    assert "punica_kernels.triton_ops" in kernels and "punica_kernels.host_tiles" in kernels
    outside = sorted(f"{a} -> {b}" for a in kernels for b in graph[a] if b.split(".")[0] != "punica_kernels")
    assert outside == [], "kernel modules importing outside punica_kernels:\n" + "\n".join(outside)


def test_a_cycle_closed_by_a_function_level_import_is_found(tmp_path):
    write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import helper\n",
        "pkg/b.py": """
            def helper():
                import pkg.a  # closes a -> b -> a at call time
                return pkg.a
            """,
        "pkg/c.py": "import pkg.b\n",  # depends on the cycle without being part of it
    })
    graph = import_graph(tmp_path, ["pkg"])
    assert import_cycles(graph) == [["pkg.a", "pkg.b"]]
    assert cycle_path(graph, ["pkg.a", "pkg.b"]) == ["pkg.a", "pkg.b", "pkg.a"]


def test_type_checking_imports_are_edges_and_close_cycles(tmp_path):
    write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": """
            from __future__ import annotations
            import typing
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from pkg.b import Thing
            if typing.TYPE_CHECKING:
                import pkg.c as c
            """,
        "pkg/b.py": """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                pass
            else:
                from pkg import a  # closes a -> b -> a
            """,
        "pkg/c.py": "",
    })
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.a"] == {"pkg.b", "pkg.c"} and graph["pkg.b"] == {"pkg.a"}
    assert import_cycles(graph) == [["pkg.a", "pkg.b"]]


def test_from_imports_of_submodules_relative_imports_and_package_inits_are_edges(tmp_path):
    write_package(tmp_path, {
        "pkg/__init__.py": "from pkg.sub import x\n",  # an __init__'s imports count
        "pkg/sub/__init__.py": "from . import leaf\nfrom .leaf import VALUE as x\n",
        "pkg/sub/leaf.py": """
            import os  # not one of our packages: no edge
            def late():
                from .. import names  # relative, two levels, to a submodule
                from ..names import NAME  # relative, to a module's attribute
            """,
        "pkg/names.py": "from pkg import sub\n",  # `sub` is a package: an edge to pkg.sub, not pkg
    })
    graph = import_graph(tmp_path, ["pkg"])
    assert graph == {"pkg": {"pkg.sub"}, "pkg.sub": {"pkg.sub.leaf"}, "pkg.sub.leaf": {"pkg.names"},
                     "pkg.names": {"pkg.sub"}}
    assert import_cycles(graph) == [["pkg.names", "pkg.sub", "pkg.sub.leaf"]]


def test_an_attribute_of_a_package_is_an_edge_to_its_init(tmp_path):
    write_package(tmp_path, {
        "pkg/__init__.py": "from pkg.engine import Engine\n",
        "pkg/engine.py": "def build():\n    from pkg import Engine\n    return Engine\n",
    })
    graph = import_graph(tmp_path, ["pkg"])
    assert graph == {"pkg": {"pkg.engine"}, "pkg.engine": {"pkg"}}
    assert import_cycles(graph) == [["pkg", "pkg.engine"]]
