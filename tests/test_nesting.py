"""Transforms nested in each other, against the same nesting of JAX transforms."""

import eqstate as es
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest

from .helpers import tree_allclose


pytestmark = pytest.mark.usefixtures("tracing_mode")


def test_jit_of_grad_of_scan_of_vmap(getkey):
    w = es.ParamState(jr.normal(getkey(), (4, 3)) * 0.5, name="w")  # 4 members
    h = es.ShortTermState(jnp.zeros((4, 3)), name="h")
    steps = es.ShortTermState(jnp.array(0), name="steps")
    xs = jr.normal(getkey(), (5, 3))

    def member(x):
        h.value = jnp.tanh(w.value * h.value + x)
        return jnp.sum(h.value)

    def loss(xs):
        def body(total, x):
            steps.value = steps.value + 1
            outs = es.transform.vmap(
                member, in_states={0: (w, h)}, in_axes=None, axis_size=4
            )(x)
            return total + jnp.sum(outs**2), None

        return es.transform.scan(body, 0.0, xs)[0]

    step = es.transform.jit(es.transform.value_and_grad(loss, grad_states=[w]))

    def pure_loss(w, h, xs):
        def body(carry, x):
            total, h = carry
            h = jnp.tanh(w * h + x[None])
            return (total + jnp.sum(jnp.sum(h, axis=1) ** 2), h), None

        (total, h), _ = jax.lax.scan(body, (0.0, h), xs)
        return total, h

    w0, h0 = w.value, h.value
    (value, grads) = step(xs)
    (ref_value, ref_h), ref_grad = jax.jit(jax.value_and_grad(pure_loss, has_aux=True))(
        w0, h0, xs
    )
    assert tree_allclose(value, ref_value, rtol=1e-5, atol=1e-5)
    assert tree_allclose(grads[w], ref_grad, rtol=1e-4, atol=1e-5)
    assert tree_allclose(h.value, ref_h, rtol=1e-5, atol=1e-5)
    assert steps.value == 5


def test_vmap_of_jit_of_cond_and_grad_inside_vmap(getkey):
    scale = es.ParamState(jnp.array(2.0), name="scale")
    hits = es.State(jnp.zeros(3), name="hits")

    @es.transform.jit
    def f(x):
        def positive(x):
            hits.value = hits.value + 1.0
            return scale.value * x

        return es.transform.cond(x > 0, positive, lambda x: -x, x)

    xs = jnp.array([1.0, -2.0, 3.0])
    out = es.transform.vmap(f, in_states={0: hits})(xs)
    assert tree_allclose(out, jnp.array([2.0, 2.0, 6.0]))
    assert tree_allclose(hits.value, jnp.array([1.0, 0.0, 1.0]))

    grads = es.transform.vmap(es.transform.grad(lambda x: scale.value * x**2))(xs)
    assert tree_allclose(grads, 2 * 2.0 * xs)


def test_scan_of_checkpointed_jit_under_grad(getkey):
    w = es.ParamState(jr.normal(getkey(), (3, 3)) * 0.5, name="w")
    layer = es.transform.checkpoint(es.transform.jit(lambda h: jnp.tanh(w.value @ h)))

    def loss(h):
        h, _ = es.transform.scan(lambda h, _: (layer(h), None), h, None, length=4)
        return jnp.sum(h**2)

    g = es.transform.grad(loss, grad_states=[w])(jnp.ones(3))

    def pure(w, h):
        for _ in range(4):
            h = jnp.tanh(w @ h)
        return jnp.sum(h**2)

    assert tree_allclose(
        g[w], jax.grad(pure)(w.value, jnp.ones(3)), rtol=1e-5, atol=1e-6
    )
