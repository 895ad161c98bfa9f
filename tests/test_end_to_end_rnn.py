"""An RNN with a ShortTermState hidden state and ParamState weights, trained with
`jit(value_and_grad(...))` over a `for_loop`, against the same program in pure JAX."""

import eqstate as es
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax
import pytest

from .helpers import tree_allclose


class RNN(eqx.Module):
    wx: es.ParamState
    wh: es.ParamState
    b: es.ParamState
    wo: es.ParamState
    h: es.ShortTermState

    def __init__(self, n_in, n_hidden, key):
        k1, k2, k3 = jr.split(key, 3)
        self.wx = es.ParamState(jr.normal(k1, (n_hidden, n_in)) * 0.3, name="wx")
        self.wh = es.ParamState(jr.normal(k2, (n_hidden, n_hidden)) * 0.3, name="wh")
        self.b = es.ParamState(jnp.zeros(n_hidden), name="b")
        self.wo = es.ParamState(jr.normal(k3, (1, n_hidden)) * 0.3, name="wo")
        self.h = es.ShortTermState(jnp.zeros(n_hidden), name="h")

    def reset(self):
        self.h.value = jnp.zeros_like(self.h.value)

    def __call__(self, x):
        self.h.value = jnp.tanh(
            self.wx.value @ x + self.wh.value @ self.h.value + self.b.value
        )
        return (self.wo.value @ self.h.value)[0]


def _pure_loss(params, xs, ys):
    def step(h, x):
        h = jnp.tanh(params["wx"] @ x + params["wh"] @ h + params["b"])
        return h, (params["wo"] @ h)[0]

    h_final, preds = jax.lax.scan(step, jnp.zeros(params["b"].shape), xs)
    return jnp.mean((preds - ys) ** 2), h_final


@pytest.mark.numpy_promotion("optax.adam: a Python float to an int32 power")
@pytest.mark.usefixtures("tracing_mode")
def test_rnn_training_matches_pure_jax(getkey):
    model = RNN(2, 8, getkey())
    xs = jr.normal(getkey(), (20, 2))
    ys = jnp.sin(jnp.cumsum(xs[:, 0]))
    optimizer = optax.adam(1e-2)

    def loss_fn(xs, ys):
        model.reset()
        preds = es.transform.for_loop(model, xs)
        return jnp.mean((preds - ys) ** 2)

    train_step = es.transform.jit(
        es.transform.value_and_grad(loss_fn, grad_states=es.ParamState)
    )
    params = es.values_of(model, es.ParamState)
    opt_state = optimizer.init(params)

    names = {s: s.name for s in params}
    ref_params = {names[s]: v for s, v in params.items()}
    ref_opt_state = optimizer.init(ref_params)
    ref_step = jax.jit(jax.value_and_grad(_pure_loss, has_aux=True))

    for _ in range(5):
        loss, grads = train_step(xs, ys)
        current = es.values_of(model, es.ParamState)
        updates, opt_state = optimizer.update(grads, opt_state, current)
        es.assign(optax.apply_updates(current, updates))

        (ref_loss, ref_h), ref_grads = ref_step(ref_params, xs, ys)
        ref_updates, ref_opt_state = optimizer.update(
            ref_grads, ref_opt_state, ref_params
        )
        ref_params = optax.apply_updates(ref_params, ref_updates)

        assert tree_allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
        assert tree_allclose(model.h.value, ref_h, rtol=1e-5, atol=1e-5)
    final = {names[s]: v for s, v in es.values_of(model, es.ParamState).items()}
    assert tree_allclose(final, ref_params, rtol=1e-5, atol=1e-5)
    assert not tree_allclose(final["wx"], params[model.wx])
