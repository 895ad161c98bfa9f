import io

import eqstate as es
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest

from .helpers import tree_allclose


pytestmark = pytest.mark.usefixtures("tracing_mode")


def test_scan_matches_lax(getkey):
    xs = jr.normal(getkey(), (5, 3))
    count = es.ShortTermState(jnp.array(0))

    def step(carry, x):
        count.value = count.value + 1
        return carry + x, carry

    def pure_step(carry_and_count, x):
        carry, n = carry_and_count
        return (carry + x, n + 1), carry

    final, ys = es.transform.scan(step, jnp.zeros(3), xs)
    (final2, n2), ys2 = jax.lax.scan(pure_step, (jnp.zeros(3), 0), xs)
    assert tree_allclose((final, ys), (final2, ys2))
    assert count.value == n2


def test_scan_reads_states_as_constants_and_reports_them(getkey):
    w = es.ParamState(jr.normal(getkey(), (3, 3)))
    h = es.ShortTermState(jnp.zeros(3))
    xs = jr.normal(getkey(), (4, 3))

    def step(_, x):
        h.value = jnp.tanh(w.value @ h.value + x)
        return None, h.value

    sf = es.transform.StatefulFunction(lambda xs: es.transform.scan(step, None, xs)[1])
    sf.make_jaxpr(xs)
    assert sf.get_read_states() == (w,) and sf.get_write_states() == (h,)
    hs = sf(xs)
    ref, wv = jnp.zeros(3), w.value
    for i in range(4):
        ref = jnp.tanh(wv @ ref + xs[i])
        assert tree_allclose(hs[i], ref, atol=1e-5)


def test_scan_reverse_length_and_no_xs():
    total = es.State(jnp.array(0))

    def step(c, _):
        total.value = total.value + c
        return c + 1, c

    c, ys = es.transform.scan(step, 0, None, length=4)
    assert c == 4 and total.value == 6 and (ys == jnp.arange(4)).all()
    _, ys = es.transform.scan(lambda c, x: (c, x * 2), 0, jnp.arange(3), reverse=True)
    assert (ys == jnp.arange(3) * 2).all()


def test_scan_with_weakly_typed_states_keeps_the_carry_type():
    n = es.State(0)  # a weakly typed int32
    f = es.State(0.0)

    def step(c, x):
        n.value = n.value + 1
        f.value = f.value + x
        return c, None

    es.transform.scan(step, None, jnp.arange(3.0))
    assert n.value == 3 and f.value == 3.0


def test_for_loop_stacks_outputs_and_writes_states():
    h = es.ShortTermState(jnp.array(0.0))

    def step(x, y):
        h.value = 0.5 * h.value + x * y
        return h.value

    hs = es.transform.for_loop(step, jnp.ones(3), jnp.full(3, 2.0))
    assert tree_allclose(hs, jnp.array([2.0, 3.0, 3.5])) and h.value == 3.5


def test_progress_bar_prints_from_inside_the_compiled_loop():
    out = io.StringIO()
    bar = es.transform.ProgressBar(freq=2, desc="loop", file=out)
    es.transform.jit(lambda xs: es.transform.for_loop(lambda x: x, xs, pbar=bar))(
        jnp.arange(6.0)
    )
    jax.effects_barrier()
    text = out.getvalue()
    assert "loop: 2/6" in text and "loop: 6/6" in text and "loop: 1/6" not in text


def test_progress_bar_refuses_a_bad_frequency():
    with pytest.raises(ValueError, match="positive"):
        es.transform.ProgressBar(freq=0)


def test_while_loop_matches_lax():
    steps = es.State(jnp.array(0))
    limit = es.State(jnp.array(100.0))

    def body(x):
        steps.value = steps.value + 1
        return x * 2

    out = es.transform.while_loop(lambda x: x < limit.value, body, 1.0)
    ref = jax.lax.while_loop(lambda x: x < 100.0, lambda x: x * 2, 1.0)
    assert out == ref and steps.value == 7 and limit.value == 100.0


def test_while_loop_condition_may_not_write():
    s = es.State(jnp.array(0), name="s")

    def cond(x):
        s.value = s.value + 1
        return x < 3

    with pytest.raises(ValueError, match="`cond_fun` of `while_loop` writes State 's'"):
        es.transform.while_loop(cond, lambda x: x + 1, 0)
    assert s.value == 0


def test_bounded_while_loop_is_reverse_differentiable():
    w = es.ParamState(jnp.array(1.5))

    def f(x):
        return es.transform.bounded_while_loop(
            lambda v: v < 10.0, lambda v: v * w.value, x, 16
        )

    grads = es.transform.grad(f, grad_states=[w], argnums=0)(1.0)
    # 1.5**6 = 11.39 > 10: six steps, so f = x * w**6.
    (gw, gx) = grads
    assert f(1.0) == pytest.approx(1.5**6)
    assert gw[w] == pytest.approx(6 * 1.5**5) and gx == pytest.approx(1.5**6)


def test_bounded_while_loop_stops_at_max_steps():
    calls = es.State(jnp.array(0))

    def body(v):
        calls.value = calls.value + 1
        return v + 1

    assert es.transform.bounded_while_loop(lambda v: v < 100, body, 0, 5) == 5
    assert calls.value == 5


def test_states_cannot_be_created_in_a_loop_body():
    def step(c, x):
        es.State(jnp.zeros(()), name="new")
        return c, x

    with pytest.raises(
        ValueError, match=r"body of `scan` creates states \(State 'new'\)"
    ):
        es.transform.scan(step, 0, jnp.arange(3))


def test_body_must_return_a_pair():
    with pytest.raises(TypeError, match="must return a pair"):
        es.transform.scan(lambda c, x: c, 0, jnp.arange(3))


def test_failure_in_a_loop_keeps_values():
    s = es.State(jnp.array(0))

    def step(c, x):
        s.value = s.value + 1
        return c, jnp.zeros(2) @ jnp.zeros(3)

    with pytest.raises(TypeError):
        es.transform.scan(step, 0, jnp.arange(3))
    assert s.value == 0
