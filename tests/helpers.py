import functools
import inspect
import json
import subprocess
import sys
import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest


# A test that needs a failed check to raise while the program runs: a TPU cannot.
raises_at_run_time = pytest.mark.cpu_or_gpu("a TPU program cannot raise while it runs")


def tree_allclose(a, b, *, rtol=1e-6, atol=1e-6) -> bool:
    """Whether two PyTrees have the same structure and close leaves."""
    leaves_a, def_a = jtu.tree_flatten(a)
    leaves_b, def_b = jtu.tree_flatten(b)
    if def_a != def_b:
        return False
    return all(
        jnp.shape(x) == jnp.shape(y)
        and np.allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)
        for x, y in zip(leaves_a, leaves_b)
    )


def tree_bitwise_equal(a, b) -> bool:
    """Whether two PyTrees are identical: structure, shapes, dtypes and bits."""
    leaves_a, def_a = jtu.tree_flatten(a)
    leaves_b, def_b = jtu.tree_flatten(b)
    if def_a != def_b:
        return False
    for x, y in zip(leaves_a, leaves_b):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape or x.dtype != y.dtype or x.tobytes() != y.tobytes():
            return False
    return True


def leak_a_tracer(shape: tuple[int, ...]) -> jax.Array:
    """A tracer that outlives its `jax.jit` trace, made on purpose (with JAX's own leak
    checker off for that trace, so that the suite can run under
    `jax.checking_leaks()`)."""
    leaked = []
    with jax.check_tracer_leaks(False):
        jax.jit(lambda x: leaked.append(x) or x)(jnp.ones(shape))
    return leaked[0]


def unchecked(fn):
    """`fn` without the runtime type checks the test suite adds to the package
    (jaxtyping's import hook): for tests of what a user without them sees. (The
    functions `fn` calls are still checked.)"""
    if inspect.ismethod(fn):
        return functools.partial(inspect.unwrap(fn.__func__), fn.__self__)
    return inspect.unwrap(fn)


def unchecked_new(cls, *args, **kwargs):
    """`cls(*args, **kwargs)`, with `cls.__init__` unchecked as by `unchecked`."""
    obj = cls.__new__(cls)
    unchecked(cls.__init__)(obj, *args, **kwargs)
    return obj


def traces_per_key() -> int:
    """How many times a StatefulFunction runs its function to trace one cache key:
    once, or twice on the two-pass fallback (`EQSTATE_TEST_TWO_PASS=1`)."""
    from eqstate import _jax_compat

    return 1 if _jax_compat.single_pass_enabled() else 2


def run_in_threads(*works: Callable[[], object]) -> list[BaseException]:
    """Runs each of `works` in a thread of its own, all released together by a
    barrier; returns the exceptions they raised."""
    barrier = threading.Barrier(len(works))
    errors: list[BaseException] = []

    def target(work):
        try:
            barrier.wait()
            work()
        except BaseException as e:  # reported by the test
            errors.append(e)

    threads = [threading.Thread(target=target, args=(work,)) for work in works]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = [0]


def _count_compiles(event: str, duration: float, **kwargs) -> None:
    if event == _COMPILE_EVENT:
        _compiles[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def compilations(fn: Callable[[], object]) -> int:
    """How many XLA programs `fn()` compiles (on any thread meanwhile)."""
    before = _compiles[0]
    jax.block_until_ready(fn())
    return _compiles[0] - before


def launcher(num_processes: int, timeout: float) -> list[str]:
    """The command line of `python -m eqstate.launch` for `num_processes` processes
    of two CPU devices each, killed at `timeout` seconds; the program follows it."""
    n, seconds = str(num_processes), f"{timeout:g}"
    command = [sys.executable, "-m", "eqstate.launch", "-n", n, "--timeout", seconds]
    return [*command, "--cpu-devices", "2"]


def reports(output: str, tag: str = "RESULT ") -> list[dict]:
    """The JSON objects that follow `tag` in the lines of `output`. Anything after an
    object on its line is ignored: with `PYTHONUNBUFFERED` set, `print` writes a line's
    newline apart, so another thread's log line can land between the two."""
    decoder = json.JSONDecoder()
    return [
        decoder.raw_decode(line.split(tag, 1)[1])[0]
        for line in output.splitlines()
        if tag in line
    ]


def launch(program: list[str], num_processes: int, timeout: float) -> tuple[int, str]:
    """Runs `program` (a script and its arguments) under `launcher`: its exit status,
    and its output (each process's lines, then the launcher's report)."""
    result = subprocess.run(
        [*launcher(num_processes, timeout), *program],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout + 60,
        start_new_session=True,
    )
    return result.returncode, result.stdout + result.stderr
