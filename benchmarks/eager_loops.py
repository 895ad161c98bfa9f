"""Per-call cost of the loops, conditionals and `shard_map` called at top level,
against JAX's own.

Run with `python -m benchmarks.eager_loops` (`--quick`: a smoke run). For a `scan` of
a small stateful step, a `while_loop`, a `cond` and a `shard_map`, it prints the median
per-call time (min-max over interleaved rounds) of:

- `jax.lax (same f)`: `jax.lax` (or `jax.shard_map`) called with one pure function
  for every call: JAX reuses its trace and program (and so would not see a global
  rebound since);
- `jax.lax (new f)`: the same called with a new function each call, as a body
  defined inside the calling function is: traced and compiled each time;
- `eqstate`: `eqstate.transform`'s version with the stateful function, which reruns
  its Python every call (so sees current globals), and JAX compiles the loop
  it builds each time, as for `jax.lax (new f)`;

with each one's ratio to `jax.lax (same f)`, measured side by side in one run.
"""

import argparse

import eqstate as es
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ._timing import interleaved, machine


def _scan_systems() -> dict:
    h = es.ShortTermState(jnp.zeros(4))
    xs = jnp.ones((10, 4))

    def step(c, x):
        h.value = 0.5 * h.value + x
        return c + x.sum(), h.value

    def pure(carry, x):
        c, h = carry
        h = 0.5 * h + x
        return (c + x.sum(), h), h

    box = {"h": jnp.zeros(4)}

    def lax(f):
        (_, box["h"]), ys = jax.lax.scan(f, (0.0, box["h"]), xs)
        return ys

    return {
        "jax.lax (same f)": lambda: lax(pure),
        "jax.lax (new f)": lambda: lax(lambda c, x: pure(c, x)),
        "eqstate": lambda: es.transform.scan(step, 0.0, xs)[1],
    }


def _while_systems() -> dict:
    n = es.ShortTermState(jnp.array(0))

    def body(x):
        n.value += 1
        return x * 2.0

    def pure(carry):
        x, n = carry
        return x * 2.0, n + 1

    box = {"n": jnp.array(0)}

    def below_100(carry):
        return carry[0] < 100.0

    def lax(f):
        x, box["n"] = jax.lax.while_loop(below_100, f, (1.0, box["n"]))
        return x

    return {
        "jax.lax (same f)": lambda: lax(pure),
        "jax.lax (new f)": lambda: lax(lambda c: pure(c)),
        "eqstate": lambda: es.transform.while_loop(lambda x: x < 100.0, body, 1.0),
    }


def _cond_systems() -> dict:
    s = es.ShortTermState(jnp.zeros(4))
    x = jnp.ones(4)

    def grow(x):
        s.value = s.value + x
        return s.value.sum()

    def keep(x):
        return s.value.sum()

    def pure_grow(s, x):
        return s + x, (s + x).sum()

    def pure_keep(s, x):
        return s, s.sum()

    box = {"s": jnp.zeros(4)}

    def lax(f):
        box["s"], out = jax.lax.cond(True, f, pure_keep, box["s"], x)
        return out

    return {
        "jax.lax (same f)": lambda: lax(pure_grow),
        "jax.lax (new f)": lambda: lax(lambda s, x: pure_grow(s, x)),
        "eqstate": lambda: es.transform.cond(True, grow, keep, x),
    }


def _shard_map_systems() -> dict:
    mesh = jax.make_mesh(
        (len(jax.devices()),), ("i",), axis_types=(jax.sharding.AxisType.Auto,)
    )
    spec = jax.sharding.PartitionSpec("i")
    total = es.ShortTermState(jnp.array(0.0))
    x = jnp.ones(4 * len(jax.devices()))

    def step(x):
        total.value = total.value + jax.lax.psum(x.sum(), "i")
        return x * 2

    def pure(total, x):
        return total + jax.lax.psum(x.sum(), "i"), x * 2

    box = {"total": jnp.array(0.0)}
    specs = {"mesh": mesh, "in_specs": (P(), spec), "out_specs": (P(), spec)}

    def lax(f):
        box["total"], out = jax.shard_map(f, **specs)(box["total"], x)
        return out

    sharded = es.transform.shard_map(step, mesh=mesh, in_specs=spec, out_specs=spec)
    return {
        "jax.lax (same f)": lambda: lax(pure),
        "jax.lax (new f)": lambda: lax(lambda t, x: pure(t, x)),
        "eqstate": lambda: sharded(x),
    }


def main(quick: bool = False) -> None:
    print(f"# loops, conditionals and shard_map called at top level ({machine()})\n")
    print(
        "per-call time in us: median (min-max) over interleaved rounds; ratio: median "
        "over rounds of time / `jax.lax (same f)` time in the same round\n"
    )
    print("| loop | system | median us | min-max us | ratio |")
    print("| --- | --- | --- | --- | --- |")
    workloads = {
        "scan": _scan_systems,
        "while_loop": _while_systems,
        "cond": _cond_systems,
        "shard_map": _shard_map_systems,
    }
    for name, systems in workloads.items():
        results = interleaved(
            systems(), rounds=2 if quick else 15, calls=2 if quick else 10, warmup=2
        )
        floor = results["jax.lax (same f)"]
        for system, t in results.items():
            print(
                f"| {name} | {system} | {t.median:.0f} | {t.min:.0f}-{t.max:.0f} "
                f"| {t.ratio_to(floor):.1f} |"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    main(quick=parser.parse_args().quick)
