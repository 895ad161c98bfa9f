"""Building an ensemble of K two-layer MLPs, against plain Equinox.

Run with `python -m benchmarks.ensemble`. For K = 8 and 64 it prints, measured side by
side in one run:

- `eqx.filter_vmap` (the floor): `eqx.filter_vmap(make_arrays)(keys)`, the same arrays
  built by a function of a key;
- `vmap_new_states`: `vmap_new_states(MLP, axis_size=K)()`, the states registered in
  the world;
- `jit floor`: `eqx.filter_jit(eqx.filter_vmap(make_arrays))(keys)`;
- `jit(vmap_new_states)`: the same constructor under `eqstate.transform.jit` (fresh
  handles every call);

and how many times the user's constructor ran per build.
"""

import argparse

import eqstate as es
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

from ._timing import interleaved, machine


N_IN, N_HIDDEN, N_OUT = 16, 64, 1
RUNS = {"count": 0}


class MLP(eqx.Module):
    w1: es.ParamState
    b1: es.ParamState
    w2: es.ParamState
    b2: es.ParamState

    def __init__(self):
        RUNS["count"] += 1
        self.w1 = es.ParamState(es.random.normal((N_HIDDEN, N_IN)) / N_IN**0.5)
        self.b1 = es.ParamState(jnp.zeros(N_HIDDEN))
        self.w2 = es.ParamState(es.random.normal((N_OUT, N_HIDDEN)) / N_HIDDEN**0.5)
        self.b2 = es.ParamState(jnp.zeros(N_OUT))


def make_arrays(key):
    k1, k2 = jr.split(key)
    return {
        "w1": jr.normal(k1, (N_HIDDEN, N_IN)) / N_IN**0.5,
        "b1": jnp.zeros(N_HIDDEN),
        "w2": jr.normal(k2, (N_OUT, N_HIDDEN)) / N_HIDDEN**0.5,
        "b2": jnp.zeros(N_OUT),
    }


def _systems(k: int) -> dict:
    keys = jr.split(jr.key(0), k)
    build = es.transform.vmap_new_states(MLP, axis_size=k)
    jit_build = es.transform.jit(build)
    jit_floor = eqx.filter_jit(eqx.filter_vmap(make_arrays))

    def values(model):
        return es.values_of(model)

    return {
        "eqx.filter_vmap": lambda: eqx.filter_vmap(make_arrays)(keys),
        "vmap_new_states": lambda: values(build()),
        "jit floor": lambda: jit_floor(keys),
        "jit(vmap_new_states)": lambda: values(jit_build()),
    }


def _runs_per_build(k: int) -> int:
    build = es.transform.vmap_new_states(MLP, axis_size=k)
    build()
    RUNS["count"] = 0
    build()
    return RUNS["count"]


def main(sizes: tuple[int, ...] = (8, 64), quick: bool = False) -> None:
    print(f"# ensemble: building K two-layer MLPs ({machine()})\n")
    print(
        "time per build in us: median (min-max) over interleaved rounds; ratio: median "
        "over rounds of time / floor time in the same round (eager systems against "
        "`eqx.filter_vmap`, jitted ones against the jitted floor)\n"
    )
    print("| K | system | median us | min-max us | ratio | constructor runs |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k in sizes:
        results = interleaved(
            _systems(k), rounds=3 if quick else 20, calls=2 if quick else 5
        )
        runs = _runs_per_build(k)
        for name, t in results.items():
            floor = results["jit floor" if "jit" in name else "eqx.filter_vmap"]
            per_build = runs if name == "vmap_new_states" else "-"
            print(
                f"| {k} | {name} | {t.median:.0f} | {t.min:.0f}-{t.max:.0f} "
                f"| {t.ratio_to(floor):.2f} | {per_build} |"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds, for CI")
    main(quick=parser.parse_args().quick)
    jax.effects_barrier()
