import eqstate as es
import jax
import jax.numpy as jnp
import pytest

from .helpers import tree_allclose


pytestmark = pytest.mark.usefixtures("tracing_mode")


@pytest.mark.parametrize("pred", [True, False])
def test_cond_matches_lax(pred):
    a = es.State(jnp.array(1.0), name="a")
    b = es.State(jnp.array(10.0), name="b")

    def true_fun(x):
        a.value = a.value + x
        return x * 2

    def false_fun(x):
        b.value = b.value - x
        return x * 3

    out = es.transform.cond(pred, true_fun, false_fun, 2.0)
    ref = jax.lax.cond(pred, lambda x: x * 2, lambda x: x * 3, 2.0)
    assert out == ref
    assert (a.value, b.value) == ((3.0, 10.0) if pred else (1.0, 8.0))


def test_cond_under_jit_with_a_traced_predicate():
    hits = es.State(jnp.array(0))

    def hit(x):
        hits.value = hits.value + 1
        return x

    f = es.transform.jit(lambda x: es.transform.cond(x > 0, hit, lambda x: -x, x))
    assert f(1.0) == 1.0 and f(-2.0) == 2.0 and f(3.0) == 3.0
    assert hits.value == 2


def test_switch_threads_the_union_of_states():
    states = [es.State(jnp.array(0), name=f"s{i}") for i in range(3)]
    reader = es.State(jnp.array(5), name="reader")

    def make(i):
        def branch(x):
            states[i].value = states[i].value + x + reader.value
            return x * i

        return branch

    sf = es.transform.StatefulFunction(
        lambda i, x: es.transform.switch(i, [make(0), make(1), make(2)], x)
    )
    sf.make_jaxpr(1, 1)
    assert set(sf.get_write_states()) == set(states)
    assert sf.get_read_states() == (reader,)
    assert sf(1, 2) == 2 and [int(s.value) for s in states] == [0, 7, 0]
    assert sf(7, 2) == 4 and [int(s.value) for s in states] == [0, 7, 7]


def test_ifelse_runs_the_first_true_branch():
    def sign(x):
        return es.transform.ifelse(
            [x > 0, x < 0, True], [lambda: 1, lambda: -1, lambda: 0], check_cond=False
        )

    assert [int(sign(v)) for v in (2.0, -3.0, 0.0)] == [1, -1, 0]


@pytest.mark.upstream_leak("eqx.error_if keeps its caller's frames alive")
def test_ifelse_checks_that_exactly_one_condition_holds():
    f = es.transform.jit(
        lambda x: es.transform.ifelse([x > 0, x > 1], [lambda: 1, lambda: 2])
    )
    assert f(0.5) == 1
    # JAX reports this runtime error as `JaxRuntimeError` or `ValueError`, by path.
    runtime_error = (jax.errors.JaxRuntimeError, ValueError)
    with pytest.raises(runtime_error, match="exactly one condition"):
        f(2.0)


def test_ifelse_needs_one_condition_per_branch():
    with pytest.raises(ValueError, match="one condition per branch"):
        es.transform.ifelse([True], [lambda: 1, lambda: 2])


def test_branches_must_not_create_states():
    with pytest.raises(ValueError, match="branch 1 of a conditional creates states"):
        es.transform.cond(True, lambda: es.State(0.0).name, lambda: None)


def test_branches_with_different_outputs_fail_and_keep_values():
    s = es.State(jnp.array(0))

    def a():
        s.value = s.value + 1
        return jnp.zeros(2)

    with pytest.raises(TypeError):
        es.transform.cond(True, a, lambda: jnp.zeros(3))
    assert s.value == 0


def test_cond_matches_lax_under_grad():
    w = es.ParamState(jnp.array(2.0))

    def f(x):
        return es.transform.cond(
            x > 0, lambda x: w.value * x**2, lambda x: -w.value * x, x
        )

    g = es.transform.grad(f, grad_states=[w], argnums=0)
    (gw, gx) = g(3.0)
    assert tree_allclose((gw[w], gx), (9.0, 12.0))
    (gw, gx) = g(-3.0)
    assert tree_allclose((gw[w], gx), (3.0, -2.0))
