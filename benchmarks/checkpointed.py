"""Memory and time of reverse-mode autodiff through a long loop: `checkpointed_scan`
against `scan`.

Run with `python -m benchmarks.checkpointed` (about ten minutes on two cores, most of
it in the 100,000-step cases). It measures a 256-wide RNN over 1,000, 10,000 and
100,000 steps, writes the results to `benchmarks/checkpointed.json` and rewrites the
section of `docs/benchmarks.md` between its markers; `python -m benchmarks.report`
renders that section from the same file. `--quick` runs small sizes and prints the
section only.

The memory is XLA's own analysis of the compiled gradient
(`jit(...).lower(...).compile().memory_analysis()`): the temporary buffers it
allocates beyond its arguments and outputs, which is what grows with the number of
steps.
"""

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable

import eqstate as es
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from ._timing import machine


_RESULTS = pathlib.Path(__file__).parent / "checkpointed.json"
_PAGE = pathlib.Path(__file__).parent.parent / "docs" / "benchmarks.md"
BEGIN = "<!-- checkpointed-scan: begin (python -m benchmarks.checkpointed) -->"
END = "<!-- checkpointed-scan: end -->"

WIDTH = 256
SIZES = (1_000, 10_000, 100_000)
QUICK_SIZES = (300,)
# The floor of the memory ratios, and the reference of the gradients.
SCAN = "eqstate scan"
DEFAULT = "eqstate checkpointed_scan"
BASE_16 = "eqstate checkpointed_scan, base=16"
EQUINOX = "Equinox checkpointed while_loop"


def _rnn(n: int, seed: int = 0) -> tuple[es.ParamState, es.ShortTermState, jax.Array]:
    w = es.ParamState(
        jr.normal(jr.key(seed), (WIDTH, WIDTH)) / np.sqrt(WIDTH), name="w"
    )
    h = es.ShortTermState(jnp.zeros(WIDTH), name="h")
    xs = jr.normal(jr.key(seed + 1), (n, WIDTH))
    return w, h, xs


class _Gradient:
    """A jitted gradient (`jax.jit` or `eqstate.transform.jit`), its arguments, and
    how to read the gradient of `w` from its output."""

    def __init__(self, jitted, args: tuple, read: Callable = lambda out: out):
        self.jitted = jitted
        self.args = args
        self.read = read

    def compile(self):
        return self.jitted.lower(*self.args).compile()

    def __call__(self) -> jax.Array:
        return self.read(self.jitted(*self.args))


def _stateful(loop: Callable, n: int) -> _Gradient:
    """The gradient with respect to `w` of the summed squared hidden state, through
    `loop` (`scan` or `checkpointed_scan`), as a jitted eqstate function."""
    w, h, xs = _rnn(n)

    def step(loss, x):
        h.value = jnp.tanh(w.value @ h.value + x)
        return loss + jnp.mean(h.value**2), None

    def loss(xs):
        total, _ = loop(step, jnp.zeros(()), xs)
        return total

    grad = es.transform.jit(es.transform.grad(loss, grad_states=[w]))
    return _Gradient(grad, (xs,), lambda grads: grads[w])


def _pure(n: int, kind: str) -> _Gradient:
    """The same gradient in plain JAX: `jax.lax.scan`, or Equinox's checkpointed
    while loop (binomial checkpointing, `equinox.internal.while_loop`)."""
    w, _, xs = _rnn(n)

    def step(h, x, w):
        return jnp.tanh(w @ h + x)

    def loss(w, xs):
        if kind == "lax":

            def body(carry, x):
                h, total = carry
                h = step(h, x, w)
                return (h, total + jnp.mean(h**2)), None

            (_, total), _ = jax.lax.scan(body, (jnp.zeros(WIDTH), 0.0), xs)
            return total

        def loop_body(carry):
            i, h, total = carry
            h = step(h, xs[i], w)
            return i + 1, h, total + jnp.mean(h**2)

        _, _, total = eqxi.while_loop(
            lambda c: c[0] < n,
            loop_body,
            (0, jnp.zeros(WIDTH), jnp.zeros(())),
            max_steps=n,
            kind="checkpointed",
        )
        return total

    return _Gradient(jax.jit(jax.grad(loss)), (w.value, xs))


def _systems(n: int) -> dict[str, Callable[[], _Gradient]]:
    return {
        "jax.lax.scan": lambda: _pure(n, "lax"),
        SCAN: lambda: _stateful(es.transform.scan, n),
        DEFAULT: lambda: _stateful(es.transform.checkpointed_scan, n),
        BASE_16: lambda: _stateful(
            lambda f, init, xs: es.transform.checkpointed_scan(f, init, xs, base=16), n
        ),
        EQUINOX: lambda: _pure(n, "equinox"),
    }


def _measure(build: Callable[[], _Gradient], repeats: int) -> dict:
    grad = build()
    start = time.perf_counter()
    compiled = grad.compile()
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    value = jax.block_until_ready(grad())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(grad())
        times.append((time.perf_counter() - start) * 1e3)
    return {
        "temp_bytes": int(memory.temp_size_in_bytes),
        "compile_s": compile_s,
        "run_ms": statistics.median(times),
        "run_ms_min": min(times),
        "run_ms_max": max(times),
        "grad": np.asarray(value),
    }


def run(sizes: tuple[int, ...] = SIZES, quick: bool = False) -> dict:
    """Every system at every size: memory, compile time, run time, and the largest
    difference of its gradient from `scan`'s, relative to the largest entry."""
    repeats = 1 if quick else 3
    rows = []
    for n in sizes:
        results = {}
        for name, build in _systems(n).items():
            results[name] = _measure(build, repeats)
            print(
                f"{n:>7} steps  {name:36s} {_summary(results[name])}",
                file=sys.stderr,
                flush=True,
            )
        floor, reference = results[SCAN], results[SCAN]["grad"]
        scale = float(np.max(np.abs(reference)))
        for name, r in results.items():
            diff = float(np.max(np.abs(r.pop("grad") - reference))) / scale
            rows.append(
                {
                    "steps": n,
                    "system": name,
                    **r,
                    # XLA on a TPU reports no temporary bytes for `scan`.
                    "temp_ratio": (
                        r["temp_bytes"] / floor["temp_bytes"]
                        if floor["temp_bytes"]
                        else float("nan")
                    ),
                    "grad_rel_diff": diff,
                }
            )
    return {
        "machine": machine(),
        "date": datetime.date.today().isoformat(),
        "load": "{:.1f}, {:.1f}, {:.1f}".format(*os.getloadavg()),
        "quick": quick,
        "rows": rows,
    }


def _summary(r: dict) -> str:
    return (
        f"temp {r['temp_bytes'] / 1e6:8.2f} MB  compile {r['compile_s']:5.2f} s  "
        f"run {r['run_ms']:8.1f} ms"
    )


def _mb(n: int) -> str:
    x = n / 2**20
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 1 else f"{x:.2f}"


def section(results: dict) -> str:
    """The section of `docs/benchmarks.md`, as markdown."""
    lines = [
        "| steps | loop | temp MiB | x scan | compile s | run ms (min-max) | "
        "grad diff |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['steps']:,} | {r['system']} | {_mb(r['temp_bytes'])} | "
            f"{r['temp_ratio']:.3f} | {r['compile_s']:.1f} | {r['run_ms']:.0f} "
            f"({r['run_ms_min']:.0f}-{r['run_ms_max']:.0f}) | "
            f"{r['grad_rel_diff']:.0e} |"
        )
    table = "\n".join(lines)
    mode = (
        " (`--quick`: small sizes, one run, not a measurement)"
        if results["quick"]
        else ""
    )
    return f"""{BEGIN}
## 5. Reverse-mode through a long loop: `checkpointed_scan`

The gradient, with respect to the recurrent weights, of the summed squared hidden
state of a 256-wide RNN (`h = tanh(W @ h + x)`) over 1,000 to 100,000 steps:
the weights are a `ParamState`, the hidden state a `ShortTermState` written every
step, and the gradient is `eqstate.transform.jit(eqstate.transform.grad(...))`. Plain
JAX rows compute the same gradient with `jax.jit(jax.grad(...))`.

- **temp MiB** is XLA's own analysis of the compiled gradient
  (`.lower(...).compile().memory_analysis()`, `temp_size_in_bytes`): the buffers it
  allocates beyond its arguments and outputs, the memory that grows with the steps.
  **x scan** is that divided by eqstate `scan`'s.
- **run ms** is the median of three calls (min-max) after a first one; **compile s**
  is lowering and compiling once.
- **grad diff** is the largest difference from `scan`'s gradient, relative to its
  largest entry (XLA fuses the recomputed steps differently, so the last bits differ).
- `checkpointed_scan` is the default (two levels of about sqrt(steps) segments) and
  `base=16` (16 segments per level, nested); the Equinox row is
  `equinox.internal.while_loop(..., kind="checkpointed")`, binomial checkpointing,
  on the pure function.

Measured by `python -m benchmarks.checkpointed` on {results["date"]}: {results["machine"]};
load average {results["load"]} at the end (a shared machine: the times are noisy){mode}.

{table}

{_verdict(results)}
{END}"""


def _verdict(results: dict) -> str:
    """What the table says, in words: the default against `scan` at each size, and
    the alternatives that were measured against it."""
    rows = {(r["steps"], r["system"]): r for r in results["rows"]}
    sizes = sorted({r["steps"] for r in results["rows"]})

    def memory(system: str) -> str:
        return " / ".join(f"{rows[(n, system)]['temp_ratio']:.1%}" for n in sizes)

    def time(system: str) -> str:
        return " / ".join(
            f"{rows[(n, system)]['run_ms'] / rows[(n, SCAN)]['run_ms']:.2f}x"
            for n in sizes
        )

    steps = " / ".join(f"{n:,}" for n in sizes)
    faster = all(
        rows[(n, DEFAULT)]["run_ms"] < rows[(n, EQUINOX)]["run_ms"] for n in sizes
    )
    speed = (
        "the default two-level nesting ran faster than the while loop at every size "
        "above"
        if faster
        else "the two trade memory for time differently (see the table)"
    )
    return f"""At {steps} steps, the default `checkpointed_scan` needed {memory(DEFAULT)}
of `scan`'s temporary memory, in {time(DEFAULT)} its time; with `base=16`,
{memory(BASE_16)} in {time(BASE_16)}; Equinox's checkpointed while loop
{memory(EQUINOX)} in {time(EQUINOX)}.

eqstate's `checkpointed_scan` is built on nested `jax.checkpoint`s rather than on
Equinox's checkpointed while loop: both keep the gradient's temporary memory far below
`scan`'s, and Equinox's binomial checkpointing needs the least, but {speed}; the
nested checkpoints also support forward-mode autodiff (the checkpointed while loop
does not) and use only JAX's public API. The outer segments read their rows of `xs`
by index, so no copy of the inputs is made or stored."""


def write_section(text: str, page: pathlib.Path = _PAGE) -> None:
    """Replaces the section between the markers of `page` (or appends it)."""
    content = page.read_text()
    if BEGIN in content and END in content:
        head, rest = content.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        content = head + text + tail
    else:
        content = content.rstrip("\n") + "\n\n" + text + "\n"
    page.write_text(content)


def load() -> dict | None:
    """The stored results, if `python -m benchmarks.checkpointed` has run."""
    if not _RESULTS.exists():
        return None
    return json.loads(_RESULTS.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, one run")
    args = parser.parse_args()
    results = run(QUICK_SIZES if args.quick else SIZES, quick=args.quick)
    if args.quick:
        print(section(results))
        return
    _RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    write_section(section(results))
    print(f"wrote {_RESULTS} and the section of {_PAGE}")


if __name__ == "__main__":
    main()
