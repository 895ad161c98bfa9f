import io

import eqstate as es
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from .helpers import tree_allclose, unchecked


def _rnn(getkey, width=4):
    w = es.ParamState(jr.normal(getkey(), (width, width)) / np.sqrt(width), name="w")
    h = es.ShortTermState(jnp.zeros(width), name="h")

    def step(total, x):
        h.value = jnp.tanh(w.value @ h.value + x)
        return total + jnp.sum(h.value**2), h.value

    return w, h, step


def _pure_step(w):
    def step(carry, x):
        total, h = carry
        h = jnp.tanh(w @ h + x)
        return (total + jnp.sum(h**2), h), h

    return step


@pytest.mark.parametrize("n", (0, 1, 2, 7, 16, 17, 100, 101))
@pytest.mark.parametrize("base", (None, 2, 3, 16))
def test_checkpointed_scan_matches_lax_scan(getkey, n, base):
    w, h, step = _rnn(getkey)
    xs = jr.normal(getkey(), (n, 4))
    w0, h0 = w.value, h.value
    total, hs = es.transform.checkpointed_scan(step, jnp.zeros(()), xs, base=base)
    (total2, h2), hs2 = jax.lax.scan(_pure_step(w0), (jnp.zeros(()), h0), xs)
    assert tree_allclose((total, hs, h.value), (total2, hs2, h2), rtol=1e-5)
    assert (w.value == w0).all()


@pytest.mark.parametrize("base", (None, 3))
def test_checkpointed_scan_gradients_equal_scans(getkey, base):
    w, h, step = _rnn(getkey)
    xs = jr.normal(getkey(), (50, 4))

    def loss(xs, loop):
        total, hs = loop(step, jnp.zeros(()), xs)
        return total + jnp.sum(hs)

    def grads(loop):
        h0 = h.value
        out = es.transform.grad(
            lambda xs: loss(xs, loop), grad_states=[w, h], argnums=0
        )(xs)
        h1, h.value = h.value, h0
        return out, h1

    checkpointed = grads(lambda *a: es.transform.checkpointed_scan(*a, base=base))
    plain = grads(es.transform.scan)
    assert tree_allclose(checkpointed, plain, rtol=1e-5, atol=1e-6)


def test_checkpointed_scan_of_length_without_xs():
    count = es.State(jnp.array(0), name="count")

    def step(c, _):
        count.value = count.value + c
        return c + 1, c * 2

    c, ys = es.transform.checkpointed_scan(step, 0, length=10, base=3)
    assert c == 10 and count.value == 45 and (ys == 2 * jnp.arange(10)).all()


def test_checkpointed_for_loop_matches_for_loop(getkey):
    v = es.ShortTermState(jnp.array(0.0), name="v")
    xs, ys = jr.normal(getkey(), (23,)), jr.normal(getkey(), (23,))

    def step(x, y):
        v.value = 0.9 * v.value + x * y
        return v.value

    got = es.transform.checkpointed_for_loop(step, xs, ys, base=4)
    got_v, v.value = v.value, jnp.array(0.0)
    expected = es.transform.for_loop(step, xs, ys)
    assert tree_allclose((got, got_v), (expected, v.value), rtol=1e-5)


@pytest.mark.parametrize(
    "loop",
    [
        lambda f, xs: es.transform.checkpointed_for_loop(f, xs, base=2),
        lambda f, xs: es.transform.checkpointed_scan(
            lambda c, x: (c, f(x)), None, xs, base=2
        )[1],
        lambda f, xs: es.transform.map(f, xs, batch_size=2),
    ],
    ids=["checkpointed_for_loop", "checkpointed_scan", "batched map"],
)
def test_chunked_loops_stack_outputs_with_a_zero_size_axis_as_for_loop(loop):
    def f(x):
        return x * 2, jnp.zeros((0, 3))

    xs = jnp.arange(7.0)
    expected = es.transform.for_loop(f, xs)
    got = loop(f, xs)
    assert got[1].shape == expected[1].shape == (7, 0, 3)
    assert (got[0] == expected[0]).all()


@pytest.mark.cpu_or_gpu("XLA on a TPU reports no temporary memory for scan")
def test_checkpointed_scan_gradient_uses_a_tenth_of_scans_memory():
    # The target of the feature: 10,000 steps of a 256-wide RNN.
    width, n = 256, 10_000
    w = es.ParamState(jnp.eye(width) * 0.5, name="w")
    h = es.ShortTermState(jnp.zeros(width), name="h")
    xs = jnp.ones((n, width))

    def step(total, x):
        h.value = jnp.tanh(w.value @ h.value + x)
        return total + jnp.mean(h.value**2), None

    def measure(loop):
        def loss(xs):
            return loop(step, jnp.zeros(()), xs)[0]

        grad = es.transform.jit(es.transform.grad(loss, grad_states=[w]))
        memory = grad.lower(xs).compile().memory_analysis()
        h0 = h.value
        value = grad(xs)[w]
        h.value = h0
        return memory.temp_size_in_bytes, value

    plain, expected = measure(es.transform.scan)
    assert plain > n * width * 4  # at least one stored value per step
    # Every level of nesting reads its rows of `xs` by index: with `base=4` (seven
    # levels here), keeping a copy of them per level took 15% of scan's memory.
    base_4 = lambda *a: es.transform.checkpointed_scan(*a, base=4)  # noqa: E731
    base_16 = lambda *a: es.transform.checkpointed_scan(*a, base=16)  # noqa: E731
    for loop in (es.transform.checkpointed_scan, base_4, base_16):
        temp, got = measure(loop)
        assert temp <= plain / 10
        # Float32 sums of 10,000 terms in another order: `scan` accumulates the
        # gradient step by step, the segments pairwise (1e-4 here; in float64 the
        # two agree to 1e-13).
        error = jnp.max(jnp.abs(got - expected)) / jnp.max(jnp.abs(expected))
        assert error <= 1e-3


def test_checkpointed_scan_supports_forward_mode(getkey):
    w, h, step = _rnn(getkey)
    xs = jr.normal(getkey(), (20, 4))

    def f(xs):
        return es.transform.checkpointed_scan(step, jnp.zeros(()), xs, base=3)[0]

    def g(xs):
        return es.transform.scan(step, jnp.zeros(()), xs)[0]

    h0 = h.value
    tangent = jnp.ones_like(xs)
    got = es.transform.jvp(f, (xs,), (tangent,))
    h.value = h0
    expected = es.transform.jvp(g, (xs,), (tangent,))
    assert tree_allclose(got, expected, rtol=1e-5)


def test_checkpointed_scan_under_vmap_matches_lax(getkey):
    w = es.ParamState(jr.normal(getkey(), (4, 4)) / 2, name="w")
    batch = jr.normal(getkey(), (3, 20, 4))

    def step(h, x):
        return jnp.tanh(w.value @ h + x), h

    def run(xs):
        return es.transform.checkpointed_scan(step, jnp.zeros(4), xs, base=4)

    w0 = w.value

    def pure(xs):
        return jax.lax.scan(lambda h, x: (jnp.tanh(w0 @ h + x), h), jnp.zeros(4), xs)

    got = es.transform.vmap(run)(batch)
    assert tree_allclose(got, jax.vmap(pure)(batch), rtol=1e-5)


@pytest.mark.upstream_leak(
    "an ordered `jax.debug.callback` in a `jax.lax.scan` under `jax.grad`"
)
def test_checkpointed_scan_progress_bar_reports_once_per_segment_under_grad():
    w = es.ParamState(jnp.array(0.5))
    out = io.StringIO()
    bar = es.transform.ProgressBar(freq=25, desc="bptt", file=out)

    def loss(xs):
        step = lambda c, x: (jnp.sin(w.value * c + x), None)  # noqa: E731
        return es.transform.checkpointed_scan(step, 0.0, xs, pbar=bar)[0]

    es.transform.jit(es.transform.grad(loss, grad_states=[w]))(jnp.ones(100))
    jax.effects_barrier()
    text = out.getvalue()
    # 10 segments of 10 steps: a report wherever a multiple of 25 was passed, once.
    reports = [line.split(" [")[0] for line in text.replace("\r", "\n").split("\n")]
    assert [r for r in reports if r] == [
        "bptt: 30/100",
        "bptt: 50/100",
        "bptt: 80/100",
        "bptt: 100/100",
    ]


def test_checkpointed_scan_body_may_not_create_states():
    def step(c, x):
        es.State(x, name="new")
        return c, x

    with pytest.raises(ValueError, match=r"body of `checkpointed_scan` creates"):
        es.transform.checkpointed_scan(step, 0, jnp.arange(3.0))


def test_checkpointed_scan_that_fails_writes_nothing():
    s = es.State(jnp.array(0), name="s")

    def step(c, x):
        s.value = s.value + 1
        return c, jnp.zeros(2) @ jnp.zeros(3)

    with pytest.raises(TypeError):
        es.transform.checkpointed_scan(step, 0, jnp.arange(30))
    assert s.value == 0


def test_checkpointed_scan_runs_eagerly_under_disable_jit(capsys):
    total = es.State(jnp.array(0.0), name="total")

    def step(carry, x):
        print("x =", float(x))  # needs a concrete value
        total.value = total.value + x
        return carry + x, total.value

    with jax.disable_jit():
        final, ys = es.transform.checkpointed_scan(step, 0.0, jnp.arange(3.0), base=2)
    assert capsys.readouterr().out == "x = 0.0\nx = 1.0\nx = 2.0\n"
    assert final == 3.0 and total.value == 3.0 and (ys == jnp.array([0, 1, 3.0])).all()


def test_an_eager_checkpointed_loop_that_fails_writes_nothing():
    total = es.State(jnp.array(0.0), name="total")

    def step(x):
        total.value = total.value + 1
        if float(x) == 2.0:
            raise RuntimeError("third step")
        return x

    with jax.disable_jit(), pytest.raises(RuntimeError, match="third step"):
        es.transform.checkpointed_for_loop(step, jnp.arange(4.0))
    assert total.value == 0.0


@pytest.mark.parametrize(
    "base, error, match",
    ((1, ValueError, "`base` must be at least 2"), (2.5, TypeError, "integer")),
)
def test_checkpointed_scan_refuses_a_bad_base(base, error, match):
    with pytest.raises(error, match=match):
        unchecked(es.transform.checkpointed_scan)(
            lambda c, x: (c, x), 0, jnp.ones(3), base=base
        )


def test_checkpointed_loops_check_their_inputs_like_scan():
    with pytest.raises(ValueError, match="`checkpointed_scan` needs `length`"):
        es.transform.checkpointed_scan(lambda c, x: (c, x), 0)
    with pytest.raises(ValueError, match="`checkpointed_for_loop` needs operands"):
        es.transform.checkpointed_for_loop(lambda: 1)
    with pytest.raises(TypeError, match="`pbar` must be an"):
        unchecked(es.transform.checkpointed_for_loop)(lambda x: x, jnp.ones(3), pbar=10)
