import eqstate as es
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest

from .helpers import tree_allclose


def _ones_vjp(f, *primals):
    out, vjp_fn = jax.vjp(f, *primals)
    return vjp_fn(jax.tree.map(jnp.ones_like, out))


def test_vector_grad_is_the_vjp_with_ones(getkey):
    x, y = jr.normal(getkey(), (4,)), jr.normal(getkey(), (4,))

    def f(x, y):
        return jnp.sin(x) * y**2

    got = es.transform.vector_grad(f, argnums=(0, 1))(x, y)
    assert tree_allclose(got, _ones_vjp(f, x, y))
    assert tree_allclose(
        es.transform.vector_grad(f)(x, y), jax.grad(lambda x: f(x, y).sum())(x)
    )


def test_vector_grad_with_respect_to_states_and_arguments(getkey):
    w = es.ParamState(jr.normal(getkey(), (3, 4)), name="w")
    b = es.ParamState(jr.normal(getkey(), (3,)), name="b")
    x = jr.normal(getkey(), (4,))

    def f(x):
        return jnp.tanh(w.value @ x + b.value)

    state_grads, x_grad = es.transform.vector_grad(
        f, grad_states=es.ParamState, argnums=0
    )(x)
    ws, bs, xs = _ones_vjp(lambda w, b, x: jnp.tanh(w @ x + b), w.value, b.value, x)
    assert state_grads.states == (w, b)
    assert tree_allclose((state_grads[w], state_grads[b], x_grad), (ws, bs, xs))


def test_vector_grad_returns_value_and_aux_like_grad(getkey):
    w = es.ParamState(jr.normal(getkey(), (3,)), name="w")
    calls = es.State(jnp.array(0), name="calls")

    @es.transform.vector_grad(grad_states=[w], has_aux=True, return_value=True)
    def f(x):
        calls.value = calls.value + 1
        return {"a": w.value * x, "b": w.value**2}, "aux"

    grads, value, aux = f(2.0)
    assert tree_allclose(grads[w], 2.0 + 2 * w.value)
    assert tree_allclose(value, {"a": w.value * 2.0, "b": w.value**2})
    assert aux == "aux" and calls.value == 1


def test_vector_grad_of_a_scalar_function_is_grad(getkey):
    x = jr.normal(getkey(), (5,))
    f = lambda x: jnp.sum(jnp.cos(x) * x)  # noqa: E731
    assert tree_allclose(es.transform.vector_grad(f)(x), jax.grad(f)(x))


def test_vector_grad_ignores_integer_outputs(getkey):
    x = jr.normal(getkey(), (3,))
    got = es.transform.vector_grad(lambda x: (x**2, jnp.argmax(x)))(x)
    assert tree_allclose(got, 2 * x)


def test_vector_grad_under_jit_and_vmap_matches_jax(getkey):
    w = es.ParamState(jr.normal(getkey(), (3,)), name="w")
    xs = jr.normal(getkey(), (5, 3))
    f = es.transform.vector_grad(lambda x: jnp.exp(w.value * x))
    got = es.transform.jit(es.transform.vmap(f))(xs)
    w0 = w.value
    expected = jax.vmap(lambda x: _ones_vjp(lambda x: jnp.exp(w0 * x), x)[0])(xs)
    assert tree_allclose(got, expected, rtol=1e-5)


def test_vector_grad_refuses_an_unused_grad_state():
    w, unused = es.ParamState(jnp.ones(2)), es.ParamState(jnp.ones(2), name="unused")
    with pytest.raises(ValueError, match=r"ParamState 'unused'.* does not use"):
        es.transform.vector_grad(lambda: w.value * 2, grad_states=[w, unused])()
