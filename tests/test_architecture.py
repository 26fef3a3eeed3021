"""The floors of sm120kit (docs/architecture.md): a module imports its own floor and the
floors below it, never one above, and never a package beside it on its floor. Read from
the source with ast, so that an import inside a function or under `if TYPE_CHECKING:`
counts as much as one at the top: a cycle hidden in a function is still a cycle, between
packages and between the modules of one package alike.

FLOORS is the one table of them; the diagram in docs/architecture.md is drawn from it."""

from __future__ import annotations

import ast
import importlib
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "sm120kit"
DOC = PACKAGE.parent / "docs" / "architecture.md"

# Lowest first: (name, the packages or top modules of sm120kit on it). "sm120kit" is the
# package's own __init__ (its version). The leaves import nothing of sm120kit's but each other.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    (
        "leaves",
        (
            "sm120kit",
            "errors",
            "exit_codes",
            "textcheck",
            "path_limits",
            "shallow_json",
            "search_paths",
            "target",
            "urls",
            "report",
            "caches",
            "atomic_write",
            "endpoint",
            "wheels",
            "cuda_toolkit",
            "followup",
            "model_config",
            "child_process",
            "target_script",
        ),
    ),
    ("patching", ("patching",)),
    ("profiles", ("profiles",)),
    ("tune", ("tune",)),
    ("catalogue", ("catalogue",)),
    ("resolution", ("resolution",)),
    ("node", ("node",)),
    ("quality", ("quality",)),
    ("serve", ("serve",)),
    ("fleet", ("fleet",)),
    ("commands", ("bench", "deploy", "doctor", "tryout")),
    ("cli", ("cli",)),
    ("main", ("__main__",)),  # `python -m sm120kit`
]
LEAVES = FLOORS[0][0]


def floor_of(unit: str) -> int:
    for level, (_, units) in enumerate(FLOORS):
        if unit in units:
            return level
    raise KeyError(unit)


def modules() -> dict[str, Path]:
    """Every module of sm120kit by dotted name (a package by its __init__)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def unit_of(module: str) -> str:
    """The package or top module of sm120kit that `module` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def imported(module: str, path: Path, known: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, module of sm120kit) for every import in the file, at any depth."""
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:  # `from sm120kit import report` imports the module report
                name = f"{source}.{alias.name}"
                found.append((node.lineno, name if name in known else source))
    return [(line, name) for line, name in found if name == "sm120kit" or name.startswith("sm120kit.")]


def test_every_package_and_top_module_has_a_floor():
    units = {unit_of(m) for m in modules()}
    placed = {u for _, floor in FLOORS for u in floor}
    assert units - placed == set(), "add them to FLOORS (and the diagram in docs/architecture.md)"
    assert placed - units == set(), "FLOORS names what is not there"


def test_no_module_imports_a_floor_above_it_or_a_package_beside_it():
    known = modules()
    wrong = []
    for module, path in known.items():
        here = unit_of(module)
        for line, target in imported(module, path, known):
            there = unit_of(target)
            if there == here:
                continue
            if floor_of(there) > floor_of(here):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {module} imports {target}, a floor above")
            elif floor_of(there) == floor_of(here) and FLOORS[floor_of(here)][0] != LEAVES:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {module} imports {target}, beside it")
    assert wrong == [], "\n".join(wrong)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of sm120kit it imports (a package's __init__ by the package's name)."""
    known = modules()
    return {m: {t for _, t in imported(m, p, known) if t in known and t != m} for m, p in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = import_graph()
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    planted = {**graph, "sm120kit.report": graph["sm120kit.report"] | {"sm120kit.errors"}}
    planted["sm120kit.errors"] = graph["sm120kit.errors"] | {"sm120kit.report"}
    assert ["sm120kit.errors", "sm120kit.report"] in cycles(planted)


def test_no_module_cycle_even_inside_a_package():
    found = cycles(import_graph())
    assert found == [], "modules that import each other (at any depth):\n" + "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("module", sorted(set(modules()) - {"sm120kit.__main__"}))  # that one runs the cli
def test_every_module_imports(module):
    importlib.import_module(module)


def diagram() -> str:
    """The floors top first, as docs/architecture.md draws them."""
    indent = " " * (max(len(name) for name, _ in FLOORS) + 2)
    lines = [
        textwrap.fill(" ".join(units), 88, initial_indent=f"{name:<{len(indent)}}", subsequent_indent=indent)
        for name, units in reversed(FLOORS)
    ]
    return "\n".join(lines)


def test_the_documented_diagram_is_the_table():
    assert f"```text\n{diagram()}\n```" in DOC.read_text(), f"docs/architecture.md should draw:\n{diagram()}"


def test_the_documented_map_names_every_package_and_top_module():
    """docs/architecture.md is the one map of the code (docs/development.md points to it): each
    package and top module of FLOORS is named there, as a floor (**name**) or as `name`."""
    text = DOC.read_text()
    units = {u for _, floor in FLOORS for u in floor} - {"sm120kit", "__main__"}
    assert sorted(u for u in units if f"`{u}`" not in text and f"**{u}**" not in text) == []


def test_a_models_config_is_read_through_the_leaf_not_tune():
    """The launch rules read the model's config.json through the leaf sm120kit.model_config:
    what a config holds is no business of tune-moe's, which reads it through the same leaf."""
    graph = import_graph()
    readers = {m: sorted(t for t in graph[m] if t.startswith("sm120kit.tune")) for m in graph}
    assert {m: t for m, t in readers.items() if t and m.startswith("sm120kit.catalogue")} == {}
    assert "sm120kit.model_config" in graph["sm120kit.catalogue.rules"]
    assert "sm120kit.model_config" in graph["sm120kit.tune.model_config"]
