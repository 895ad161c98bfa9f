"""Runs the test suite in a fresh virtual environment on one Python and one set of
dependency versions: the newest JAX (the default), the floors that `pyproject.toml`
declares, or a given JAX release.

    python3 tools/check_versions.py                      # newest JAX, newest Python
    python3 tools/check_versions.py --jax 0.12.1         # a given JAX release
    python3 tools/check_versions.py --floors             # the declared floors, Python 3.11
    python3 tools/check_versions.py --python 3.12 -- tests/test_jit.py -x

Interpreters come from pyenv (`$(pyenv root)/versions/3.12.*`); a missing one is an
error. The environment is made in a scratch folder and removed afterwards, unless
`--venv` names a folder (it is emptied first, and kept). CI (`.ci/run`) runs this
script for its version matrix; run it by hand the day a JAX release comes out. The last
line printed sums up the run, e.g. `Python 3.12.1, jax 0.12.0.1, jaxlib 0.12.0.1,
equinox 0.13.8, numpy 2.5.5: 760 passed, 1 skipped in 3.4 min (5.9 min of CPU)`.
"""

import argparse
import os
import pathlib
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib


ROOT = pathlib.Path(__file__).resolve().parent.parent
_SHOWN = ("jax", "jaxlib", "equinox", "numpy")


def _project() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as file:
        return tomllib.load(file)["project"]


def _floor(requirement: str) -> str:
    """`name==X` for a requirement `name>=X` (extras, markers and upper bounds
    dropped)."""
    match = re.fullmatch(
        r"\s*([A-Za-z0-9._-]+)\s*(\[[^\]]*\])?\s*([^;]*)(;.*)?", requirement
    )
    floors = match and re.findall(r">=\s*([^,\s]+)", match.group(3))
    if not floors:
        sys.exit(
            f"error: the dependency {requirement!r} in pyproject.toml has no floor (>=)"
        )
    return f"{match.group(1)}=={floors[0]}"


def floor_constraints() -> list[str]:
    """One `name==floor` line per dependency declared in `pyproject.toml`."""
    return [_floor(requirement) for requirement in _project()["dependencies"]]


def supported_pythons() -> list[str]:
    """The Python versions `pyproject.toml`'s classifiers list, oldest first."""
    found = []
    for classifier in _project()["classifiers"]:
        match = re.fullmatch(r"Programming Language :: Python :: (3\.\d+)", classifier)
        if match:
            found.append(match.group(1))
    return sorted(found, key=lambda v: tuple(map(int, v.split("."))))


def _pyenv_root() -> pathlib.Path:
    if shutil.which("pyenv"):
        out = subprocess.run(["pyenv", "root"], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            return pathlib.Path(out.stdout.strip())
    return pathlib.Path(os.environ.get("PYENV_ROOT", pathlib.Path.home() / ".pyenv"))


def find_python(version: str) -> pathlib.Path:
    """The newest pyenv interpreter of `version` (e.g. `3.12`); exits if none."""
    root = _pyenv_root()

    def patch(path: pathlib.Path) -> tuple[int, ...]:
        return tuple(int(p) for p in re.findall(r"\d+", path.parent.parent.name))

    candidates = sorted(
        (p for p in root.glob(f"versions/{version}.*/bin/python") if p.exists()),
        key=patch,
    )
    if not candidates:
        sys.exit(
            f"error: no Python {version} under {root}/versions. Install it with "
            f"`pyenv install {version}`."
        )
    return candidates[-1]


def _pip(venv: pathlib.Path, *args: str) -> None:
    command = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args]
    env = os.environ | {"PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(
            f"error: `{' '.join(command)}` failed:\n{result.stdout}{result.stderr}"
        )


def _versions(venv: pathlib.Path) -> str:
    script = (
        "import importlib.metadata as m, platform; "
        f"print(', '.join([f'Python {{platform.python_version()}}'] + "
        f"[f'{{n}} {{m.version(n)}}' for n in {_SHOWN!r}]))"
    )
    python = str(venv / "bin" / "python")
    return subprocess.run(
        [python, "-c", script], capture_output=True, text=True, check=True
    ).stdout.strip()


def _summary(output: str) -> str:
    """pytest's counts, from its closing line."""
    for line in reversed(output.splitlines()):
        if re.search(r"\d+ (passed|failed|error)", line):
            return re.sub(r" in [\d.]+s.*", "", line.strip(" ="))
    return "no pytest summary"


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def check(
    python: pathlib.Path,
    venv: pathlib.Path,
    jax: str | None,
    floors: bool,
    pytest_args: list[str],
) -> int:
    """Makes `venv` with `python`, installs eqstate and its test tools with the chosen
    versions, runs pytest and returns its exit status."""
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([str(python), "-m", "venv", str(venv)], check=True)
    constraints: list[str] = []
    if floors:
        path = venv / "floors.txt"
        path.write_text("\n".join(floor_constraints()) + "\n")
        constraints = ["-c", str(path)]
    _pip(venv, *constraints, "-e", ".[dev]")
    if jax is None and not floors:
        _pip(venv, "--upgrade", "jax", "jaxlib")  # the newest the index has
    elif jax is not None:
        _pip(venv, f"jax=={jax}")
    versions = _versions(venv)
    print(versions, flush=True)
    start, cpu_start = time.monotonic(), _cpu_seconds()
    command = [str(venv / "bin" / "python"), "-m", "pytest", "-q", *pytest_args]
    lines = []
    with subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as pytest:
        assert pytest.stdout is not None
        for line in pytest.stdout:
            print(line, end="", flush=True)
            lines.append(line)
    minutes = (time.monotonic() - start) / 60
    cpu_minutes = (_cpu_seconds() - cpu_start) / 60
    print(
        f"{versions}: {_summary(''.join(lines))} in {minutes:.1f} min "
        f"({cpu_minutes:.1f} min of CPU)"
    )
    return pytest.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--python",
        help="e.g. 3.12; default: 3.11 with --floors, else the newest supported",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--jax", help="a JAX release to install, e.g. 0.12.1 (default: the newest)"
    )
    which.add_argument(
        "--floors",
        action="store_true",
        help="install every declared dependency at its floor",
    )
    parser.add_argument(
        "--venv", type=pathlib.Path, help="where to make the environment (kept)"
    )
    parser.add_argument("pytest_args", nargs="*", help="after `--`; default: `-n 2`")
    args = parser.parse_args()
    pythons = supported_pythons()
    python = find_python(args.python or (pythons[0] if args.floors else pythons[-1]))
    pytest_args = args.pytest_args or ["-n", "2"]
    if args.venv is not None:
        sys.exit(check(python, args.venv.resolve(), args.jax, args.floors, pytest_args))
    with tempfile.TemporaryDirectory(prefix="eqstate-versions-") as scratch:
        sys.exit(
            check(
                python,
                pathlib.Path(scratch) / "venv",
                args.jax,
                args.floors,
                pytest_args,
            )
        )


if __name__ == "__main__":
    main()
