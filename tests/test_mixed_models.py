"""Laws over random mixed models: `eqx.nn` layers (plain arrays) and eqstate states of
several kinds and dtypes, in nested modules, lists and dicts, with a submodule shared
(tied) between two places.

`mixed_models()` draws a *recipe*; `build(recipe, seed)` builds a model from it, with
values drawn from `seed`. Two builds of one recipe have the same structure and other
values (and other handles), as a model built afresh in a new process has.

1. every array leaf and every state value survives `eqstate.save` ->
   `eqstate.load` into a freshly built model, bit for bit (the single-file format;
   Orbax on a few fixed recipes, each save costing Orbax's fixed overhead);
2. every floating-point value of the model (its arrays, and its `ParamState`s'
   values) gets the gradient `jax.grad` gives the equivalent pure function, through
   each style of differentiation, or the call warns or refuses, naming what gets
   none.

The CI profile runs a few dozen examples; `--hypothesis-profile=long` runs more.
"""

import os
import tempfile
import warnings

import eqstate as es
import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings

from .helpers import tree_allclose, tree_bitwise_equal


_STATE_KINDS = (
    es.State,
    es.ParamState,
    es.ShortTermState,
    es.LongTermState,
    es.NonBatchState,
)
_DTYPES = ("float32", "bfloat16", "float16", "int8", "int32", "uint32", "bool")
_LAYER_DTYPES = ("float32", "bfloat16", "float16")
_SIZES = st.integers(1, 3)
_SHAPES = st.lists(_SIZES, max_size=2).map(tuple)


class Node(eqx.Module):
    """A module holding other parts of a model."""

    children: list


class Tied(eqx.Module):
    """One submodule at two places: `first is second`."""

    first: eqx.Module
    second: eqx.Module


# Recipes: ("linear", in, out, bias, dtype), ("layernorm", shape, affine, dtype),
# ("state", kind index, dtype, shape), ("key",), ("list", [...]), ("dict", {...}),
# ("node", [...]), ("tied", recipe).
_LEAVES = st.one_of(
    st.tuples(
        st.just("linear"), _SIZES, _SIZES, st.booleans(), st.sampled_from(_LAYER_DTYPES)
    ),
    st.tuples(
        st.just("layernorm"), _SHAPES, st.booleans(), st.sampled_from(_LAYER_DTYPES)
    ),
    st.tuples(
        st.just("state"),
        st.integers(0, len(_STATE_KINDS) - 1),
        st.sampled_from(_DTYPES),
        _SHAPES,
    ),
    st.just(("key",)),
)


def _extend(children):
    names = st.text("abcdefgh", min_size=1, max_size=3)
    return st.one_of(
        st.tuples(st.just("list"), st.lists(children, max_size=3)),
        st.tuples(st.just("dict"), st.dictionaries(names, children, max_size=3)),
        st.tuples(st.just("node"), st.lists(children, min_size=1, max_size=3)),
        st.tuples(
            st.just("tied"),
            st.tuples(st.just("node"), st.lists(children, min_size=1, max_size=2)),
        ),
    )


def mixed_models() -> st.SearchStrategy:
    """Recipes of mixed models; `build` makes them. Each holds at least one array or
    state (a model holding neither is no checkpoint)."""
    return st.recursive(_LEAVES, _extend, max_leaves=8).filter(_holds_something)


def _holds_something(recipe) -> bool:
    kind = recipe[0]
    if kind in ("list", "node"):
        return any(map(_holds_something, recipe[1]))
    if kind == "dict":
        return any(map(_holds_something, recipe[1].values()))
    if kind == "tied":
        return _holds_something(recipe[1])
    if kind == "layernorm":
        return recipe[2]
    return True


def _random_bits(rng: np.random.Generator, shape, dtype: str) -> jax.Array:
    """Values covering the whole bit pattern of `dtype`, NaN payloads included."""
    dtype = np.dtype(getattr(ml_dtypes, dtype, dtype))
    if dtype == np.bool_:
        return jnp.asarray(rng.integers(0, 2, shape).astype(np.bool_))
    bits = rng.integers(0, 256, (*shape, dtype.itemsize), dtype=np.uint8)
    return jnp.asarray(bits.view(dtype).reshape(shape))


def _randomised(rng, layer):
    """`layer` with random bits in each of its arrays: its initialisation leaves some
    (a LayerNorm's ones and zeros) the same in every build."""
    arrays, rest = eqx.partition(layer, eqx.is_array)
    arrays = jax.tree.map(lambda x: _random_bits(rng, x.shape, x.dtype.name), arrays)
    return eqx.combine(arrays, rest)


def _build(recipe, rng: np.random.Generator):
    kind = recipe[0]
    if kind == "linear":
        _, n_in, n_out, bias, dtype = recipe
        key = jax.random.key(int(rng.integers(2**31)))
        layer = eqx.nn.Linear(n_in, n_out, use_bias=bias, dtype=dtype, key=key)
        return _randomised(rng, layer)
    if kind == "layernorm":
        _, shape, affine, dtype = recipe
        layer = eqx.nn.LayerNorm(
            shape, use_weight=affine, use_bias=affine, dtype=jnp.dtype(dtype)
        )
        return _randomised(rng, layer)
    if kind == "state":
        _, index, dtype, shape = recipe
        return _STATE_KINDS[index](_random_bits(rng, shape, dtype))
    if kind == "key":
        return es.RandomState(int(rng.integers(2**31)))
    if kind == "list":
        return [_build(child, rng) for child in recipe[1]]
    if kind == "dict":
        return {name: _build(child, rng) for name, child in recipe[1].items()}
    if kind == "node":
        return Node([_build(child, rng) for child in recipe[1]])
    assert kind == "tied"
    shared = _build(recipe[1], rng)
    return Tied(shared, shared)


def build(recipe, seed: int):
    """The model `recipe` describes, with values drawn from `seed`."""
    return _build(recipe, np.random.default_rng(seed))


def everything(model) -> list:
    """Every array of `model` and every state's value, in flattening order."""
    leaves = jax.tree.leaves(model, is_leaf=es.is_state)
    return [
        x.value if es.is_state(x) else x
        for x in leaves
        if es.is_state(x) or eqx.is_array(x)
    ]


def _round_trips(recipe, backend: str) -> None:
    model, fresh = build(recipe, 0), build(recipe, 1)
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "model")
        es.save(path, model, backend=backend)
        restored = es.load(path, fresh, backend=backend)
    assert es.states_of(restored) == es.states_of(fresh)
    assert tree_bitwise_equal(everything(restored), everything(model))


@settings(max_examples=max(settings.default.max_examples // 4, 10))
@given(recipe=mixed_models())
def test_every_array_and_state_value_survives_save_and_load_bit_exactly(recipe):
    _round_trips(recipe, "single-file")


_FIXED = {
    "linear and a state": (
        "node",
        [("linear", 3, 2, True, "bfloat16"), ("state", 1, "float32", (2,))],
    ),
    "tied layers and keys": (
        "dict",
        {
            "tied": (
                "tied",
                ("node", [("layernorm", (3,), True, "float16"), ("key",)]),
            ),
            "states": (
                "list",
                [("state", 2, "int8", (3, 2)), ("state", 4, "bool", ())],
            ),
        },
    ),
}


@pytest.mark.parametrize("recipe", _FIXED.values(), ids=_FIXED.keys())
def test_every_array_and_state_value_survives_an_orbax_save_and_load(recipe):
    _round_trips(recipe, "orbax")


def test_the_strategy_draws_tied_submodules_and_every_kind_of_leaf():
    seen: set = set()

    @settings(max_examples=100, derandomize=True)
    @given(recipe=mixed_models())
    def collect(recipe):
        stack = [recipe]
        while stack:
            node = stack.pop()
            seen.add(node[0] if node[0] != "state" else ("state", node[2]))
            if node[0] in ("list", "node"):
                stack.extend(node[1])
            elif node[0] == "dict":
                stack.extend(node[1].values())
            elif node[0] == "tied":
                stack.append(node[1])

    collect()
    assert {"linear", "layernorm", "key", "tied", "node", "dict", "list"} <= seen
    assert {("state", "bfloat16"), ("state", "int32")} <= seen


def _sane(model):
    """`model` with small finite values in its floating-point arrays and states: the
    recipes' random bits hold NaNs and infinities."""

    def sane(x):
        ramp = jnp.linspace(-1.0, 1.0, x.size, dtype=jnp.float32)
        return ramp.reshape(x.shape).astype(x.dtype)

    for state in set(es.states_of(model)):
        if jnp.issubdtype(state.value.dtype, jnp.inexact):
            state.value = sane(state.value)
    return jax.tree.map(lambda x: sane(x) if eqx.is_inexact_array(x) else x, model)


def _loss(model) -> jax.Array:
    """A scalar that depends on every floating-point value of `model`, each place it
    appears (a tied submodule counts twice)."""
    total = jnp.zeros((), jnp.float32)
    for leaf in jax.tree.leaves(model, is_leaf=es.is_state):
        x = leaf.value if es.is_state(leaf) else leaf
        if eqx.is_inexact_array(x):
            total = total + jnp.sum(jnp.sin(x.astype(jnp.float32)))
    return total


def _reference(model) -> tuple[list, dict]:
    """What `jax.grad` gives the pure form of `_loss`: the gradients of the model's
    floating-point arrays (in flattening order) and of its `ParamState`s' values."""
    leaves = jax.tree.leaves(model, is_leaf=es.is_state)
    values = {s: s.value for s in es.states_of(model)}
    params = {
        i: values[s]
        for i, s in enumerate(values)
        if isinstance(s, es.ParamState) and jnp.issubdtype(values[s].dtype, jnp.inexact)
    }
    order = list(values)

    def pure(arrays, params):
        arrays = iter(arrays)
        total = jnp.zeros((), jnp.float32)
        for leaf in leaves:
            if es.is_state(leaf):
                i = order.index(leaf)
                x = params.get(i, values[leaf])
            else:
                x = next(arrays) if eqx.is_inexact_array(leaf) else leaf
            if eqx.is_inexact_array(x):
                total = total + jnp.sum(jnp.sin(x.astype(jnp.float32)))
        return total

    arrays = [x for x in leaves if eqx.is_inexact_array(x)]
    grads, param_grads = jax.grad(pure, argnums=(0, 1))(arrays, params)
    return grads, {order[i]: g for i, g in param_grads.items()}


def _close(a, b) -> bool:
    as_f32 = lambda t: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), t)  # noqa: E731
    return tree_allclose(as_f32(a), as_f32(b), rtol=1e-2, atol=1e-2)


@settings(max_examples=max(settings.default.max_examples // 4, 10))
@given(recipe=mixed_models())
def test_every_floating_point_value_gets_its_gradient_or_the_call_says_so(recipe):
    model = _sane(build(recipe, 0))
    ref_arrays, ref_params = _reference(model)

    # The recommended style: the model passed in, arrays and parameters together.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state_grads, grads = es.transform.grad(
            _loss, argnums=0, grad_states=es.ParamState
        )(model)
    assert _close(jax.tree.leaves(grads), ref_arrays)
    assert _close({s: state_grads[s] for s in ref_params}, ref_params)

    # brainstate's style: the model closed over (or global), `grad_states` alone.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if not ref_params:
            with pytest.raises(ValueError, match="selects none of the floating-point"):
                es.transform.grad(lambda: _loss(model), grad_states=es.ParamState)()
        else:
            state_grads = es.transform.grad(
                lambda: _loss(model), grad_states=es.ParamState
            )()
            assert _close({s: state_grads[s] for s in ref_params}, ref_params)
    untrained = [str(w.message) for w in caught if "get no gradient" in str(w.message)]
    assert bool(untrained) == bool(ref_params and ref_arrays)

    # Equinox's style: `eqx.filter_grad` differentiates the arrays; a parameter
    # state read inside it is a constant, and the read warns, naming it.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = eqx.filter_grad(_loss)(model)
    assert _close(jax.tree.leaves(grads), ref_arrays)
    read = {str(w.message) for w in caught if "a JAX differentiation" in str(w.message)}
    assert len(read) == len(ref_params)  # one message per parameter, naming it
