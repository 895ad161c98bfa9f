"""Laws that hold for every program: random states, random sequences of reads and
writes, random nestings of `jit`/`vmap`/`scan`/`cond`/`grad`, and an exception
injected at a random point, against the same program in pure JAX.

1. eqstate's result equals the pure JAX program's;
2. after an exception, every state holds exactly its pre-call value (bitwise) and no
   value is a tracer;
3. `get_read_states` / `get_write_states` are the states the program reads only /
   writes.

The CI profile runs a few hundred examples; `pytest tests/test_properties.py
--hypothesis-profile=long` runs the long one (10,000).
"""

import contextvars
import functools

import eqstate as es
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import example, given, note, settings

from .helpers import run_in_threads, tree_allclose, tree_bitwise_equal


SHAPES = [(), (2,), (3,)]
LANES = 2


class InjectedError(Exception):
    pass


def _call_expecting_injected_error(f, x) -> None:
    try:
        f(x)
    except InjectedError:
        return
    raise AssertionError("the injected exception did not propagate")


def interpret(ops, shapes, get, put, x):
    """The program: `get(i)` reads state i, `put(i, v)` writes it."""
    acc = jnp.sum(x) * 0.1
    for op in ops:
        kind = op[0]
        if kind == "raise":
            raise InjectedError("injected")
        i = op[1]
        if kind == "read":
            acc = acc + jnp.sum(get(i)) * 0.5
        elif kind == "set":
            put(i, jnp.broadcast_to(jnp.tanh(acc) * op[2], shapes[i]))
        else:  # update: a read followed by a write
            put(i, get(i) * 0.9 + jnp.tanh(acc) * op[2])
    return acc


def _stateful_base(ops, shapes, states):
    def f(x):
        return interpret(
            ops,
            shapes,
            lambda i: states[i].value,
            lambda i, v: setattr(states[i], "value", v),
            x,
        )

    return f


def _pure_base(ops, shapes):
    def f(values, x):
        values = list(values)
        out = interpret(ops, shapes, values.__getitem__, values.__setitem__, x)
        return tuple(values), out

    return f


def _wrap_stateful(kind, f, states):
    t = es.transform
    if kind == "jit":
        return t.jit(f)
    if kind == "cond":
        return lambda x: t.cond(jnp.sum(x) > 0, f, lambda x: jnp.sum(x) * 2.0, x)
    if kind == "scan":

        def scanned(x):
            return t.scan(
                lambda c, xi: (c + f(xi), None), jnp.zeros(()), jnp.stack([x, x * 0.5])
            )[0]

        return scanned
    if kind == "grad":

        def with_grad(x):
            value, dx = t.value_and_grad(f)(x)
            return value + jnp.sum(dx)

        return with_grad
    assert kind == "vmap"
    mapped = t.vmap(f, in_states={0: tuple(states)})
    return lambda x: jnp.sum(mapped(jnp.stack([x, x + 1.0])))


def _wrap_pure(kind, f):
    if kind == "jit":
        return jax.jit(f)
    if kind == "cond":
        return lambda v, x: jax.lax.cond(
            jnp.sum(x) > 0, f, lambda v, x: (v, jnp.sum(x) * 2.0), v, x
        )
    if kind == "scan":

        def scanned(v, x):
            def body(carry, xi):
                c, v = carry
                v, out = f(v, xi)
                return (c + out, v), None

            (c, v), _ = jax.lax.scan(body, (jnp.zeros(()), v), jnp.stack([x, x * 0.5]))
            return v, c

        return scanned
    if kind == "grad":

        def with_grad(v, x):
            def loss(x):
                new_v, out = f(v, x)
                return out, new_v

            (value, new_v), dx = jax.value_and_grad(loss, has_aux=True)(x)
            return new_v, value + jnp.sum(dx)

        return with_grad
    assert kind == "vmap"

    def mapped(v, x):
        new_v, outs = jax.vmap(f)(v, jnp.stack([x, x + 1.0]))
        return new_v, jnp.sum(outs)

    return mapped


@st.composite
def programs(draw):
    n = draw(st.integers(1, 4))
    shapes = [draw(st.sampled_from(SHAPES)) for _ in range(n)]
    op = st.one_of(
        st.tuples(st.just("read"), st.integers(0, n - 1)),
        st.tuples(
            st.just("set"), st.integers(0, n - 1), st.sampled_from([0.5, -1.0, 2.0])
        ),
        st.tuples(
            st.just("update"), st.integers(0, n - 1), st.sampled_from([0.5, -1.0, 2.0])
        ),
    )
    ops = draw(st.lists(op, min_size=1, max_size=8))
    if draw(st.booleans()) and draw(st.booleans()):  # an exception in a quarter of them
        ops.insert(draw(st.integers(0, len(ops))), ("raise",))
    chain = draw(st.lists(st.sampled_from(["jit", "cond", "scan", "grad"]), max_size=3))
    if draw(st.booleans()):
        chain.insert(draw(st.integers(0, len(chain))), "vmap")
    seed = draw(st.integers(0, 2**16))
    return shapes, ops, chain, seed


def _build(shapes, ops, chain, states):
    f, pure = _stateful_base(ops, shapes, states), _pure_base(ops, shapes)
    for kind in chain:  # innermost first
        f, pure = _wrap_stateful(kind, f, states), _wrap_pure(kind, pure)
    if not chain:
        # Plain Python has no transaction to roll back: the bare program runs through
        # StatefulFunction, eqstate's smallest entry point.
        f = es.transform.StatefulFunction(f)
    return f, pure


@given(programs())
# Found in CI: a write then an exception with no transform around the program.
@example(([()], [("read", 0), ("set", 0, 0.5), ("raise",)], [], 0))
def test_random_programs_obey_the_laws(program):
    shapes, ops, chain, seed = program
    note(f"shapes={shapes} ops={ops} chain={chain}")
    rng = np.random.default_rng(seed)
    lead = (LANES,) if "vmap" in chain else ()
    initial = [jnp.asarray(rng.normal(size=lead + s), jnp.float32) for s in shapes]
    states = [es.State(v, name=f"s{i}") for i, v in enumerate(initial)]
    x = jnp.asarray(rng.normal(size=(3,)), jnp.float32)
    f, pure = _build(shapes, ops, chain, states)

    if ("raise",) in ops:
        _call_expecting_injected_error(f, x)
        values = [s.value for s in states]
        assert tree_bitwise_equal(values, initial)  # law 2
        assert not any(
            isinstance(v, jax.core.Tracer) for v in jax.tree_util.tree_leaves(values)
        )
        return

    out = f(x)
    ref_values, ref_out = pure(tuple(initial), x)
    assert tree_allclose(out, ref_out, rtol=1e-5, atol=1e-5)  # law 1
    assert tree_allclose(
        [s.value for s in states], list(ref_values), rtol=1e-5, atol=1e-5
    )

    read = {op[1] for op in ops if op[0] in ("read", "update")}
    written = {op[1] for op in ops if op[0] in ("set", "update")}
    sf = es.transform.StatefulFunction(
        _build(shapes, ops, chain, states)[0]
    ).make_jaxpr(x)
    assert set(sf.get_write_states()) == {states[i] for i in written}  # law 3
    assert set(sf.get_read_states()) == {states[i] for i in read - written}


class _ThreadShapes:
    """The state shapes of the thread running the program (each thread of the
    threaded law gives its states shapes of its own)."""

    current: contextvars.ContextVar = contextvars.ContextVar("shapes")

    def __getitem__(self, i):
        return self.current.get()[i]


N_THREADS = 4


@settings(max_examples=max(settings.default.max_examples // 4, 10))
@given(programs())
def test_random_programs_obey_the_laws_in_threads(program):
    """Laws 1 and 2 while one program (one set of transformed functions) runs in
    several threads at once, each in its own scope with states of its own shapes."""
    shapes, ops, chain, seed = program
    note(f"shapes={shapes} ops={ops} chain={chain}")
    lead = (LANES,) if "vmap" in chain else ()
    states = [es.State(jnp.zeros(lead + s), name=f"s{i}") for i, s in enumerate(shapes)]
    f, _ = _build(_ThreadShapes(), ops, chain, states)

    def run(k):
        rng = np.random.default_rng(seed + k)
        # Thread 0 keeps the program's shapes; the others add a leading axis of k.
        mine = [s if k == 0 else (k, *s) for s in shapes]
        initial = [jnp.asarray(rng.normal(size=lead + s), jnp.float32) for s in mine]
        x = jnp.asarray(rng.normal(size=(3,)), jnp.float32)
        _ThreadShapes.current.set(mine)
        with es.scope(es.StateDict(dict(zip(states, initial)))):
            if ("raise",) in ops:
                _call_expecting_injected_error(f, x)
                assert tree_bitwise_equal([s.value for s in states], initial)
                return
            out = f(x)
            values = [s.value for s in states]
        _, pure = _build(mine, ops, chain, states)
        ref_values, ref_out = pure(tuple(initial), x)
        assert tree_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
        assert tree_allclose(values, list(ref_values), rtol=1e-5, atol=1e-5)

    failures = run_in_threads(*(functools.partial(run, k) for k in range(N_THREADS)))
    if failures:
        raise failures[0]
