"""The module structure `docs/architecture.md` describes: no import cycles, and the
tracing layer does not depend on the transforms built on it."""

import ast
import pathlib

import eqstate


_ROOT = pathlib.Path(eqstate.__file__).parent


def _imports() -> dict[str, set[str]]:
    """Each module of eqstate, and the eqstate modules it imports at its top level."""
    graph: dict[str, set[str]] = {}
    for path in _ROOT.rglob("*.py"):
        parts = ("eqstate", *path.relative_to(_ROOT).with_suffix("").parts)
        package = parts if path.name == "__init__.py" else parts[:-1]
        name = ".".join(parts[:-1] if path.name == "__init__.py" else parts)
        found = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.level:
                base = list(package[: len(package) - node.level + 1])
                if node.module is None:
                    found.update(".".join([*base, a.name]) for a in node.names)
                else:
                    found.add(".".join([*base, node.module]))
        graph[name] = found
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for dep in sorted(graph[module] & graph.keys()):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return cycles


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, pending = set(), [start]
    while pending:
        module = pending.pop()
        for dep in graph.get(module, ()):
            if dep not in seen:
                seen.add(dep)
                pending.append(dep)
    return seen


def test_the_package_has_no_import_cycles():
    graph = _imports()
    assert "eqstate.transform._dispatch" in graph  # the graph is the real one
    assert _cycles(graph) == []


def test_tracing_does_not_depend_on_the_transforms_built_on_it():
    graph = _imports()
    tracing = "eqstate.transform._function_traces"
    below = _reachable(graph, tracing)
    for transform in ("_dispatch", "_jit", "_stateful_function", "_discovery", "_vmap"):
        assert f"eqstate.transform.{transform}" not in below
    assert "eqstate.transform._stateful_function" not in _reachable(
        graph, "eqstate.transform._dispatch"
    )


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
