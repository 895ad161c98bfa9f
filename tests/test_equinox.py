"""eqx.Modules holding handles under Equinox's own transforms and tree tools."""

import functools as ft

import eqstate as es
import eqstate.nn as enn
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, jaxtyped, TypeCheckError

from .helpers import raises_at_run_time, tree_allclose, tree_bitwise_equal


_TOL = dict(rtol=1e-5, atol=1e-5)


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


# --- A mixed model: eqx.nn.Linear arrays next to eqstate layers -------------------------


class _Net(eqx.Module):
    linear1: eqx.nn.Linear
    bn: enn.BatchNorm
    dropout: enn.Dropout
    linear2: eqx.nn.Linear

    def __init__(self, key, p=0.25):
        k1, k2 = jr.split(key)
        self.linear1 = eqx.nn.Linear(3, 8, key=k1)
        self.bn = enn.BatchNorm(8, momentum=0.9)
        self.dropout = enn.Dropout(p)
        self.linear2 = eqx.nn.Linear(8, 1, key=k2)

    def __call__(self, x, *, key=None):
        h = jax.nn.relu(self.bn(jax.vmap(self.linear1)(x)))
        return jax.vmap(self.linear2)(self.dropout(h, key=key))[:, 0]


def _pure_net(model, bn_values, x, mask=None):
    """`_Net` in plain JAX, from its arrays and the values of its BatchNorm."""
    h = x @ model.linear1.weight.T + model.linear1.bias[None]
    mean, var = h.mean(0, keepdims=True), h.var(0, keepdims=True)
    h = (h - mean) / jnp.sqrt(var + 1e-5)
    h = h * bn_values["weight"][None] + bn_values["bias"][None]
    h = jax.nn.relu(h)
    if mask is not None:
        h = jnp.where(mask, h / 0.75, 0)
    return (h @ model.linear2.weight.T + model.linear2.bias[None])[:, 0]


def _bn_values(model, states):
    return {"weight": states[model.bn.weight], "bias": states[model.bn.bias]}


def test_mixed_model_under_filter_jit_reads_and_writes_the_state_dict(getkey):
    model, states = es.make_with_states(_Net)(getkey())
    states = states | es.world().filter(es.random.DEFAULT)  # Dropout draws from it
    traces = []

    @eqx.filter_jit
    def step(model, states, x):
        traces.append(1)
        return es.run(model, states, x)

    x = jr.normal(getkey(), (16, 3))
    new_states, y = step(model, states, x)
    expected_states, expected = es.run(model, states, x)  # eager: the same numbers
    assert tree_allclose(y, expected) and y.shape == (16,)
    assert tree_allclose(
        new_states[model.bn.running_mean], expected_states[model.bn.running_mean]
    )
    assert not tree_bitwise_equal(
        new_states[es.random.DEFAULT], states[es.random.DEFAULT]
    )
    step(model, new_states, x)
    assert len(traces) == 1  # the model is static (its leaves are handles or arrays)


def test_mixed_model_keys_follow_equinox_and_match_plain_jax(getkey):
    model, states = es.make_with_states(_Net)(getkey())
    x, key = jr.normal(getkey(), (16, 3)), getkey()
    _, y = eqx.filter_jit(lambda m, s, x, k: es.run(ft.partial(m, key=k), s, x))(
        model, states, x, key
    )
    mask = jr.bernoulli(key, 0.75, (16, 8))
    assert tree_allclose(
        y, _pure_net(model, _bn_values(model, states), x, mask), **_TOL
    )


def test_filter_grad_differentiates_linear_arrays_and_param_states_together(getkey):
    model, states = es.make_with_states(_Net)(getkey())
    model = eqx.nn.inference_mode(model, False)
    model = eqx.tree_at(lambda m: m.dropout.p, model, 0.0)
    params, rest = states.split(es.ParamState)
    x = jr.normal(getkey(), (16, 3))

    @eqx.filter_grad(has_aux=True)
    def grads_of(trainable, rest, x):
        model, params = trainable
        new_states, y = es.run(model, params | rest, x)
        return jnp.sum(y**2), new_states

    (model_grads, param_grads), new_states = grads_of((model, params), rest, x)
    assert isinstance(param_grads, es.StateDict)
    assert model_grads.bn.weight is None  # a handle: static, no gradient

    def pure_loss(linear1, linear2, weight, bias):
        m = eqx.tree_at(lambda m: (m.linear1, m.linear2), model, (linear1, linear2))
        return jnp.sum(_pure_net(m, {"weight": weight, "bias": bias}, x) ** 2)

    expected = jax.grad(pure_loss, argnums=(0, 1, 2, 3))(
        model.linear1, model.linear2, params[model.bn.weight], params[model.bn.bias]
    )
    assert tree_allclose(
        (
            model_grads.linear1,
            model_grads.linear2,
            param_grads[model.bn.weight],
            param_grads[model.bn.bias],
        ),
        expected,
        **_TOL,
    )
    assert not tree_allclose(
        new_states[model.bn.running_mean], states[model.bn.running_mean]
    )


def test_filter_vmap_over_an_ensemble_of_mixed_models(getkey):
    keys = jr.split(getkey(), 4)
    ensemble, states = es.transform.vmap2_new_states(
        lambda k: _Net(k, p=0.0), axis_size=4, in_axes=0
    )(keys)
    assert ensemble.linear1.weight.shape == (4, 8, 3)  # eqx arrays are stacked too
    assert states[ensemble.bn.running_mean].shape == (4, 8)
    x = jr.normal(getkey(), (16, 3))

    @eqx.filter_vmap(in_axes=(eqx.if_array(0), 0, None))
    def run_all(model, states, x):
        return es.run(model, states, x)

    new_states, ys = run_all(ensemble, states, x)
    assert ys.shape == (4, 16) and new_states[ensemble.bn.running_mean].shape == (4, 8)
    for i in range(4):
        member_states, member = es.run(es.member, states, ensemble, i)
        _, y = es.run(member, member_states, x)
        assert tree_allclose(y, ys[i], **_TOL)
        assert tree_allclose(
            member_states[member.bn.running_mean], states[ensemble.bn.running_mean][i]
        )


def test_tree_at_and_partition_on_a_mixed_model(getkey):
    model, states = es.make_with_states(_Net)(getkey())
    x = jr.normal(getkey(), (16, 3))

    # `partition` by arrays: the eqx.nn.Linear arrays on one side, handles and
    # static fields on the other; `combine` gives back a model that runs.
    arrays, static = eqx.partition(model, eqx.is_array)
    assert es.states_of(arrays) == ()
    assert es.states_of(static) == es.states_of(model)
    rebuilt = eqx.combine(arrays, static)
    key = getkey()
    assert tree_bitwise_equal(
        es.run(ft.partial(rebuilt, key=key), states, x)[1],
        es.run(ft.partial(model, key=key), states, x)[1],
    )

    # `tree_at` swaps a layer for a clone (fresh handles) or changes a field.
    with es.scope(states) as sc:
        clone_bn = es.clone(model.bn)
    assert sc.states is not None
    swapped = eqx.tree_at(lambda m: m.bn, model, clone_bn)
    new_states, _ = es.run(ft.partial(swapped, key=key), sc.states, x)
    assert not tree_bitwise_equal(
        new_states[clone_bn.running_mean], sc.states[clone_bn.running_mean]
    )
    assert tree_bitwise_equal(
        new_states[model.bn.running_mean], states[model.bn.running_mean]
    )  # the original layer was not called
    inference = eqx.tree_at(lambda m: m.bn.inference, model, True)
    unchanged, _ = es.run(ft.partial(inference, key=key), states, x)
    assert tree_bitwise_equal(
        unchanged[model.bn.running_mean], states[model.bn.running_mean]
    )


def _checked_calls(checked, mesh):
    T = es.transform
    body = lambda c, _: (checked(c), None)  # noqa: E731
    return {
        "jit": lambda: T.jit(checked)(1.0),
        "jit, called twice": lambda: (T.jit(checked)(-1.0), T.jit(checked)(1.0)),
        "grad": lambda: T.grad(checked)(1.0),
        "value_and_grad": lambda: T.value_and_grad(checked)(1.0),
        "jacrev": lambda: T.jacrev(checked)(1.0),
        "jacfwd": lambda: T.jacfwd(checked)(1.0),
        "hessian": lambda: T.hessian(checked)(1.0),
        "vector_grad": lambda: T.vector_grad(checked)(1.0),
        "jvp": lambda: T.jvp(checked, (1.0,), (1.0,)),
        "vjp": lambda: T.vjp(checked, 1.0),
        "vmap": lambda: T.vmap(checked)(jnp.ones(2)),
        "map": lambda: T.map(checked, jnp.ones(2)),
        "remat": lambda: T.remat(checked)(1.0),
        "scan": lambda: T.scan(body, 1.0, None, length=1),
        "checkpointed_scan": lambda: T.checkpointed_scan(body, 1.0, None, length=2),
        "for_loop": lambda: T.for_loop(checked, jnp.ones(2)),
        "while_loop": lambda: T.while_loop(lambda c: c < 3, checked, 1.0),
        "cond": lambda: T.cond(True, checked, lambda x: x, 1.0),
        "switch": lambda: T.switch(0, [checked, lambda x: x], 1.0),
        "ifelse": lambda: T.ifelse([True, True], [lambda: 1, lambda: 2]),
        "shard_map": lambda: T.shard_map(
            checked, mesh=mesh, in_specs=P(), out_specs=P()
        )(jnp.array(1.0)),
    }


_TRANSFORMS = list(_checked_calls(None, None))


@pytest.mark.upstream_leak("eqx.error_if keeps its caller's frames alive")
@pytest.mark.parametrize("transform", _TRANSFORMS)
@raises_at_run_time
def test_a_failed_error_if_raises_equinox_runtime_error_through_every_transform(
    transform,
):
    s = es.State(jnp.array(0.0), name="s")

    def checked(x):
        s.value = s.value + 1
        return eqx.error_if(x, x > 0, "x must not be positive")

    mesh = jax.make_mesh((1,), ("d",))
    with pytest.raises(eqx.EquinoxRuntimeError) as caught:
        _checked_calls(checked, mesh)[transform]()
    message = str(caught.value)
    expected = "exactly one condition" if transform == "ifelse" else "x must not be"
    # Equinox's own advice (use `eqx.filter_jit`, which cannot read states) is gone.
    assert expected in message and "filter_jit" not in message
    assert s.value == (1.0 if transform == "jit, called twice" else 0.0)


class _StaticCounter(eqx.Module):
    w: es.ParamState
    steps: es.ShortTermState = eqx.field(static=True)

    def __init__(self):
        self.w = es.ParamState(jnp.zeros(2), name="w")
        self.steps = es.ShortTermState(jnp.array(0), name="steps")


@pytest.mark.parametrize(
    "use",
    [
        lambda model, _: es.states_of(model),
        lambda model, _: es.values_of(model),
        lambda model, _: es.clone(model),
        lambda model, path: es.save(path, model),
    ],
    ids=["states_of", "values_of", "clone", "save"],
)
def test_a_handle_in_a_static_field_is_refused_where_flattening_would_miss_it(
    use, tmp_path
):
    model = {"model": [eqx.nn.Identity(), _StaticCounter()]}
    with pytest.raises(
        ValueError,
        match=r"ShortTermState 'steps' is held by `_StaticCounter.steps` \(at "
        r"`\['model'\]\[1\].steps`\), a field marked `eqx.field\(static=True\)`.*"
        r"Remove `static=True`",
    ):
        use(model, tmp_path / "model.eqstate")
    assert not (tmp_path / "model.eqstate").exists()
