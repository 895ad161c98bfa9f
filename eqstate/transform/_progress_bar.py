"""ProgressBar: progress of a compiled loop, printed from inside it."""

import functools as ft
import io
import sys
import threading
from typing import Any

import jax
import jax.numpy as jnp

from .._arguments import integer


class ProgressBar:
    """Prints the progress of [`eqstate.transform.for_loop`][] or
    [`eqstate.transform.scan`][] from inside the compiled loop (through
    `jax.debug.callback`), every `freq` iterations.

    !!! Example

        ```python
        import io
        import eqstate as es
        import jax.numpy as jnp

        out = io.StringIO()
        es.transform.for_loop(
            lambda x: x * 2, jnp.arange(10.0),
            pbar=es.transform.ProgressBar(freq=5, desc="doubling", file=out),
        )
        assert "doubling: 10/10" in out.getvalue()
        ```
    """

    def __init__(
        self,
        freq: int | None = None,
        desc: str = "Running",
        file: io.TextIOBase | None = None,
        width: int = 30,
    ):
        """**Arguments:**

        - `freq`: print every `freq` iterations; by default about 20 times per loop.
        - `desc`: the text before the bar.
        - `file`: where to print; `sys.stderr` by default.
        - `width`: the number of characters of the bar.
        """
        hint = ", e.g. `ProgressBar(freq=10)`"
        self.freq = integer(freq, "freq", at_least=1, none=True, hint=hint)
        self.desc = desc
        self.file = file
        self.width = integer(width, "width")
        self._lock = threading.Lock()

    def _print(self, done: Any, *, total: int) -> None:
        done = int(done)
        filled = self.width * done // max(total, 1)
        bar = "#" * filled + "-" * (self.width - filled)
        end = "\n" if done >= total else "\r"
        with self._lock:
            out = self.file if self.file is not None else sys.stderr
            print(f"{self.desc}: {done}/{total} [{bar}]", end=end, file=out, flush=True)

    def tick(self, index: jax.Array | int, total: int, stride: int = 1) -> None:
        """Called in the loop body with the iteration `index` (0-based), `stride`
        iterations after the previous call; prints if a multiple of `freq` was
        reached since then."""
        freq = self.freq or max(total // 20, 1)
        done = index + 1

        def report(done):
            jax.debug.callback(ft.partial(self._print, total=total), done, ordered=True)

        jax.lax.cond(
            (done // freq > (done - stride) // freq) | (done == total),
            report,
            lambda done: None,
            jnp.asarray(done),
        )
