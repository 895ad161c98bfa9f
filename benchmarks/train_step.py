"""A training step on the device at hand, against plain JAX with donation.

Run with `python -m benchmarks.train_step` (`--quick` for a smoke run). A 4-layer MLP
trained with `optax.adam`, written five ways:

- `floor`: `jax.jit` of a pure step over the parameter and optimiser PyTrees with
  `donate_argnums=(0, 1)`: the floor every ratio is taken against;
- `floor, not donating`: the same without donation;
- `Equinox`: an `eqx.nn.Linear` model passed in, `eqx.filter_jit(donate="all")`;
- `Flax NNX`: `nnx.jit` over an `nnx.Optimizer` (when flax is installed);
- `eqstate, model in`: the `eqx.nn.Linear` model passed in, gradients with
  `argnums=0`, `es.trainable` / `es.apply_updates`, the optimiser state in a
  `LongTermState`, `jit(..., donate_states=True, donate_argnums=0)`;
- `eqstate, ParamStates`: the weights in `ParamState`s read by the step,
  `grad_states=es.ParamState`, `jit(..., donate_states=True)`.

Each sample is the mean time per step over 50 steps dispatched back to back, then
synchronised; the table gives the median over rounds and the paired ratio to the
floor, at a dispatch-bound size (width 128, batch 32) and a compute-bound one (width
4096, batch 2048; width 512 with `--quick`). `--memory` also runs each system alone in
a child process on a model whose parameters and optimiser state take over a quarter of
the device's memory, and reports its peak (`peak_bytes_in_use`, where the backend
reports it; the CPU does not).
"""

import argparse
import json
import subprocess
import sys
from collections.abc import Callable

import eqstate as es
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax

from ._timing import interleaved, machine


_DEPTH = 4
_STEPS_PER_SAMPLE = 50

try:
    from flax import nnx
except ImportError:  # An optional peer.
    nnx = None


def _data(width: int, batch: int) -> tuple[jax.Array, jax.Array]:
    kx, ky = jr.split(jr.key(1))
    return jr.normal(kx, (batch, width)), jr.normal(ky, (batch, width))


def _keys() -> list[jax.Array]:
    return list(jr.split(jr.key(0), _DEPTH))


class _MLP(eqx.Module):
    layers: list[eqx.nn.Linear]

    def __init__(self, width: int):
        self.layers = [eqx.nn.Linear(width, width, key=k) for k in _keys()]

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers[:-1]:
            x = jax.nn.relu(jax.vmap(layer)(x))
        return jax.vmap(self.layers[-1])(x)


class _StateMLP(eqx.Module):
    weights: list[es.ParamState]
    biases: list[es.ParamState]

    def __init__(self, width: int):
        template = _MLP(width)
        self.weights = [es.ParamState(layer.weight) for layer in template.layers]
        self.biases = [es.ParamState(layer.bias) for layer in template.layers]

    def __call__(self, x: jax.Array) -> jax.Array:
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            x = x @ w.value.T + b.value
            x = x if i == _DEPTH - 1 else jax.nn.relu(x)
        return x


def _mse(pred: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((pred - y) ** 2)


def _floor(width: int, batch: int, donate: bool) -> Callable[[], object]:
    optimizer = optax.adam(1e-4)
    params = eqx.filter(_MLP(width), eqx.is_array)
    box = {"params": params, "opt": optimizer.init(params)}
    x, y = _data(width, batch)

    def step(params, opt_state, x, y):
        def loss(params):
            return _mse(params(x), y)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    jitted = jax.jit(step, donate_argnums=(0, 1) if donate else ())

    def run():
        box["params"], box["opt"], value = jitted(box["params"], box["opt"], x, y)
        return value

    return run


def _equinox(width: int, batch: int) -> Callable[[], object]:
    optimizer = optax.adam(1e-4)
    model = _MLP(width)
    box = {"model": model, "opt": optimizer.init(eqx.filter(model, eqx.is_array))}
    x, y = _data(width, batch)

    @eqx.filter_jit(donate="all")
    def step(model, opt_state, x, y):
        value, grads = eqx.filter_value_and_grad(lambda m: _mse(m(x), y))(model)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, value

    def run():
        box["model"], box["opt"], value = step(box["model"], box["opt"], x, y)
        return value

    return run


def _nnx(width: int, batch: int) -> Callable[[], object]:
    assert nnx is not None
    rngs = nnx.Rngs(0)
    layers = [nnx.Linear(width, width, rngs=rngs) for _ in range(_DEPTH)]

    class Model(nnx.Module):
        def __init__(self):
            self.layers = nnx.List(layers)

        def __call__(self, x):
            for layer in self.layers[:-1]:
                x = jax.nn.relu(layer(x))
            return self.layers[-1](x)

    model = Model()
    optimizer = nnx.Optimizer(model, optax.adam(1e-4), wrt=nnx.Param)
    x, y = _data(width, batch)

    @nnx.jit
    def step(model, optimizer, x, y):
        value, grads = nnx.value_and_grad(lambda m: _mse(m(x), y))(model)
        optimizer.update(model, grads)
        return value

    return lambda: step(model, optimizer, x, y)


def _eqstate_model_in(width: int, batch: int) -> Callable[[], object]:
    optimizer = optax.adam(1e-4)
    model = _MLP(width)
    opt_state = es.LongTermState(optimizer.init(es.trainable(model)))
    box = {"model": model}
    x, y = _data(width, batch)

    def loss(model, x, y):
        return _mse(model(x), y)

    @es.transform.jit(donate_states=True, donate_argnums=0)
    def step(model, x, y):
        grad = es.transform.grad(
            loss, argnums=0, grad_states=es.ParamState, return_value=True
        )
        grads, value = grad(model, x, y)
        updates, opt_state.value = optimizer.update(
            grads, opt_state.value, es.trainable(model)
        )
        return es.apply_updates(model, updates), value

    def run():
        box["model"], value = step(box["model"], x, y)
        return value

    return run


def _eqstate_params(width: int, batch: int) -> Callable[[], object]:
    optimizer = optax.adam(1e-4)
    model = _StateMLP(width)
    opt_state = es.LongTermState(optimizer.init(es.values_of(model, es.ParamState)))
    x, y = _data(width, batch)

    @es.transform.jit(donate_states=True)
    def step(x, y):
        grads, value = es.transform.grad(
            lambda: _mse(model(x), y), grad_states=es.ParamState, return_value=True
        )()
        params = es.values_of(model, es.ParamState)
        updates, opt_state.value = optimizer.update(grads, opt_state.value, params)
        es.assign(optax.apply_updates(params, updates))
        return value

    return lambda: step(x, y)


_SYSTEMS: dict[str, Callable[[int, int], Callable[[], object]]] = {
    "floor": lambda w, b: _floor(w, b, donate=True),
    "floor, not donating": lambda w, b: _floor(w, b, donate=False),
    "Equinox": _equinox,
    "Flax NNX": _nnx,
    "eqstate, model in": _eqstate_model_in,
    "eqstate, ParamStates": _eqstate_params,
}


def _available() -> list[str]:
    return [name for name in _SYSTEMS if name != "Flax NNX" or nnx is not None]


def _timings(width: int, batch: int, rounds: int) -> None:
    systems = {name: _SYSTEMS[name](width, batch) for name in _available()}
    timings = interleaved(systems, rounds=rounds, calls=_STEPS_PER_SAMPLE, warmup=3)
    floor = timings["floor"]
    print(f"\n## width {width}, batch {batch}\n")
    print("| system | median us per step | min-max us | ratio to floor |")
    print("| --- | --- | --- | --- |")
    for name, t in timings.items():
        ratio = t.ratio_to(floor)
        print(f"| {name} | {t.median:.0f} | {t.min:.0f}-{t.max:.0f} | {ratio:.2f} |")


def _memory_width() -> int:
    """A width at which the parameters and Adam's two moments take about 30% of the
    device's memory (4 square float32 layers: 12 * width**2 bytes each)."""
    limit = jax.devices()[0].memory_stats()["bytes_limit"]
    return int((0.3 * limit / (_DEPTH * 12)) ** 0.5) // 128 * 128


def _peak(name: str) -> None:
    """Runs a few steps of one system on the memory-sized model and prints its peak
    device memory as JSON."""
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" not in stats:
        print(json.dumps({"peak": None}))
        return
    width = _memory_width()
    run = _SYSTEMS[name](width, 256)
    for _ in range(3):
        jax.block_until_ready(run())
    stats = jax.devices()[0].memory_stats()
    print(
        json.dumps(
            {
                "peak": stats["peak_bytes_in_use"],
                "limit": stats["bytes_limit"],
                "width": width,
            }
        )
    )


def _memory() -> None:
    """Each system alone in a child process (the parent leaves the device alone: one
    process at a time may hold a TPU)."""
    rows = []
    for name in _available():
        child = subprocess.run(
            [sys.executable, "-m", "benchmarks.train_step", "--peak", name],
            capture_output=True,
            text=True,
            check=False,
        )
        lines = child.stdout.strip().splitlines()
        if child.returncode != 0 or not lines:
            rows.append((name, None, child.stderr.strip().splitlines()[-1:]))
            continue
        rows.append((name, json.loads(lines[-1]), None))
    found = [r for _, r, _ in rows if r and r["peak"] is not None]
    if not found:
        print("\nthe backend reports no peak memory: skipped")
        return
    width, limit = found[0]["width"], found[0]["limit"]
    state_bytes = _DEPTH * width * width * 4 * 3
    print(
        f"\n## peak device memory, width {width} (parameters and optimiser state "
        f"{state_bytes / 2**30:.1f} GiB of {limit / 2**30:.1f} GiB)\n"
    )
    print("| system | peak GiB | ratio to floor |")
    print("| --- | --- | --- |")
    floor = {n: r for n, r, _ in rows}.get("floor")
    for name, result, error in rows:
        if result is None:
            print(f"| {name} | failed: {error} | |")
            continue
        ratio = result["peak"] / floor["peak"] if floor else float("nan")
        print(f"| {name} | {result['peak'] / 2**30:.2f} | {ratio:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run, for CI")
    parser.add_argument("--memory", action="store_true", help="peak memory instead")
    parser.add_argument("--peak", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak:
        return _peak(args.peak)
    if args.memory:
        return _memory()
    print(f"# train_step: a 4-layer MLP with optax.adam ({machine()})")
    rounds = 2 if args.quick else 7
    _timings(128, 32, rounds)
    _timings(512 if args.quick else 4096, 64 if args.quick else 2048, rounds)


if __name__ == "__main__":
    main()
