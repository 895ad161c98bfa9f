"""eqx.Modules holding handles under Equinox's own transforms and tree tools."""

import eqstate as es
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from jaxtyping import Array, Float, jaxtyped, TypeCheckError

from .helpers import tree_allclose


class Linear(eqx.Module):
    weight: es.ParamState
    bias: es.ParamState
    calls: es.ShortTermState
    activation: str = eqx.field(static=True, default="tanh")

    def __init__(self, n_in, n_out, key):
        self.weight = es.ParamState(jr.normal(key, (n_out, n_in)), name="weight")
        self.bias = es.ParamState(jnp.zeros(n_out), name="bias")
        self.calls = es.ShortTermState(jnp.array(0), name="calls")

    def __call__(self, x):
        self.calls.value = self.calls.value + 1
        return jnp.tanh(self.weight.value @ x + self.bias.value)


def _pure(weight, bias, x):
    return jnp.tanh(weight @ x + bias)


def test_filter_jit_with_a_module_and_an_explicit_state_dict(getkey):
    model, states = es.make_with_states(Linear)(3, 2, getkey())
    step = eqx.filter_jit(lambda model, states, x: es.run(model, states, x))
    x = jr.normal(getkey(), (3,))
    states, y = step(model, states, x)
    states, y = step(model, states, x)
    assert states[model.calls] == 2
    assert tree_allclose(y, _pure(states[model.weight], states[model.bias], x))


def test_filter_grad_over_a_state_dict(getkey):
    model, states = es.make_with_states(Linear)(3, 2, getkey())
    params, rest = states.split(es.ParamState)
    x = jr.normal(getkey(), (3,))

    @eqx.filter_grad(has_aux=True)
    def grad_fn(params, rest, x):
        new_states, y = es.run(model, params | rest, x)
        return jnp.sum(y**2), new_states

    grads, new_states = grad_fn(params, rest, x)
    ref = jax.grad(lambda w, b: jnp.sum(_pure(w, b, x) ** 2), argnums=(0, 1))(
        params[model.weight], params[model.bias]
    )
    assert isinstance(grads, es.StateDict)
    assert tree_allclose((grads[model.weight], grads[model.bias]), ref)
    assert new_states[model.calls] == 1


def test_filter_vmap_over_an_ensemble_state_dict(getkey):
    model, states = es.transform.vmap2_new_states(
        lambda key: Linear(3, 2, key), axis_size=4, in_axes=0
    )(jr.split(getkey(), 4))
    xs = jr.normal(getkey(), (4, 3))
    new_states, ys = eqx.filter_vmap(lambda s, x: es.run(model, s, x))(states, xs)
    expected = jax.vmap(_pure)(states[model.weight], states[model.bias], xs)
    assert tree_allclose(ys, expected)
    assert (new_states[model.calls] == 1).all()


def test_tree_at_replaces_handles_and_static_fields(getkey):
    model = Linear(3, 2, getkey())
    new_weight = es.ParamState(jnp.zeros((2, 3)), name="zeros")
    swapped = eqx.tree_at(lambda m: m.weight, model, new_weight)
    assert swapped.weight is new_weight and swapped.bias is model.bias
    assert tree_allclose(swapped(jnp.ones(3)), jnp.zeros(2))


def test_partition_and_combine_keep_handles(getkey):
    model = Linear(3, 2, getkey())
    arrays, static = eqx.partition(model, eqx.is_array)
    assert jax.tree_util.tree_leaves(arrays) == []
    rebuilt = eqx.combine(arrays, static)
    assert rebuilt.weight is model.weight
    handles, rest = eqx.partition(model, es.is_state, is_leaf=es.is_state)
    assert es.states_of(handles) == (model.weight, model.bias, model.calls)
    assert eqx.combine(handles, rest, is_leaf=es.is_state).calls is model.calls


def test_module_with_handles_is_hashable_static_for_filter_jit(getkey):
    model = Linear(3, 2, getkey())
    traces = []

    @eqx.filter_jit
    def f(model, states, x):
        traces.append(1)
        return es.run(model, states, x)[1]

    states = es.values_of(model)
    f(model, states, jnp.ones(3))
    f(model, states, jnp.ones(3))
    assert len(traces) == 1


def test_jaxtyping_annotations_with_state_generics():
    @jaxtyped(typechecker=__import__("beartype").beartype)
    def norm(s: es.State[Float[Array, " n"]]) -> Float[Array, ""]:
        return jnp.sum(s.value**2)

    assert norm(es.State(jnp.ones(3))) == 3.0
    with pytest.raises(TypeCheckError, match="Type-check error"):
        norm(jnp.ones(3))  # pyright: ignore[reportArgumentType]
