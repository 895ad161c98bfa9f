"""The module structure `docs/architecture.md` describes: no import cycles, and the
tracing layer does not depend on the transforms built on it; and tests that reach
private modules only where those modules are unit-tested."""

import ast
import pathlib
import re

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


def _private_names_imported(source: str) -> list[tuple[str, str]]:
    """`(module, name)` for each `from .module import _name` at the top of `source`
    (a private module itself, `from . import _context`, is the package's to share)."""
    return [
        (node.module or "", alias.name)
        for node in ast.parse(source).body
        if isinstance(node, ast.ImportFrom) and node.level > 0 and node.module
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]


def test_no_module_imports_another_modules_private_names():
    # A module's names without an underscore are what it offers the package; the
    # others are its own (`_loops.scan_states` is what `map` and the checkpointed loops
    # are built on, `_loops._scan` would not be).
    found = {
        str(path.relative_to(_ROOT)): _private_names_imported(path.read_text())
        for path in _ROOT.rglob("*.py")
    }
    assert {path: names for path, names in found.items() if names} == {}


def test_the_private_name_check_finds_one():
    source = "from . import _context\nfrom ._loops import _scan, scan_states"
    assert _private_names_imported(source) == [("_loops", "_scan")]


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


# The test files that may import private modules, and which: the unit tests of those
# modules, and the fixture that runs tests in both tracing modes. The others test
# through the public API.
_PRIVATE_IMPORTS_ALLOWED = {
    "conftest.py": {"eqstate._jax_compat"},  # the tracing-mode fixture
    "helpers.py": {"eqstate._jax_compat"},  # traces per key in each tracing mode
    # The sizes of a jitted function's caches, shrunk so that a test fills them.
    "test_bounded_caches.py": {
        "eqstate.transform._dispatch",
        "eqstate.transform._function_traces",
        "eqstate.transform._split_args",
    },
    "test_jax_compat.py": {"eqstate._jax_compat"},
    "test_launch.py": {"eqstate._launch"},
    # The Orbax format's pinned checksums, and what runs at the program's end.
    "test_multi_process_checkpoints.py": {
        "eqstate._checkpoint_manager",
        "eqstate._multi_process",
        "eqstate._orbax",
    },
    # A guard that the public API cannot reach (see the file's docstring).
    "test_unstable_states.py": {
        "eqstate._context",
        "eqstate.transform._discovery",
        "eqstate.transform._function_traces",
    },
}
_FROM_IMPORT = re.compile(
    r"^[ \t]*[\"']?from[ \t]+(eqstate[\w.]*)[ \t]+import[ \t]+(?:\(([^)]*)\)|(.*))",
    re.MULTILINE,
)
_IMPORT = re.compile(r"^[ \t]*[\"']?import[ \t]+(eqstate\.[\w.]+)", re.MULTILINE)


def _private_imports(source: str) -> set[str]:
    """The private modules of eqstate that `source` imports, also in the programs it
    holds as strings."""
    source = source.replace("\\n", "\n")  # the lines of a program in a string
    modules = set(_IMPORT.findall(source))
    for module, *names in _FROM_IMPORT.findall(source):
        if _is_private(module):
            modules.add(module)
            continue
        for name in "".join(names).split(","):
            if word := re.match(r"\s*(\w+)", name):
                modules.add(f"{module}.{word[1]}")
    return set(filter(_is_private, modules))


def _is_private(module: str) -> bool:
    return any(part.startswith("_") for part in module.split("."))


def test_tests_import_private_modules_only_where_they_are_unit_tested():
    tests = pathlib.Path(__file__).parent
    unexpected = {}
    for path in sorted(set(tests.glob("*.py")) - {pathlib.Path(__file__)}):
        allowed = _PRIVATE_IMPORTS_ALLOWED.get(path.name, set())
        if extra := _private_imports(path.read_text()) - allowed:
            unexpected[path.name] = sorted(extra)
    assert unexpected == {}


def test_the_private_import_check_finds_every_form():
    source = (
        "from eqstate import _a, b as c\n"
        "from eqstate.transform._d import e\n"
        "from eqstate.transform import (\n    f,\n    _g as h,\n)\n"
        "import eqstate._i\n"
        'script = "import os\\nfrom eqstate import _j\\n"\n'
        "from eqstate import nn\n"
    )
    assert _private_imports(source) == {
        "eqstate._a",
        "eqstate.transform._d",
        "eqstate.transform._g",
        "eqstate._i",
        "eqstate._j",
    }


def test_the_architecture_page_names_every_module_and_no_other():
    page = (_ROOT.parent / "docs" / "architecture.md").read_text()
    table = page.split("## Every module", 1)[1]
    named = set()
    for row in table.splitlines():
        if row.startswith("| `"):
            first_cell = row.split("|")[1]
            named.update(re.findall(r"`([\w/]+\.py)`", first_cell))
    files = {str(path.relative_to(_ROOT)) for path in _ROOT.rglob("*.py")}
    assert named == files, (
        f"modules missing from docs/architecture.md: {sorted(files - named)}; "
        f"named there but absent: {sorted(named - files)}"
    )
