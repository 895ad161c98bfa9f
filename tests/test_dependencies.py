"""`pyproject.toml` declares what eqstate imports, each with the floor CI tests."""

import ast
import importlib.metadata
import importlib.util
import pathlib
import re
import sys
import tomllib


_ROOT = pathlib.Path(__file__).parent.parent


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imported(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name.split(".")[0] for alias in node.names}
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return {node.module.split(".")[0]}
    return set()


def _imported_top_level_modules(*, lazily: bool) -> set[str]:
    """What eqstate imports when it is imported, or (`lazily=True`) anywhere,
    including imports inside functions that only an optional feature runs."""
    found = set()
    for path in (_ROOT / "eqstate").rglob("*.py"):
        tree = ast.parse(path.read_text())
        nodes = ast.walk(tree) if lazily else iter(tree.body)
        for node in nodes:
            found |= _imported(node)
    return found - set(sys.stdlib_module_names) - {"eqstate"}


def _distributions(modules: set[str]) -> set[str]:
    distributions = importlib.metadata.packages_distributions()
    return {_normalise(dist) for module in modules for dist in distributions[module]}


def _declared(*, extras: bool = False) -> dict[str, str]:
    with open(_ROOT / "pyproject.toml", "rb") as file:
        project = tomllib.load(file)["project"]
    requirements = list(project["dependencies"])
    if extras:
        for extra in project["optional-dependencies"].values():
            requirements += extra
    declared = {}
    for requirement in requirements:
        name, spec = re.fullmatch(r"([A-Za-z0-9._-]+)(.*)", requirement).groups()
        declared[_normalise(name)] = spec
    return declared


def test_every_imported_package_is_declared_with_a_floor():
    imported = _distributions(_imported_top_level_modules(lazily=False))
    declared = _declared()
    assert imported <= set(declared), imported - set(declared)
    assert {"jax", "equinox", "numpy", "ml-dtypes", "wadler-lindig"} <= imported
    for name, spec in declared.items():
        assert re.search(r">=\d", spec), f"{name} has no floor"


def test_packages_imported_by_optional_features_are_declared_in_an_extra():
    imported = _distributions(_imported_top_level_modules(lazily=True))
    declared = _declared(extras=True)
    assert imported <= set(declared), imported - set(declared)
    assert "absl-py" in imported  # the Orbax backend's flag; keeps this test honest
    for name, spec in declared.items():
        assert re.search(r">=\d", spec), f"{name} has no floor"


def test_the_floor_check_pins_every_declared_dependency_at_its_floor():
    spec = importlib.util.spec_from_file_location(
        "check_versions", _ROOT / "tools" / "check_versions.py"
    )
    check_versions = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check_versions)
    pins = dict(line.split("==") for line in check_versions.floor_constraints())
    assert {_normalise(name) for name in pins} == set(_declared())
    assert pins["jax"] == re.search(r">=([\d.]+)", _declared()["jax"]).group(1)
    # The floor run uses the oldest Python the classifiers list: the one required.
    with open(_ROOT / "pyproject.toml", "rb") as file:
        requires_python = tomllib.load(file)["project"]["requires-python"]
    assert requires_python == f">={check_versions.supported_pythons()[0]}"
