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


def _imported_top_level_modules() -> set[str]:
    found = set()
    for path in (_ROOT / "eqstate").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"eqstate"}


def _declared() -> dict[str, str]:
    with open(_ROOT / "pyproject.toml", "rb") as file:
        requirements = tomllib.load(file)["project"]["dependencies"]
    declared = {}
    for requirement in requirements:
        name, spec = re.fullmatch(r"([A-Za-z0-9._-]+)(.*)", requirement).groups()
        declared[_normalise(name)] = spec
    return declared


def test_every_imported_package_is_declared_with_a_floor():
    distributions = importlib.metadata.packages_distributions()
    imported = {
        _normalise(dist)
        for module in _imported_top_level_modules()
        for dist in distributions[module]
    }
    declared = _declared()
    assert imported <= set(declared), imported - set(declared)
    assert {"jax", "equinox", "numpy", "ml-dtypes", "wadler-lindig"} <= imported
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
