"""Type-checks the documentation: every ```python block of `README.md`, of `docs/` and
of the public docstrings, with pyright in the project's configuration (standard mode).

The blocks of one page run in one namespace (`tests/test_docs.py`), so each page
becomes one module, its blocks in order. Run by pre-commit, or by hand:

    python -m tests.check_docs_types
"""

import json
import pathlib
import re
import subprocess
import sys
import tempfile
import textwrap
import tomllib

from .test_docs import _BLOCK, _blocks, _DOCSTRINGS, _ROOT


def _page_source(text: str) -> str:
    """The page's blocks at their own line numbers (other lines blank), so that
    pyright's line numbers are the page's."""
    lines = [""] * (text.count("\n") + 1)
    for match in _BLOCK.finditer(text):
        first = text[: match.start(2)].count("\n")
        body = textwrap.dedent(match.group(2)).splitlines()
        lines[first : first + len(body)] = body
    return "\n".join(lines)


def _modules() -> dict[str, tuple[str, str]]:
    """`{module name: (where it comes from, source)}`, one module per page (`README.md`
    and `docs/`) or public docstring with examples."""
    modules = {}
    for page in [_ROOT / "README.md", *sorted((_ROOT / "docs").rglob("*.md"))]:
        text = page.read_text()
        if _blocks(text):
            origin = str(page.relative_to(_ROOT))
            modules[re.sub(r"\W", "_", origin)] = (origin, _page_source(text))
    for name, doc in _DOCSTRINGS.items():
        origin = f"the examples in the docstring of {name},"
        modules[re.sub(r"\W", "_", name)] = (origin, "\n\n".join(_blocks(doc)))
    return modules


def main() -> int:
    settings = tomllib.loads((_ROOT / "pyproject.toml").read_text())["tool"]["pyright"]
    settings = {k: v for k, v in settings.items() if k not in ("include", "exclude")}
    with tempfile.TemporaryDirectory() as directory:
        root = pathlib.Path(directory)
        origins = {}
        for name, (origin, source) in _modules().items():
            path = root / f"{name}.py"
            path.write_text(source)
            origins[str(path)] = origin
        (root / "pyrightconfig.json").write_text(json.dumps(settings))
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pyright",
                "--pythonpath",
                sys.executable,
                "--outputjson",
                "--project",
                str(root),
            ],
            capture_output=True,
            text=True,
        )
        try:
            report = json.loads(result.stdout)
        except json.JSONDecodeError:
            print(result.stdout, result.stderr)
            return 1
    errors = [d for d in report["generalDiagnostics"] if d["severity"] == "error"]
    for d in errors:
        line = d["range"]["start"]["line"] + 1
        print(f"{origins.get(d['file'], d['file'])} line {line}: {d['message']}")
    checked = report["summary"]["filesAnalyzed"]
    print(f"pyright: {len(errors)} error(s) in the examples of {checked} pages")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
