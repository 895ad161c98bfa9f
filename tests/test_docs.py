"""Every ```python block in `docs/` and in the docstrings of the public API runs, so the
documentation cannot drift from the code."""

import inspect
import pathlib
import re
import textwrap
import types

import eqstate as es
import pytest


_ROOT = pathlib.Path(__file__).parent.parent
_BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", re.DOTALL | re.MULTILINE)


def _blocks(text: str) -> list[str]:
    return [textwrap.dedent(body) for _, body in _BLOCK.findall(text)]


def _public_objects():
    seen, found = set(), {}

    def visit(obj, name):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        doc = (
            inspect.getdoc(obj)
            if not isinstance(obj, types.ModuleType)
            else obj.__doc__
        )
        if doc and "```python" in doc:
            found[name] = doc
        if isinstance(obj, types.ModuleType) or inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_") and attr != "__init__":
                    continue
                if isinstance(
                    member, types.ModuleType
                ) and not member.__name__.startswith("eqstate"):
                    continue
                if isinstance(member, property):
                    member = member.fget
                if (
                    inspect.isclass(member)
                    or inspect.isfunction(member)
                    or isinstance(member, types.ModuleType)
                ):
                    if getattr(member, "__module__", "eqstate").startswith(
                        "eqstate"
                    ) or isinstance(member, types.ModuleType):
                        visit(member, f"{name}.{attr}")

    visit(es, "eqstate")
    return found


_DOCSTRINGS = _public_objects()


# Pages whose code, written for readers, broadcasts as NumPy does or uses optax.adam
# (a Python float to an int32 power) run with JAX's default promotion; the others, and
# the docstrings, run strict, as a user's may.
_NUMPY_PROMOTION = {
    "docs/how-to/brainstate-ports.md",
    "docs/how-to/ensembles.md",
    "docs/how-to/equinox.md",
    "docs/how-to/stateful-layers.md",
    "docs/index.md",
}


def _page(path: pathlib.Path):
    name = str(path.relative_to(_ROOT))
    marks = [pytest.mark.numpy_promotion(name)] if name in _NUMPY_PROMOTION else []
    return pytest.param(path, id=name, marks=marks)


@pytest.mark.parametrize(
    "path",
    [_page(_ROOT / "README.md"), *map(_page, sorted((_ROOT / "docs").rglob("*.md")))],
)
def test_docs_code_blocks_run(path):
    namespace: dict = {"__name__": "__docs__"}
    for block in _blocks(path.read_text()):
        exec(compile(block, str(path), "exec"), namespace)


@pytest.mark.parametrize("name", sorted(_DOCSTRINGS))
def test_docstring_examples_run(name):
    for block in _blocks(_DOCSTRINGS[name]):
        exec(compile(block, name, "exec"), {"__name__": "__docs__"})


def test_docstring_examples_are_found():
    assert "eqstate.transform.StatefulFunction" in _DOCSTRINGS
    assert "eqstate.run" in _DOCSTRINGS
