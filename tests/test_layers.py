"""The package's layers: each module imports only its own layer and the layers above it, no import
closes a circle (lazy or not), and a module past 500 lines says why it is one concept.

The layers, top to bottom (see docs/architecture.md)::

    vocabulary  splits samples validate cancel background host timeline/ schedules/ devices/
    engine      gpipe pipeline worker microbatch checkpoint rng_guard batchnorm stream copy dependency phony skip/ training
    predict     profiling/ predict/ balance/ (predict/ and balance_by_time time layers with profiling/, never the reverse)
    plan        plan
    models      models/ (tracing)
    execute     executors/ backend/
    export      export/
    page        widgets/ magics examples, the package itself
"""
from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "pipexplore"

LAYERS = {
    "vocabulary": ["splits", "samples", "validate", "cancel", "background", "host", "timeline", "schedules", "devices"],
    "engine": ["gpipe", "pipeline", "worker", "microbatch", "checkpoint", "batchnorm", "stream", "copy", "dependency",
               "phony", "skip", "training", "rng_guard"],
    # profiling/ times layers on the devices here and imports nothing of predict/ or balance/, which read it
    "predict": ["profiling", "predict", "balance"],
    "plan": ["plan"],
    "models": ["models"],
    "execute": ["executors", "backend"],
    "export": ["export", "runs"],
    "page": ["widgets", "magics", "examples", ""],
}
ORDER = list(LAYERS)
LAYER_OF = {top: layer for layer, tops in LAYERS.items() for top in tops}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    found["pipexplore.predict._sharing"] = PACKAGE / "predict" / "_sharing.c"  # the compiled simulator loop
    return found


MODULES = _modules()


def _layer(module: str) -> str:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    if top not in LAYER_OF:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS in tests/test_layers.py and docs/architecture.md")
    return LAYER_OF[top]


def _without_type_checking(tree: ast.Module) -> ast.Module:
    """``tree`` without its ``if TYPE_CHECKING:`` blocks (imports for annotations only, never run)."""
    class Strip(ast.NodeTransformer):
        def visit_If(self, node: ast.If) -> ast.AST | None:
            return None if "TYPE_CHECKING" in ast.unparse(node.test) else self.generic_visit(node)

    return Strip().visit(tree)


def _imports(module: str, path: pathlib.Path, *, top_level_only: bool) -> set[str]:
    """The pipexplore modules ``module`` imports (``from pipexplore import x`` counts as ``pipexplore.x``
    where x is a module); with ``top_level_only=False`` those imported inside functions too, but
    not those under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(_without_type_checking(tree)))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name.startswith("pipexplore") and name != module:
                found.add(name)
    return found


REAL = {m: p for m, p in MODULES.items() if p.suffix == ".py"}


@pytest.mark.parametrize("module", sorted(REAL))
def test_imports_point_up_the_layers(module):
    layer = ORDER.index(_layer(module))
    wrong = sorted(f"{name} ({_layer(name)})" for name in _imports(module, REAL[module], top_level_only=False)
                   if ORDER.index(_layer(name)) > layer)
    assert not wrong, f"{module} ({_layer(module)}) imports from layers below it: {', '.join(wrong)}"


def _circle(graph: dict[str, set[str]]) -> list[str]:
    """The first circle of imports in ``graph`` (module -> the modules it imports), or [] where none.
    A package's ``__init__`` importing its own modules is how packages export; a module importing its
    package's ``__init__`` back closes the circle, and is counted."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt == node.rpartition(".")[0] and MODULES.get(nxt, PACKAGE).name == "__init__.py" \
                    and node in graph.get(nxt, ()):
                return [nxt, node, nxt]
            if state.get(nxt) == 1:
                circle = stack[stack.index(nxt):] + [nxt]
                if not all(MODULES.get(a, PACKAGE).name == "__init__.py" and b.startswith(a + ".")
                           for a, b in zip(circle, circle[1:])):
                    return circle
            elif nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_no_import_closes_a_circle_lazy_or_not():
    """Imports inside functions count (a lazy import is a dependency all the same); those under
    ``if TYPE_CHECKING:`` do not (they are never run)."""
    graph = {m: {n for n in _imports(m, p, top_level_only=False) if n in REAL and not n == "pipexplore"}
             for m, p in REAL.items() if m != "pipexplore"}
    circle = _circle(graph)
    assert not circle, "circle: " + " -> ".join(circle)


def test_the_circle_check_sees_a_lazy_circle(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from pipexplore.models import meta\n")
    b.write_text("def f():\n    from pipexplore.plan import Plan\n")
    c = tmp_path / "c.py"
    c.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pipexplore.plan import Plan\n")
    graph = {"pipexplore.plan": _imports("pipexplore.plan", a, top_level_only=False),
             "pipexplore.models.meta": _imports("pipexplore.models.meta", b, top_level_only=False)}
    assert _circle(graph) == ["pipexplore.models.meta", "pipexplore.plan", "pipexplore.models.meta"]
    assert _imports("pipexplore.models.meta", c, top_level_only=False) == set()  # for annotations only


def test_the_checks_see_a_wrong_import(tmp_path):
    """The layer check is not vacuous: an engine module importing the explorer is caught."""
    path = tmp_path / "gpipe.py"
    path.write_text("from pipexplore.widgets import explorer\n")
    assert _imports("pipexplore.gpipe", path, top_level_only=False) == {"pipexplore.widgets.explorer"}
    assert ORDER.index(_layer("pipexplore.widgets.explorer")) > ORDER.index(_layer("pipexplore.gpipe"))


def test_a_module_past_500_lines_says_why_it_is_one():
    """Modules end where their concept does, not at a line count: one past 500 lines says in its
    docstring why it is one concept ("Why one module: ..."), and none passes 800."""
    unexplained, huge = [], []
    for path in PACKAGE.rglob("*.py"):
        lines = len(path.read_text().splitlines())
        if lines > 800:
            huge.append(f"{path.relative_to(PACKAGE.parent)} ({lines} lines)")
        elif lines > 500 and "Why one module:" not in (ast.get_docstring(ast.parse(path.read_text())) or ""):
            unexplained.append(f"{path.relative_to(PACKAGE.parent)} ({lines} lines)")
    assert not huge, "split these modules: " + ", ".join(huge)
    assert not unexplained, "split these by concept, or say in the docstring why each is one: " + ", ".join(unexplained)