"""eqstate side by side with brainstate, Flax NNX and Equinox, with plain JAX as the
floor of every table.

Run with `python -m benchmarks.peers` to print the tables, or with
`python -m benchmarks.report` to write them to `docs/benchmarks.md`. Four workloads,
each measured in one process with the systems taking turns:

1. `step`: per-call time of a jitted step that updates N small states
    (`s = 0.5 * s + x` on N arrays of shape `(4,)`), N = 1, 10, 100, 1000;
2. `first_call`: the first call of a freshly built step of the same kind (trace,
    lowering, XLA compilation and one run), per N and per state;
3. `ensemble`: building K = 8 and 64 two-layer MLPs (16-64-1) with per-lane random
    initialisation, eagerly and under each system's `jit`;
4. `train`: one training step (forward, gradient, Adam update, running statistics) of
    a BatchNorm MLP (32-64-1, batch 128).

brainstate and Flax are optional (`pip install -e '.[bench]'`): a peer that is not
installed is reported as missing, one that cannot run a workload as unsupported, with
the reason. Every system is checked against the floor (same values after its first
calls) before it is timed.
"""

import argparse
import dataclasses
import importlib
import warnings
from collections.abc import Callable
from typing import Any

import eqstate as es
import eqstate.nn as enn
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

from . import ensemble as _ensemble
from ._timing import first_calls, interleaved, machine, Timing, versions


def _optional(module: str, distribution: str) -> tuple[Any, str | None]:
    try:
        return importlib.import_module(module), None
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] == distribution:
            return None, f"{distribution} not installed"
        return None, f"importing {module}: {exc}"
    # An incompatible peer fails in many ways (an AttributeError on a moved JAX
    # internal, ...), not only with an ImportError: any failure makes it missing.
    except Exception as exc:
        first_line = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        return None, f"importing {module}: {first_line}"


brainstate, _BRAINSTATE_ERROR = _optional("brainstate", "brainstate")
nnx, _NNX_ERROR = _optional("flax.nnx", "flax")

# Why each optional peer is missing, by distribution (`None`: it imported).
PEER_ERRORS: dict[str, str | None] = {
    "brainstate": _BRAINSTATE_ERROR,
    "flax": _NNX_ERROR,
}
DISTRIBUTIONS = ("jax", "jaxlib", "eqstate", "equinox", "optax", "brainstate", "flax")

FLOOR = "plain JAX (floor)"
EQSTATE = "eqstate"
BRAINSTATE = "brainstate"
NNX = "NNX nnx.jit"
NNX_CACHED = "NNX cached_partial"
NNX_TREE = "NNX nnx.jit(graph=False)"
EQUINOX = "Equinox eqx.nn.State"
EQSTATE_EAGER_OPTAX = "eqstate, optax outside jit"
BRAINSTATE_JIT_BUILD = "brainstate jit(vmap_new_states)"
NNX_JIT_BUILD = "NNX jit(split_rngs + vmap)"
# `--quick` skips the other ways of running a system already in the table, and the
# peers' jitted ensemble builds (XLA takes seconds to compile the vmapped random draws
# of each, on a small CPU).
QUICK_SKIPS = frozenset(
    {NNX_CACHED, NNX_TREE, EQSTATE_EAGER_OPTAX, BRAINSTATE_JIT_BUILD, NNX_JIT_BUILD}
)


class Unsupported(Exception):
    """The system cannot run this workload; the message says why."""


@dataclasses.dataclass
class Row:
    """One line of a table: a system's timing in one group (an N, a K, ...), or the
    reason it has none."""

    group: str
    system: str
    timing: Timing | None = None
    ratio: float | None = None
    note: str = ""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Table:
    """The rows of one workload, and what they measure."""

    name: str
    title: str
    unit: str
    rows: list[Row]
    floor_of: dict[str, str] = dataclasses.field(default_factory=dict)


# A builder returns the function to time; `peer` names the distribution it needs.
_Builder = tuple[str | None, Callable[[], Any]]


def _prepare(
    builders: dict[str, _Builder], quick: bool = False
) -> tuple[dict[str, Any], dict[str, str]]:
    """Builds every system whose peer is installed. Returns the built ones and, for
    the others, why not. A peer that fails to build is reported, not raised: its API
    may have moved. eqstate, Equinox and the floor always raise. `quick` skips the
    systems in `QUICK_SKIPS`."""
    built: dict[str, Any] = {}
    notes: dict[str, str] = {}
    for name, (peer, build) in builders.items():
        if peer is not None and PEER_ERRORS[peer] is not None:
            notes[name] = f"missing ({PEER_ERRORS[peer]})"
            continue
        if quick and name in QUICK_SKIPS:
            notes[name] = "skipped (--quick)"
            continue
        try:
            built[name] = build()
        except Unsupported as exc:
            notes[name] = f"unsupported: {exc}"
        except Exception as exc:
            if peer is None:
                raise
            notes[name] = f"failed: {type(exc).__name__}: {exc}".splitlines()[0][:160]
    return built, notes


def _close(got: Any, want: Any, what: str, rtol: float = 1e-4) -> None:
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    if len(got_leaves) != len(want_leaves) or not all(
        np.allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=rtol)
        for a, b in zip(got_leaves, want_leaves)
    ):
        raise AssertionError(f"{what}: got {got}, the floor gives {want}")


def _rows(
    group: str,
    names: list[str],
    timings: dict[str, Timing],
    notes: dict[str, str],
    floor_of: Callable[[str], str],
) -> list[Row]:
    rows = []
    for name in names:
        if name in timings:
            t = timings[name]
            rows.append(Row(group, name, t, t.ratio_to(timings[floor_of(name)])))
        else:
            rows.append(Row(group, name, note=notes[name]))
    return rows


# --- 1 and 2: a jitted step touching N states ----------------------------------------

_X = jnp.ones(4)


@dataclasses.dataclass
class _Stepper:
    call: Callable[[], Any]
    probe: Callable[[], Any]  # the first and the last state's values


def _floor_step(n: int) -> _Stepper:
    box = {"values": {f"s{i}": jnp.zeros(4) for i in range(n)}}

    @jax.jit
    def pure(values, x):
        return {k: v * 0.5 + x for k, v in values.items()}, x.sum()

    def call():
        box["values"], out = pure(box["values"], _X)
        return out

    return _Stepper(call, lambda: (box["values"]["s0"], box["values"][f"s{n - 1}"]))


def _eqstate_step(n: int) -> _Stepper:
    states = [es.ShortTermState(jnp.zeros(4)) for _ in range(n)]

    def step(x):
        for s in states:
            s.value = s.value * 0.5 + x
        return x.sum()

    jitted = es.transform.jit(step)
    return _Stepper(lambda: jitted(_X), lambda: (states[0].value, states[-1].value))


def _brainstate_step(n: int) -> _Stepper:
    states = [brainstate.ShortTermState(jnp.zeros(4)) for _ in range(n)]

    def step(x):
        for s in states:
            s.value = s.value * 0.5 + x
        return x.sum()

    jitted = brainstate.transform.jit(step)
    return _Stepper(lambda: jitted(_X), lambda: (states[0].value, states[-1].value))


if nnx is not None:

    class _NnxStates(nnx.Module):
        def __init__(self, n: int):
            self.states = nnx.List([nnx.Variable(jnp.zeros(4)) for _ in range(n)])

    class _NnxEnsembleMLP(nnx.Module):
        def __init__(self, rngs):
            _ensemble.RUNS["count"] += 1
            n_in, n_hidden, n_out = _ensemble.N_IN, _ensemble.N_HIDDEN, _ensemble.N_OUT
            w1 = jr.normal(rngs.params(), (n_hidden, n_in)) / n_in**0.5
            w2 = jr.normal(rngs.params(), (n_out, n_hidden)) / n_hidden**0.5
            self.w1 = nnx.Param(w1)
            self.b1 = nnx.Param(jnp.zeros(n_hidden))
            self.w2 = nnx.Param(w2)
            self.b2 = nnx.Param(jnp.zeros(n_out))


def _nnx_step(n: int, variant: str) -> _Stepper:
    module = _NnxStates(n)

    # `set_value`, not `v[...] = ...`: under a trace the latter compares shardings
    # (`getattr(tracer, "sharding", None)`), and JAX 0.10 builds that AttributeError's
    # message by scanning the whole trace, so the first call grows as N**2.
    def step(m, x):
        for v in m.states:
            v.set_value(v.get_value() * 0.5 + x)
        return x.sum()

    if variant == "graph":
        jitted = nnx.jit(step)
        call = lambda: jitted(module, _X)  # noqa: E731
    elif variant == "cached":
        cached = nnx.cached_partial(nnx.jit(step), module)
        call = lambda: cached(_X)  # noqa: E731
    else:
        jitted = nnx.jit(step, graph=False)
        call = lambda: jitted(module, _X)  # noqa: E731
    return _Stepper(call, lambda: (module.states[0][...], module.states[-1][...]))


class _EqxStates(eqx.Module):
    indices: list[eqx.nn.StateIndex]

    def __init__(self, n: int):
        self.indices = [eqx.nn.StateIndex(jnp.zeros(4)) for _ in range(n)]


def _equinox_step(n: int) -> _Stepper:
    model, state = eqx.nn.make_with_state(_EqxStates)(n)
    box = {"state": state}

    @eqx.filter_jit
    def step(model, state, x):
        for i in model.indices:
            state = state.set(i, state.get(i) * 0.5 + x)
        return x.sum(), state

    def call():
        out, box["state"] = step(model, box["state"], _X)
        return out

    def probe():
        return box["state"].get(model.indices[0]), box["state"].get(model.indices[-1])

    return _Stepper(call, probe)


def _step_builders(n: int) -> dict[str, tuple[str | None, Callable[[], _Stepper]]]:
    return {
        FLOOR: (None, lambda: _floor_step(n)),
        EQSTATE: (None, lambda: _eqstate_step(n)),
        BRAINSTATE: ("brainstate", lambda: _brainstate_step(n)),
        NNX: ("flax", lambda: _nnx_step(n, "graph")),
        NNX_CACHED: ("flax", lambda: _nnx_step(n, "cached")),
        NNX_TREE: ("flax", lambda: _nnx_step(n, "tree")),
        EQUINOX: (None, lambda: _equinox_step(n)),
    }


def _checked_step(build: Callable[[], _Stepper]) -> Callable[[], Any]:
    stepper = build()
    out = stepper.call()
    # One step from zeros gives `x` in every state, and returns `x.sum()`.
    _close((out, stepper.probe()), (_X.sum(), (_X, _X)), "first step")
    return stepper.call


def step(sizes: tuple[int, ...] = (1, 10, 100, 1000), quick: bool = False) -> Table:
    """Workload 1: per-call time of a jitted step that updates N states."""
    rows: list[Row] = []
    for n in sizes:
        builders = _step_builders(n)
        built, notes = _prepare(
            {
                k: (peer, lambda b=b: _checked_step(b))
                for k, (peer, b) in builders.items()
            },
            quick,
        )
        if quick:
            rounds, calls = 5, 5
        else:
            rounds = 40 if n < 1000 else 15
            calls = 50 if n < 100 else (10 if n < 1000 else 3)
        timings = interleaved(built, rounds=rounds, calls=calls)
        rows += _rows(f"{n}", list(builders), timings, notes, lambda _: FLOOR)
    return Table("step", "a jitted step touching N states", "us per call", rows)


def first_call(
    sizes: tuple[int, ...] = (1, 10, 100, 1000), quick: bool = False
) -> Table:
    """Workload 2: the first call of a freshly built step (trace and compile)."""
    rows: list[Row] = []
    for n in sizes:
        builders = _step_builders(n)
        # Build (and discard) one of each first, so that a missing peer is reported
        # and a failing one is caught here rather than in the timed loop.
        _, notes = _prepare({k: (peer, b) for k, (peer, b) in builders.items()}, quick)
        factories = {
            name: (lambda b=b: b().call)
            for name, (_, b) in builders.items()
            if name not in notes
        }
        repeats = 2 if quick else (7 if n < 1000 else 4)
        timings = first_calls(factories, repeats=repeats)
        group_rows = _rows(f"{n}", list(builders), timings, notes, lambda _: FLOOR)
        for row in group_rows:
            if row.timing is not None:
                row.extra["per_state"] = row.timing.per(n)
        rows += group_rows
    return Table("first_call", "first call of a fresh jitted step", "ms", rows)


# --- 3: building an ensemble ---------------------------------------------------------

EAGER_FLOOR = "Equinox filter_vmap (floor)"
JIT_FLOOR = "Equinox filter_jit(filter_vmap) (floor)"


def _in_order(arrays: dict[str, jax.Array]) -> list[jax.Array]:
    return [arrays[name] for name in ("w1", "b1", "w2", "b2")]


def _eqx_eager_build(k: int) -> Callable[[], Any]:
    keys = jr.split(jr.key(0), k)
    return lambda: _in_order(eqx.filter_vmap(_ensemble.make_arrays)(keys))


def _eqx_jit_build(k: int) -> Callable[[], Any]:
    keys = jr.split(jr.key(0), k)
    build = eqx.filter_jit(eqx.filter_vmap(_ensemble.make_arrays))
    return lambda: _in_order(build(keys))


def _eqstate_build(k: int, jit: bool) -> Callable[[], Any]:
    build = es.transform.vmap_new_states(_ensemble.MLP, axis_size=k)
    if jit:
        build = es.transform.jit(build)

    def call():
        m = build()
        return [m.w1.value, m.b1.value, m.w2.value, m.b2.value]

    return call


def _brainstate_build(k: int, jit: bool) -> Callable[[], Any]:
    n_in, n_hidden, n_out = _ensemble.N_IN, _ensemble.N_HIDDEN, _ensemble.N_OUT
    made: dict[str, Any] = {}

    # brainstate's vmap_new_states must return JAX values, so the model leaves by a
    # side effect, as in brainstate's own examples.
    def ctor():
        _ensemble.RUNS["count"] += 1
        made["w1"] = brainstate.ParamState(
            brainstate.random.normal(size=(n_hidden, n_in)) / n_in**0.5
        )
        made["b1"] = brainstate.ParamState(jnp.zeros(n_hidden))
        made["w2"] = brainstate.ParamState(
            brainstate.random.normal(size=(n_out, n_hidden)) / n_hidden**0.5
        )
        made["b2"] = brainstate.ParamState(jnp.zeros(n_out))

    build = brainstate.transform.vmap_new_states(ctor, axis_size=k)
    if jit:
        build = brainstate.transform.jit(build)

    def call():
        build()
        return [made[name].value for name in ("w1", "b1", "w2", "b2")]

    if jit:
        try:
            call()
        except brainstate.TraceContextError as exc:
            raise Unsupported(
                "states created under brainstate.transform.jit hold tracers that die "
                f"with the trace ({type(exc).__name__} on the first read)"
            ) from None
    return call


def _nnx_build(k: int, jit: bool) -> Callable[[], Any]:
    rngs = nnx.Rngs(0)

    @nnx.split_rngs(splits=k)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return _NnxEnsembleMLP(rngs)

    build = nnx.jit(create) if jit else create

    def call():
        m = build(rngs)
        return [m.w1[...], m.b1[...], m.w2[...], m.b2[...]]

    return call


def _checked_build(build: Callable[[], Callable[[], Any]], k: int) -> Callable:
    call = build()
    w1, b1, w2, b2 = call()
    n_in, n_hidden, n_out = _ensemble.N_IN, _ensemble.N_HIDDEN, _ensemble.N_OUT
    shapes = [(k, n_hidden, n_in), (k, n_hidden), (k, n_out, n_hidden), (k, n_out)]
    if [a.shape for a in (w1, b1, w2, b2)] != shapes:
        raise AssertionError(f"ensemble shapes {[a.shape for a in (w1, b1, w2, b2)]}")
    # Every lane must be initialised with its own random draw.
    if len({tuple(np.asarray(row).round(6).ravel()) for row in w1}) != k:
        raise AssertionError("ensemble members share their initialisation")
    return call


def _constructor_runs(call: Callable[[], Any]) -> int:
    _ensemble.RUNS["count"] = 0
    call()
    return _ensemble.RUNS["count"]


def _ensemble_builders(k: int) -> dict[str, _Builder]:
    return {
        EAGER_FLOOR: (None, lambda: _eqx_eager_build(k)),
        "eqstate vmap_new_states": (None, lambda: _eqstate_build(k, False)),
        "brainstate vmap_new_states": (
            "brainstate",
            lambda: _brainstate_build(k, False),
        ),
        "NNX split_rngs + vmap": ("flax", lambda: _nnx_build(k, False)),
        JIT_FLOOR: (None, lambda: _eqx_jit_build(k)),
        "eqstate jit(vmap_new_states)": (None, lambda: _eqstate_build(k, True)),
        BRAINSTATE_JIT_BUILD: ("brainstate", lambda: _brainstate_build(k, True)),
        NNX_JIT_BUILD: ("flax", lambda: _nnx_build(k, True)),
    }


def ensemble(sizes: tuple[int, ...] = (8, 64), quick: bool = False) -> Table:
    """Workload 3: building K two-layer MLPs with per-lane random initialisation."""
    rows: list[Row] = []
    floor_of: dict[str, str] = {}
    for k in sizes:
        builders = _ensemble_builders(k)
        built, notes = _prepare(
            {
                name: (peer, lambda b=b, k=k: _checked_build(b, k))
                for name, (peer, b) in builders.items()
            },
            quick,
        )
        jitted = {name for name in builders if "jit" in name}
        for name in builders:
            floor_of[name] = JIT_FLOOR if name in jitted else EAGER_FLOOR
        timings = interleaved(
            built, rounds=3 if quick else 25, calls=2 if quick else 5, warmup=2
        )
        # Microseconds per call to milliseconds per build.
        timings = {name: t.per(1000) for name, t in timings.items()}
        group_rows = _rows(f"{k}", list(builders), timings, notes, floor_of.get)
        for row in group_rows:
            row.extra["mode"] = "jit" if row.system in jitted else "eager"
            # The floors build arrays from keys: they have no constructor to count.
            if row.system in built and row.system not in (EAGER_FLOOR, JIT_FLOOR):
                row.extra["runs"] = _constructor_runs(built[row.system])
        rows += group_rows
    return Table(
        "ensemble", "building an ensemble of K MLPs", "ms per build", rows, floor_of
    )


# --- 4: a training step of a BatchNorm MLP ------------------------------------------

_BATCH, _D_IN, _HIDDEN = 128, 32, 64
_MOMENTUM, _EPS = 0.9, 1e-5
_OPTIMISER = optax.adam(1e-3)


def _train_data() -> tuple[dict[str, jax.Array], jax.Array, jax.Array]:
    # NumPy draws: eager `jax.random` calls would each compile a kernel (seconds on a
    # small CPU) before the workload starts.
    rng = np.random.default_rng(42)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    params = {
        "w1": normal(_D_IN, _HIDDEN) / _D_IN**0.5,
        "b1": jnp.zeros(_HIDDEN),
        "gamma": jnp.ones(_HIDDEN),
        "beta": jnp.zeros(_HIDDEN),
        "w2": normal(_HIDDEN, 1) / _HIDDEN**0.5,
        "b2": jnp.zeros(1),
    }
    x = normal(_BATCH, _D_IN)
    y = jnp.sin(x[:, :1] * 2.0)
    return params, x, y


def _floor_train() -> Callable[[], Any]:
    params, x, y = _train_data()
    stats = {"mean": jnp.zeros(_HIDDEN), "var": jnp.ones(_HIDDEN)}

    def loss_fn(params, stats, x, y):
        h = x @ params["w1"] + params["b1"]
        mean = h.mean(axis=0)
        var = jnp.square(h - mean).mean(axis=0)
        h = (h - mean) / jnp.sqrt(var + _EPS) * params["gamma"] + params["beta"]
        out = jax.nn.relu(h) @ params["w2"] + params["b2"]
        mean, var = jax.lax.stop_gradient((mean, var))
        new_stats = {
            "mean": _MOMENTUM * stats["mean"] + (1 - _MOMENTUM) * mean,
            "var": _MOMENTUM * stats["var"] + (1 - _MOMENTUM) * var,
        }
        return jnp.mean(jnp.square(out - y)), new_stats

    @jax.jit
    def train_step(params, stats, opt_state, x, y):
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, stats, x, y
        )
        updates, opt_state = _OPTIMISER.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), stats, opt_state

    box = {"params": params, "stats": stats, "opt": _OPTIMISER.init(params)}

    def call():
        loss, box["params"], box["stats"], box["opt"] = train_step(
            box["params"], box["stats"], box["opt"], x, y
        )
        return loss

    return call


class _EqstateMLP(eqx.Module):
    w1: es.ParamState
    b1: es.ParamState
    bn: enn.BatchNorm
    w2: es.ParamState
    b2: es.ParamState

    def __init__(self, params: dict[str, jax.Array]):
        self.w1 = es.ParamState(params["w1"], name="w1")
        self.b1 = es.ParamState(params["b1"], name="b1")
        self.bn = enn.BatchNorm(_HIDDEN, momentum=_MOMENTUM, eps=_EPS)
        self.w2 = es.ParamState(params["w2"], name="w2")
        self.b2 = es.ParamState(params["b2"], name="b2")

    def __call__(self, x):
        h = jax.nn.relu(self.bn(x @ self.w1.value + self.b1.value))
        return h @ self.w2.value + self.b2.value


def _eqstate_train(optax_inside: bool) -> Callable[[], Any]:
    params, x, y = _train_data()
    model = _EqstateMLP(params)

    def loss_fn(x, y):
        return jnp.mean(jnp.square(model(x) - y))

    grad_fn = es.transform.value_and_grad(loss_fn, grad_states=es.ParamState)
    box = {"opt": _OPTIMISER.init(es.values_of(model, es.ParamState))}

    if optax_inside:

        @es.transform.jit
        def train_step(opt_state, x, y):
            loss, grads = grad_fn(x, y)
            current = es.values_of(model, es.ParamState)
            updates, opt_state = _OPTIMISER.update(grads, opt_state, current)
            es.assign(optax.apply_updates(current, updates))
            return loss, opt_state

        def call():
            loss, box["opt"] = train_step(box["opt"], x, y)
            return loss

        return call

    # The pattern of tests/test_end_to_end_rnn.py: only the gradient is compiled, and
    # optax runs eagerly on the StateDicts.
    jitted_grad = es.transform.jit(grad_fn)

    def call_eager():
        loss, grads = jitted_grad(x, y)
        current = es.values_of(model, es.ParamState)
        updates, box["opt"] = _OPTIMISER.update(grads, box["opt"], current)
        es.assign(optax.apply_updates(current, updates))
        return loss

    return call_eager


def _brainstate_train() -> Callable[[], Any]:
    params, x, y = _train_data()

    class MLP(brainstate.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = brainstate.ParamState(params["w1"])
            self.b1 = brainstate.ParamState(params["b1"])
            self.bn = brainstate.nn.BatchNorm0d(
                (_HIDDEN,), momentum=_MOMENTUM, epsilon=_EPS
            )
            self.w2 = brainstate.ParamState(params["w2"])
            self.b2 = brainstate.ParamState(params["b2"])

        def update(self, x):
            h = jax.nn.relu(self.bn(x @ self.w1.value + self.b1.value))
            return h @ self.w2.value + self.b2.value

    model = MLP()
    weights = dict(model.states(brainstate.ParamState))

    def loss_fn(x, y):
        return jnp.mean(jnp.square(model(x) - y))

    grad_fn = brainstate.transform.grad(loss_fn, grad_states=weights, return_value=True)

    @brainstate.transform.jit
    def train_step(opt_state, x, y):
        with brainstate.environ.context(fit=True):
            grads, loss = grad_fn(x, y)
        current = {k: s.value for k, s in weights.items()}
        updates, opt_state = _OPTIMISER.update(grads, opt_state, current)
        new = optax.apply_updates(current, updates)
        for k, s in weights.items():
            s.value = new[k]
        return loss, opt_state

    box = {"opt": _OPTIMISER.init({k: s.value for k, s in weights.items()})}

    def call():
        loss, box["opt"] = train_step(box["opt"], x, y)
        return loss

    return call


def _nnx_train(variant: str) -> Callable[[], Any]:
    params, x, y = _train_data()

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.w1 = nnx.Param(params["w1"])
            self.b1 = nnx.Param(params["b1"])
            self.bn = nnx.BatchNorm(
                _HIDDEN, momentum=_MOMENTUM, epsilon=_EPS, rngs=rngs
            )
            self.w2 = nnx.Param(params["w2"])
            self.b2 = nnx.Param(params["b2"])

        def __call__(self, x):
            h = jax.nn.relu(self.bn(x @ self.w1[...] + self.b1[...]))
            return h @ self.w2[...] + self.b2[...]

    model = MLP(nnx.Rngs(0))
    optimiser = nnx.Optimizer(model, _OPTIMISER, wrt=nnx.Param)
    graph = variant != "tree"

    def train_step(model, optimiser, x, y):
        def loss_fn(model):
            return jnp.mean(jnp.square(model(x) - y))

        loss, grads = nnx.value_and_grad(loss_fn, graph=graph)(model)
        optimiser.update(model, grads)
        return loss

    if variant == "cached":
        cached = nnx.cached_partial(nnx.jit(train_step), model, optimiser)
        return lambda: cached(x, y)
    jitted = nnx.jit(train_step, graph=graph)
    return lambda: jitted(model, optimiser, x, y)


class _EqxMLP(eqx.Module):
    l1: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    l2: eqx.nn.Linear

    def __init__(self, params: dict[str, jax.Array]):
        # Shapes only: the weights are the floor's.
        l1 = eqx.filter_eval_shape(eqx.nn.Linear, _D_IN, _HIDDEN, key=jr.key(0))
        l2 = eqx.filter_eval_shape(eqx.nn.Linear, _HIDDEN, 1, key=jr.key(0))
        self.l1 = eqx.tree_at(
            lambda m: (m.weight, m.bias), l1, (params["w1"].T, params["b1"])
        )
        self.bn = eqx.nn.BatchNorm(
            _HIDDEN, axis_name="batch", eps=_EPS, momentum=_MOMENTUM, mode="batch"
        )
        self.l2 = eqx.tree_at(
            lambda m: (m.weight, m.bias), l2, (params["w2"].T, params["b2"])
        )

    def __call__(self, x, state):
        h, state = self.bn(self.l1(x), state)
        return self.l2(jax.nn.relu(h)), state


def _equinox_train() -> Callable[[], Any]:
    params, x, y = _train_data()
    model, state = eqx.nn.make_with_state(_EqxMLP)(params)

    @eqx.filter_jit
    def train_step(model, state, opt_state, x, y):
        def loss_fn(model, state):
            batched = jax.vmap(
                model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
            )
            out, state = batched(x, state)
            return jnp.mean(jnp.square(out - y)), state

        (loss, state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(
            model, state
        )
        updates, opt_state = _OPTIMISER.update(
            grads, opt_state, eqx.filter(model, eqx.is_inexact_array)
        )
        return loss, eqx.apply_updates(model, updates), state, opt_state

    box = {
        "model": model,
        "state": state,
        "opt": _OPTIMISER.init(eqx.filter(model, eqx.is_inexact_array)),
    }

    def call():
        loss, box["model"], box["state"], box["opt"] = train_step(
            box["model"], box["state"], box["opt"], x, y
        )
        return loss

    return call


def _train_builders() -> dict[str, _Builder]:
    return {
        FLOOR: (None, _floor_train),
        EQSTATE: (None, lambda: _eqstate_train(optax_inside=True)),
        EQSTATE_EAGER_OPTAX: (None, lambda: _eqstate_train(optax_inside=False)),
        BRAINSTATE: ("brainstate", _brainstate_train),
        NNX: ("flax", lambda: _nnx_train("graph")),
        NNX_CACHED: ("flax", lambda: _nnx_train("cached")),
        NNX_TREE: ("flax", lambda: _nnx_train("tree")),
        "Equinox eqx.nn.BatchNorm": (None, _equinox_train),
    }


_CHECK_STEPS = 3


def _checked_train(build: Callable[[], Callable[[], Any]], want: list[float] | None):
    call = build()
    # Same initial weights and data: the first losses must agree with the floor's,
    # which checks the batch statistics, the gradient and the Adam update.
    losses = [float(call()) for _ in range(_CHECK_STEPS)]
    if want is not None:
        _close(losses, want, "losses", rtol=1e-4)
    return call, losses


def train(quick: bool = False) -> Table:
    """Workload 4: a training step of a BatchNorm MLP with optax's Adam."""
    builders = _train_builders()
    floor, want = _checked_train(builders[FLOOR][1], None)
    built, notes = _prepare(
        {
            name: (peer, lambda b=b: _checked_train(b, want)[0])
            for name, (peer, b) in builders.items()
            if name != FLOOR
        },
        quick,
    )
    built = {FLOOR: floor, **built}
    timings = interleaved(built, rounds=5 if quick else 40, calls=5 if quick else 20)
    rows = _rows("", list(builders), timings, notes, lambda _: FLOOR)
    return Table("train", "a training step of a BatchNorm MLP", "us per step", rows)


# --- all of it -------------------------------------------------------------------------


def run_all(quick: bool = False) -> list[Table]:
    """Every workload, in the order of the page. `quick` takes few rounds and the
    small sizes only (for CI: under a minute)."""
    # NNX warns about APIs it is deprecating in favour of the ones used here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        small = (1, 10) if quick else (1, 10, 100, 1000)
        return [
            step(small, quick),
            first_call(small, quick),
            ensemble((8,) if quick else (8, 64), quick),
            train(quick),
        ]


def software() -> dict[str, str | None]:
    """The version of each system's distributions (`None` where it is missing)."""
    return versions(DISTRIBUTIONS)


def _format(t: Timing | None, digits: int) -> tuple[str, str]:
    if t is None:
        return "", ""
    return f"{t.median:.{digits}f}", f"{t.min:.{digits}f}-{t.max:.{digits}f}"


def print_tables(tables: list[Table]) -> None:
    """Plain markdown tables on stdout."""
    print(f"# eqstate and its peers ({machine()})\n")
    print(", ".join(f"{k} {v or 'missing'}" for k, v in software().items()) + "\n")
    for table in tables:
        print(f"## {table.name}: {table.title} ({table.unit})\n")
        print("| group | system | median | min-max | x floor | note |")
        print("| --- | --- | --- | --- | --- | --- |")
        for row in table.rows:
            median, spread = _format(row.timing, 1)
            ratio = "" if row.ratio is None else f"{row.ratio:.2f}"
            print(
                f"| {row.group} | {row.system} | {median} | {spread} | {ratio} "
                f"| {row.note} |"
            )
        print()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds, for CI")
    print_tables(run_all(quick=parser.parse_args().quick))
    jax.effects_barrier()
