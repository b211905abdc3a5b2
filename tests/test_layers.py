"""The package's structure holds: layers import only downward, no two files import each other, no
folder outgrows 20 modules, and the old import paths of moved modules still work.

The import graph is read from the source (``ast``: every ``import`` and ``from ... import``, at the top
of a file, inside a function or under ``TYPE_CHECKING``), so an import that only type checkers or one
code path see counts as much as any other. Run as a script it prints what it checks:

    python tests/test_layers.py      # folders with their lines, arrows that run up, circles
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Layers from the ground up (DESIGN.md); a module may import its own layer's and those below. A
# package not named here takes its parent's layer. kiln's own face (kiln/__init__.py) imports nothing
# of the layers: it names them lazily, so it stands on the ground with the small plain types.
LAYERS: list[tuple[str, ...]] = [
    ("kiln", "kiln._import_noise", "kiln._moved", "kiln.core", "kiln.metrics"),
    ("kiln.launch", "kiln.precision", "kiln.optim", "kiln.algorithms", "kiln.models"),
    ("kiln.parallel.state",),  # distributed state: meshes, DCP state dicts, gradient norms
    ("kiln.parallel.transforms",),  # the model transformations, in torchtitan's order
    ("kiln.parallel.pipelining",),  # pipeline runtime, schedules, stage boundary, tracing
    ("kiln.parallel",),  # the strategy interface, its registry, one file per strategy
    ("kiln.cost",),  # memory and seconds of a plan; strategy="auto" chooses by them
    ("kiln.engine", "kiln.loggers", "kiln.callbacks", "kiln.hooks", "kiln.report"),
    ("kiln.checkpoint",),
    ("kiln.trainer",),
    ("kiln.config",),
    ("kiln.planning",),  # the search and the dry run (which runs the build path below it)
    ("kiln.cli",),
]
MAX_MODULES = 20


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / "kiln").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """module -> the kiln modules it imports (a name imported from a package counts as the
    submodule when one has that name, else as the package)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                found = _resolve(target, modules) if target.split(".")[0] == "kiln" else None
                if found and found != name:
                    graph[name].add(found)
    return graph


def layer_of(module: str) -> int:
    best, rank = "", -1
    for index, names in enumerate(LAYERS):
        for prefix in names:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, rank = prefix, index
    assert rank >= 0, f"{module} is in no layer of LAYERS"
    return rank


def upward_arrows(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a))


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(sorted(members))
    return found


def folder_sizes() -> dict[str, tuple[int, int]]:
    """folder -> (its own modules, their lines)."""
    sizes: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for path in (SRC / "kiln").rglob("*.py"):
        folder = str(path.parent.relative_to(SRC))
        sizes[folder][0] += 1
        sizes[folder][1] += len(path.read_text().splitlines())
    return {folder: (count, lines) for folder, (count, lines) in sorted(sizes.items())}


def test_no_import_runs_up_a_layer() -> None:
    assert upward_arrows(import_graph()) == []


def test_no_two_files_import_each_other() -> None:
    assert circles(import_graph()) == []


def test_checks_see_a_circle_and_an_upward_arrow() -> None:
    # the two checks above, on a graph with one of each: they must not pass on anything
    graph = {"kiln.parallel.a": {"kiln.parallel.b"}, "kiln.parallel.b": {"kiln.parallel.a", "kiln.engine"}}
    graph["kiln.engine"] = set()
    assert circles(graph) == [["kiln.parallel.a", "kiln.parallel.b"]]
    assert upward_arrows(graph) == [("kiln.parallel.b", "kiln.engine")]


def test_no_folder_holds_more_than_20_modules() -> None:
    crowded = {folder: count for folder, (count, _) in folder_sizes().items() if count > MAX_MODULES}
    assert crowded == {}


def test_strategy_interface_imports_no_strategy() -> None:
    # the registry names every strategy by "module:Class" and imports it on first use
    graph = import_graph()
    strategies = {m for m in graph if m.count(".") == 2 and m.startswith("kiln.parallel.")} - {"kiln.parallel.strategy"}
    assert graph["kiln.parallel.strategy"] & strategies == set()
    assert not any(m.startswith("kiln.planning") or m.startswith("kiln.cost") for m in graph["kiln.parallel.strategy"])
    # the model wrappers know their architectures' TP plans and import no strategy code
    assert not any(m.startswith("kiln.parallel") for m in graph["kiln.models.huggingface"])


def test_old_module_paths_import_the_moved_modules() -> None:
    from kiln._moved import MOVED

    for old, new in MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    # documented forms (docs/planning.md, docs/strategies.md, docs/levers.md)
    from kiln.parallel.dry_run import dry_run
    from kiln.parallel.plan import format_table
    from kiln.planning.dry_run import dry_run as moved_dry_run

    assert dry_run is moved_dry_run and callable(format_table)
    import kiln

    assert (
        kiln.parallel.levers.applied_levers is importlib.import_module("kiln.parallel.transforms.levers").applied_levers
    )
    assert kiln.parallel.Auto.__module__ == "kiln.cost.auto" and kiln.parallel.get_strategy("auto").name == "single"
    assert kiln.parallel.plan_table.__module__ == "kiln.cost.memory"


def main() -> int:
    graph = import_graph()
    print("folder                           modules  lines")
    for folder, (count, lines) in folder_sizes().items():
        print(f"{folder:<32} {count:>7}  {lines:>5}")
    up = upward_arrows(graph)
    print(f"\nimports that run up a layer: {len(up)}")
    for a, b in up:
        print(f"  {a} -> {b}")
    found = circles(graph)
    print(f"files that import each other: {len(found)}")
    for members in found:
        print("  " + " <-> ".join(members))
    return 0


if __name__ == "__main__":
    sys.exit(main())
elif not SRC.is_dir():  # an installed kiln without its source tree: nothing to read
    pytest.skip("the structure checks read src/kiln", allow_module_level=True)
