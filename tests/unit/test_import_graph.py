"""Imports run one way (docs/architecture.md): no circle between modules, lazy imports inside functions included,
and every package imports only packages of a lower layer. grimp builds the graph from the source, so a new arrow
back up fails here with the chain that makes it."""
from __future__ import annotations

import grimp
import pytest

#: Top to bottom; a package imports only from layers below its own. The packages of a set do not import each
#: other. The root module (rlstream/__init__.py) is the package's face and imports nothing.
LAYERS = (
    {"rlstream.cli", "rlstream.demo"},
    {"rlstream.recipes", "rlstream.gateway", "rlstream.stages", "rlstream.trainer", "rlstream.monitoring"},
    {"rlstream.archive", "rlstream.infra"},
    {"rlstream.engine", "rlstream.envs", "rlstream.rewards"},
    {"rlstream.sources", "rlstream.runtime", "rlstream.models", "rlstream.sandbox"},
    {"rlstream.policy"},
    {"rlstream.kafka"},
    {"rlstream.schemas", "rlstream.metrics", "rlstream.config"},
    {"rlstream.errors"},
)


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("rlstream")


def test_every_package_is_in_a_layer(graph):
    placed = set().union(*LAYERS)
    top = {".".join(m.split(".")[:2]) for m in graph.modules if m != "rlstream"}
    assert top == placed, f"unplaced: {sorted(top - placed)}; gone: {sorted(placed - top)}"


def test_packages_import_only_layers_below_them(graph):
    illegal = graph.find_illegal_dependencies_for_layers(layers=LAYERS)
    # grimp's routes: heads (modules of the importing package), the middle, tails (of the imported one).
    chains = [f"{d.importer} -> {d.imported}: {[[*sorted(r.heads), *r.middle, *sorted(r.tails)] for r in d.routes][:2]}"
              for d in illegal]
    assert not chains, "\n".join(chains)


def test_no_circle_between_modules(graph):
    """Tarjan's strongly connected components over the module graph: each must be one module alone."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []
    # A package's __init__ re-exporting its own modules is its face, not a dependency: those edges are left out.
    edges = {m: {t for t in graph.find_modules_directly_imported_by(m) if not t.startswith(m + ".")}
             for m in graph.modules}

    def visit(v: str) -> None:  # recursive: the package's import depth is a few dozen at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for m in sorted(edges):
        if m not in index:
            visit(m)
    assert not circles, circles


def test_no_test_module_imports_another():
    """What tests share lives in tests/helpers (fixtures in conftest.py), so that moving, renaming or deleting a test
    module never breaks another's imports."""
    tests = grimp.build_graph("tests")
    suites = ("tests.unit", "tests.integration", "tests.e2e")
    imported = {m: sorted(tests.find_modules_that_directly_import(m)) for m in tests.modules
                if m.startswith(tuple(s + "." for s in suites))}
    assert not {m: by for m, by in imported.items() if by}, "import these from tests/helpers instead"
