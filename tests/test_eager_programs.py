"""Loops and conditionals called at top level run the function's Python on every
call, as JAX's own eager calls do: they see the current globals, NumPy values,
callbacks and differentiation rules, and raise `eqx.error_if`'s errors as their own."""

import threading

import eqstate as es
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from .helpers import tree_allclose


def _loops(h: es.State) -> dict:
    """Each loop or conditional, as a call of a step that adds `x` to `h`."""

    def step(x):
        h.value = jax.nn.relu(h.value * 0.5 + x)  # a `jax.custom_jvp` function
        return h.value.sum()

    xs = jnp.ones((6, 3))
    return {
        "scan": lambda: es.transform.scan(lambda c, x: (c + step(x), c), 0.0, xs),
        "for_loop": lambda: es.transform.for_loop(step, xs),
        "map": lambda: es.transform.map(step, xs),
        "map in chunks": lambda: es.transform.map(lambda x: 2 * x, xs, batch_size=4),
        "checkpointed_scan": lambda: es.transform.checkpointed_scan(
            lambda c, x: (c + step(x), c), 0.0, xs, base=2
        ),
        "while_loop": lambda: es.transform.while_loop(
            lambda v: v < 5, lambda v: (step(jnp.ones(3)), v + 1)[1], 0
        ),
        "bounded_while_loop": lambda: es.transform.bounded_while_loop(
            lambda v: v < 5, lambda v: (step(jnp.ones(3)), v + 1)[1], 0, 8
        ),
        "cond": lambda: es.transform.cond(True, step, lambda x: x.sum(), jnp.ones(3)),
        "switch": lambda: es.transform.switch(1, [jnp.sum, step], jnp.ones(3)),
    }


@pytest.mark.parametrize("loop", list(_loops(es.ShortTermState(jnp.zeros(3)))))
def test_a_loop_called_again_at_top_level_starts_from_the_states_new_value(loop):
    h = es.ShortTermState(jnp.zeros(3))
    call = _loops(h)[loop]
    call()
    first = h.value
    h.value = jnp.full(3, 4.0)
    call()
    # The second call started from 4, not 0.
    if loop != "map in chunks":
        assert not tree_allclose(h.value, first)


def test_a_rebound_global_is_seen():
    h = es.ShortTermState(jnp.zeros(3))
    scale = {"python": 2.0, "array": jnp.full(3, 2.0), "fn": jnp.sin}

    def step(c, x):
        h.value = h.value + scale["python"] * x
        return c, scale["fn"](x * scale["array"])

    xs = jnp.ones((2, 3))
    _, ys = es.transform.scan(step, 0.0, xs)
    assert tree_allclose(ys, jnp.sin(2.0 * xs)) and tree_allclose(h.value, 4 * xs[0])
    scale.update(python=3.0, array=jnp.full(3, -1.0), fn=jnp.cos)
    _, ys = es.transform.scan(step, 0.0, xs)
    assert tree_allclose(ys, jnp.cos(-xs))
    assert tree_allclose(h.value, 10 * xs[0])


@pytest.mark.parametrize(
    "make",
    [
        # Literals equal as Python numbers, told apart by sign or type.
        lambda c: lambda x: 1.0 / (x * 0.0 * c),
        # Types: an int8 wraps around where an int16 does not.
        lambda c: lambda x: x.astype(jnp.int8 if c > 0 else jnp.int16) * 200,
        # Parameters: only the shift tells these apart.
        lambda c: lambda x: jnp.roll(x * jnp.arange(3.0), 1 if c > 0 else 2),
        lambda c: lambda x: jnp.where(x > c, x, -x),
    ],
)
def test_programs_that_differ_in_a_constant_or_a_type_are_told_apart(make):
    h = es.ShortTermState(jnp.zeros(3))
    xs = jnp.ones((2, 3))
    results = []
    for c in (1.0, -1.0):
        fn = make(c)

        def step(x, fn=fn):
            h.value = h.value + 1.0
            return fn(x)

        expected = jax.vmap(fn)(xs)
        got = es.transform.for_loop(step, xs)
        assert got.dtype == expected.dtype and np.array_equal(got, expected)
        results.append(got)
    assert not np.array_equal(*results)


def test_random_bits_follow_the_threefry_setting_of_each_call():
    """`jax.threefry_partitionable` is not a parameter of the random primitives but
    the context of their equations: it must tell programs apart."""

    def body(c, x):
        return c, jax.random.uniform(jax.random.fold_in(jax.random.key(0), x), (3,))

    xs = jnp.arange(2)
    draws = []
    for partitionable in (True, False, True):
        with jax.threefry_partitionable(partitionable):
            _, ys = es.transform.scan(body, 0.0, xs)
            _, expected = jax.lax.scan(lambda c, x: body(c, x), 0.0, xs)
        assert np.array_equal(ys, expected), partitionable
        draws.append(ys)
    assert not np.array_equal(draws[0], draws[1])


def test_a_numpy_array_changed_in_place_reaches_a_nested_jit():
    """A nested `jax.jit` of a new function bakes the NumPy array it closes over into
    its jaxpr, as it is now: a changed array makes another program."""
    w = np.full(3, 2.0, dtype=np.float32)
    xs = jnp.ones((2, 3))
    for value in (2.0, 3.0):
        w[:] = value
        _, ys = es.transform.scan(
            lambda c, x: (c, jax.jit(lambda y: y * w)(x)), 0.0, xs
        )
        _, expected = jax.lax.scan(
            lambda c, x: (c, jax.jit(lambda y: y * w)(x)), 0.0, xs
        )
        assert np.array_equal(expected, value * xs)  # what JAX does
        assert np.array_equal(ys, expected), value


# Programs reading a NumPy array `a`: as a literal (a 0-d array) or as a constant of a
# nested jaxpr (an array closed over by a nested `jax.jit`).
_READS_NUMPY = {
    "scan": lambda a, x: es.transform.scan(
        lambda c, _: (c * a, None), x, None, length=1
    )[0],
    "cond": lambda a, x: es.transform.cond(True, lambda y: y * a, lambda y: y, x),
    "while_loop": lambda a, x: es.transform.while_loop(
        lambda c: c[0] < 1, lambda c: (c[0] + 1, c[1] * a), (0, x)
    )[1],
    "nested jit": lambda a, x: es.transform.scan(
        lambda c, _: (jax.jit(lambda y: y * a)(c), None), x, None, length=1
    )[0],
}


@pytest.mark.parametrize("again", ["committed input", "caches cleared"])
@pytest.mark.parametrize(
    "name, shape", [(name, ()) for name in _READS_NUMPY] + [("nested jit", (3,))]
)
def test_a_numpy_array_changed_in_place_leaves_its_program_as_it_was(
    name, shape, again
):
    """A program kept for a NumPy array's values computes with those values, also
    when the array it was made from has changed since and `jax.jit` traces or lowers
    the program again."""
    run = _READS_NUMPY[name]
    first = np.full(shape, 2.0, np.float32)
    assert np.array_equal(run(first, jnp.ones(3)), jnp.full(3, 2.0))
    first[...] = 100.0
    x = jnp.ones(3)
    if again == "committed input":
        x = jax.device_put(x, jax.devices()[0])
    else:
        jax.clear_caches()
    again_two = np.full(shape, 2.0, np.float32)  # the first array's old values
    assert np.array_equal(run(again_two, x), jnp.full(3, 2.0))


def test_a_deleted_array_in_a_nested_jit_is_refused_as_jax_refuses_it():
    c = jnp.arange(3.0)
    inner = jax.jit(lambda x: x + c)
    h = es.ShortTermState(jnp.zeros(3))

    def step(x):
        h.value = inner(x)
        return h.value

    es.transform.for_loop(step, jnp.ones((2, 3)))
    c.delete()
    with pytest.raises(RuntimeError, match="deleted"):
        jax.lax.map(inner, jnp.ones((2, 3)))  # what JAX does
    with pytest.raises(RuntimeError, match="deleted"):
        es.transform.for_loop(step, jnp.ones((2, 3)))
    assert np.array_equal(h.value, jnp.array([1.0, 2.0, 3.0]))


def test_a_callback_in_the_body_is_the_current_one():
    xs = jnp.arange(3.0)
    s = es.ShortTermState(jnp.array(0.0))
    for fn, expected in ((np.negative, -xs), (np.square, xs**2)):

        def step(x, fn=fn):
            s.value = s.value + 1.0
            shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
            return jax.pure_callback(fn, shape, x)

        assert np.array_equal(es.transform.for_loop(step, xs), expected)
    seen = []

    def printed(x):
        jax.debug.callback(seen.append, x)
        return x

    es.transform.for_loop(printed, xs)
    es.transform.for_loop(printed, 2 * xs)
    assert [float(x) for x in seen] == [0, 1, 2, 0, 2, 4]


@pytest.mark.cpu_or_gpu("a TPU program cannot raise while it runs")
@pytest.mark.upstream_leak("`eqx.error_if` inside `jax.lax.scan` leaks a tracer")
def test_an_error_check_raises_its_own_message():
    def run(start, message):
        check = lambda c, _: (eqx.error_if(c, c > 0, message), None)  # noqa: E731
        return es.transform.scan(check, start, None, length=1)[0]

    assert run(-1.0, "first message") == -1.0
    for message in ("first message", "second message"):  # a new one: a new program
        with pytest.raises(eqx.EquinoxRuntimeError, match=message):
            run(1.0, message)


def _twice_rule(rule_factor: float):
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    f.defjvp(lambda p, t: (f(p[0]), rule_factor * t[0]))
    return f


def test_differentiation_uses_each_function_own_rule():
    """Two `custom_jvp` functions with one primal: their derivatives stay their
    own."""
    xs = jnp.arange(3.0)
    s = es.ShortTermState(jnp.array(0.0))
    for factor in (2.0, 5.0):
        f = _twice_rule(factor)

        def step(x, f=f):
            s.value = s.value + 1.0
            return f(x)

        assert np.array_equal(es.transform.for_loop(step, xs), jnp.sin(xs))
        grads = es.transform.grad(
            lambda xs, step=step: es.transform.for_loop(step, xs).sum()
        )(xs)
        assert np.array_equal(grads, jnp.full(3, factor))


_OPS = {
    "add": lambda v, c: v + c,
    "mul": lambda v, c: v * c,
    "max": lambda v, c: jnp.maximum(v, c),
    "where": lambda v, c: jnp.where(v > c, v, c - v),
    "div": lambda v, c: v / c,
}
_CONSTANTS = st.sampled_from([0.0, -0.0, 1.0, -1.5, 2.0, 3.0])


@settings(max_examples=40, deadline=None)
@given(
    program=st.lists(
        st.tuples(st.sampled_from(sorted(_OPS)), _CONSTANTS, st.booleans()),
        min_size=1,
        max_size=3,
    )
)
def test_every_program_computes_what_it_says(program):
    """Random programs of few shapes, so that most share a structure with one run
    before: a program reused for another would give another answer."""
    h = es.ShortTermState(jnp.arange(3.0))

    def apply(v, x):
        for op, c, as_array in program:
            v = _OPS[op](v, jnp.full(3, c) if as_array else c) + x
        return v

    def step(x):
        h.value = apply(h.value, x)
        return h.value

    xs = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
    expected, v = [], jnp.arange(3.0)
    for x in xs:
        v = apply(v, x)
        expected.append(v)
    got = es.transform.for_loop(step, xs)
    np.testing.assert_allclose(
        got, jnp.stack(expected), rtol=1e-5, atol=1e-5, err_msg=str(program)
    )
    np.testing.assert_allclose(h.value, v, rtol=1e-5, atol=1e-5)


def test_threads_each_get_their_own_answers():
    errors = []

    def worker(k: float):
        h = es.ShortTermState(jnp.zeros(3))
        try:
            for _ in range(10):
                h.value = jnp.zeros(3)
                es.transform.for_loop(
                    lambda x: h.__setattr__("value", h.value + k * x), jnp.ones((2, 3))
                )
                if not np.array_equal(h.value, jnp.full(3, 2 * k)):
                    errors.append((k, h.value))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in (1.0, 2.0, 3.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
