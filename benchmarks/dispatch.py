"""Per-call cost of a jitted step touching N small states, against plain `jax.jit`.

Run with `python -m benchmarks.dispatch`. For N = 1, 10, 100, 1000 states it prints the
median per-call time (and min-max over the rounds) of:

- `floor`: `jax.jit` of the hand-written pure function, taking and returning a dict of
  N arrays;
- `jaxpr_call`: `sf.jaxpr_call(states, x)` inside that `jax.jit`;
- `sf(jit)`: `StatefulFunction(f, cache_type='jit')(x)`, the world holding the states;
- `transform.jit`: `eqstate.transform.jit(f)(x)`, the world holding the states;
- `jit(closed)` and `jit(model, x)`: an `eqx.Module` holding the N states and an
  array, closed over by the step or passed to it as an argument (the handles are
  static leaves, the array is traced);
- `floor(array)`: the floor's function taking that array as an argument, where the
  floor, like `jit(closed)`, has it as a constant: what JAX alone charges for an
  array passed rather than baked in;
- `floor(flag)` and `transform.jit(flag)`: a training step and an evaluation step in
  turn, chosen by a static `train` flag (only training writes the states), through
  `jax.jit` of the pure function and through `eqstate.transform.jit`: a pair of calls
  per round, so compare these two with each other;
- `jax.jit(module)` and `eqx.filter_jit(module)`: what plain JAX and Equinox pay for
  a module argument: the floor's function taking an `eqx.Module` that holds the array,
  through `jax.jit` and `eqx.filter_jit`;
- `floor(donate)` and `transform.jit(donate)`: the floor donating its dict of states
  (`donate_argnums=0`), and `eqstate.transform.jit(f, donate_states=True)`: compare
  these two with each other;

with each system's ratio to the floor, all measured side by side in one run. It also
prints the first trace of `f` (eqstate) against `jax.make_jaxpr` of the pure function,
to show that tracing cost grows linearly with N.
"""

import argparse
import functools as ft

import eqstate as es
import equinox as eqx
import jax
import jax.numpy as jnp

from ._timing import interleaved, machine, once


def _systems(n: int) -> dict:
    states = [es.ShortTermState(jnp.zeros(4), name=f"s{i}") for i in range(n)]
    x = jnp.ones(4)

    def step(x):
        for s in states:
            s.value = s.value * 0.5 + x
        return x.sum()

    @jax.jit
    def pure(values, x):
        return {k: v * 0.5 + x for k, v in values.items()}, x.sum()

    def step_or_eval(x, train):
        return step(x) if train else sum(s.value.sum() for s in states) + x.sum()

    @ft.partial(jax.jit, static_argnames="train")
    def pure_or_eval(values, x, train):
        if train:
            return pure(values, x)
        return values, sum(v.sum() for v in values.values()) + x.sum()

    def floor_flag():
        box["dict"], _ = pure_or_eval(box["dict"], x, train=True)
        return pure_or_eval(box["dict"], x, train=False)[1]

    sf_pure = es.transform.StatefulFunction(step)

    @jax.jit
    def pure_via_eqstate(sd, x):
        return sf_pure.jaxpr_call(sd, x)

    sf_jit = es.transform.StatefulFunction(step, cache_type="jit")
    box = {"dict": {f"s{i}": jnp.zeros(4) for i in range(n)}, "sd": es.world()}
    box["sd"] = box["sd"].filter(*states)

    def floor():
        box["dict"], out = pure(box["dict"], x)
        return out

    @jax.jit
    def pure_with_array(values, decay, x):
        return {k: v * decay + x for k, v in values.items()}, x.sum()

    decay = jnp.full(4, 0.5)
    box["dict_a"] = dict(box["dict"])

    def floor_with_array():
        box["dict_a"], out = pure_with_array(box["dict_a"], decay, x)
        return out

    def pure_with_module(module, values, x):
        return {k: v * module.decay + x for k, v in values.items()}, x.sum()

    module = _Module(jnp.full(4, 0.5))
    jax_module = jax.jit(pure_with_module)
    eqx_module = eqx.filter_jit(pure_with_module)

    def via_jax_module():
        box["dict"], out = jax_module(module, box["dict"], x)
        return out

    def via_eqx_module():
        box["dict"], out = eqx_module(module, box["dict"], x)
        return out

    def via_jaxpr_call():
        box["sd"], out = pure_via_eqstate(box["sd"], x)
        return out

    systems = {
        "floor": floor,
        "jaxpr_call": via_jaxpr_call,
        "sf(jit)": lambda: sf_jit(x),
    }
    if hasattr(es.transform, "jit"):
        jitted = es.transform.jit(step)
        systems["transform.jit"] = lambda: jitted(x)
        model = _Model(states, jnp.full(4, 0.5))
        closed = es.transform.jit(lambda x: model(x))
        passed = es.transform.jit(lambda model, x: model(x))
        systems["jit(closed)"] = lambda: closed(x)
        systems["jit(model, x)"] = lambda: passed(model, x)
        systems["floor(array)"] = floor_with_array
        flagged = es.transform.jit(step_or_eval, static_argnames="train")
        systems["floor(flag)"] = floor_flag
        systems["transform.jit(flag)"] = lambda: (
            flagged(x, train=True),
            flagged(x, train=False),
        )[1]
    pure_donating = jax.jit(pure.__wrapped__, donate_argnums=0)
    box["donated"] = {k: jnp.copy(v) for k, v in box["dict"].items()}

    def floor_donate():
        box["donated"], out = pure_donating(box["donated"], x)
        return out

    systems["floor(donate)"] = floor_donate
    if hasattr(es.transform, "jit"):
        donated = [es.ShortTermState(jnp.zeros(4), name=f"d{i}") for i in range(n)]

        def donating_step(x):
            for s in donated:
                s.value = s.value * 0.5 + x
            return x.sum()

        donating = es.transform.jit(donating_step, donate_states=True)
        systems["transform.jit(donate)"] = lambda: donating(x)
    systems["jax.jit(module)"] = via_jax_module
    systems["eqx.filter_jit(module)"] = via_eqx_module
    return systems


class _Module(eqx.Module):
    decay: jax.Array


class _Model(eqx.Module):
    states: list
    decay: jax.Array

    def __call__(self, x):
        for s in self.states:
            s.value = s.value * self.decay + x
        return x.sum()


def _trace_times(n: int) -> tuple[float, float]:
    states = [es.ShortTermState(jnp.zeros(4)) for _ in range(n)]
    x = jnp.ones(4)

    def step(x):
        for s in states:
            s.value = s.value * 0.5 + x
        return x.sum()

    def pure(values, x):
        return {k: v * 0.5 + x for k, v in values.items()}, x.sum()

    values = {f"s{i}": jnp.zeros(4) for i in range(n)}
    plain = once(lambda: jax.make_jaxpr(pure)(values, x))
    ours = once(lambda: es.transform.StatefulFunction(step).make_jaxpr(x).get_jaxpr())
    return plain, ours


def main(sizes: tuple[int, ...] = (1, 10, 100, 1000), quick: bool = False) -> None:
    print(f"# dispatch: a jitted step touching N states ({machine()})\n")
    print(
        "per-call time in us: median (min-max) over interleaved rounds; ratio: median "
        "over rounds of time / floor time in the same round\n"
    )
    print("| N | system | median us | min-max us | ratio |")
    print("| --- | --- | --- | --- | --- |")
    model_ratios: dict[int, tuple[float, float]] = {}
    for n in sizes:
        rounds = 5 if quick else (60 if n < 1000 else 15)
        calls = 5 if quick else (50 if n < 100 else (20 if n < 1000 else 5))
        results = interleaved(_systems(n), rounds=rounds, calls=calls)
        floor = results["floor"]
        for name, t in results.items():
            print(
                f"| {n} | {name} | {t.median:.1f} | {t.min:.1f}-{t.max:.1f} "
                f"| {t.ratio_to(floor):.2f} |"
            )
        if "jit(model, x)" in results:
            passed, closed = results["jit(model, x)"], results["jit(closed)"]
            jax_alone = results["floor(array)"].ratio_to(floor)
            model_ratios[n] = (passed.ratio_to(closed), jax_alone)
    print(
        "\na model as an argument, paired by round: jit(model, x) / jit(closed), and "
        "what JAX alone charges for the array as an argument: floor(array) / floor\n"
    )
    print("| N | jit(model, x) / jit(closed) | floor(array) / floor |")
    print("| --- | --- | --- |")
    for n, (ratio, jax_alone) in model_ratios.items():
        print(f"| {n} | {ratio:.3f} | {jax_alone:.3f} |")
    print("\nfirst trace, ms (eqstate traces the stateful function once)\n")
    print("| N | jax.make_jaxpr(pure) | StatefulFunction.make_jaxpr | us per state |")
    print("| --- | --- | --- | --- |")
    for n in sizes:
        plain, ours = _trace_times(n)
        print(f"| {n} | {plain:.1f} | {ours:.1f} | {ours * 1e3 / n:.0f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds, for CI")
    args = parser.parse_args()
    main(quick=args.quick)
