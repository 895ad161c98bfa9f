"""Models holding handles passed into every transform: a handle in an argument is a
static leaf, and its state is read and written exactly as if closed over."""

import collections
import dataclasses
import functools as ft
import re
import warnings
from collections.abc import Callable
from typing import Any

import eqstate as es
import eqstate.nn as enn
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from .helpers import raises_at_run_time, traces_per_key, tree_allclose


class Mixed(eqx.Module):
    """An `eqx.nn.Linear`, a parameter state, a counter and a static flag."""

    linear: eqx.nn.Linear
    scale: es.ParamState
    calls: es.ShortTermState
    double: bool

    def __init__(self, key, double: bool = False):
        self.linear = eqx.nn.Linear(3, 3, key=key)
        self.scale = es.ParamState(jnp.arange(1.0, 4.0), name="scale")
        self.calls = es.ShortTermState(jnp.array(0), name="calls")
        self.double = double

    def __call__(self, x):
        self.calls.value = self.calls.value + 1
        y = self.linear(x) * self.scale.value
        return 2 * y if self.double else y


def _pure(weight, bias, scale, x):
    return (weight @ x + bias) * scale


def _loss(model, x):
    return jnp.sum(model(x) ** 2)


def _pure_loss(weight, bias, scale, x):
    return jnp.sum(_pure(weight, bias, scale, x) ** 2)


def test_jit_with_a_model_argument_equals_the_closed_over_model(getkey):
    model = Mixed(getkey())
    x = jr.normal(getkey(), (3,))
    by_argument = es.transform.jit(_loss)
    closed_over = es.transform.jit(lambda x: _loss(model, x))
    assert tree_allclose(by_argument(model, x), closed_over(x))
    assert by_argument(model, x) == closed_over(x)
    assert model.calls.value == 4


def test_jit_with_another_model_of_the_same_structure_is_right(getkey):
    traces = []
    step = es.transform.jit(lambda m, x: traces.append(1) or _loss(m, x))
    a, b = Mixed(getkey()), Mixed(getkey())
    x = jnp.ones(3)
    for _ in range(3):
        for m in (a, b):
            expected = _pure_loss(m.linear.weight, m.linear.bias, m.scale.value, x)
            assert tree_allclose(step(m, x), expected, rtol=1e-5)
    assert a.calls.value == 3 and b.calls.value == 3
    # One trace per model: their handles differ.
    assert len(traces) == 2 * traces_per_key()


def test_jit_sees_a_static_flag_of_the_model(getkey):
    model = Mixed(getkey())
    x = jnp.ones(3)
    step = es.transform.jit(lambda m, x: m(x))
    doubled = eqx.tree_at(lambda m: m.double, model, True)
    assert tree_allclose(step(doubled, x), 2 * step(model, x))


def test_jit_sees_changes_to_a_mutable_container_in_the_model(getkey):
    class Bag(eqx.Module):
        items: list

    scale = es.ParamState(jnp.array(2.0))
    bag = Bag([scale, jnp.array(1.0)])
    step = es.transform.jit(
        lambda b: sum(x.value if es.is_state(x) else x for x in b.items)
    )
    assert step(bag) == 3.0
    bag.items[1] = jnp.array(5.0)  # the same object, other contents
    assert step(bag) == 7.0
    bag.items.append(jnp.array(1.0))
    assert step(bag) == 8.0


def test_jit_returns_a_model_with_its_handles(getkey):
    model = Mixed(getkey())

    @es.transform.jit
    def step(m, x):
        m(x)
        return eqx.tree_at(lambda m: m.linear.bias, m, m.linear.bias + 1)

    new = step(model, jnp.ones(3))
    assert new.scale is model.scale and new.calls is model.calls
    assert new.double is False  # a static flag stays a Python bool
    assert (new.linear.bias == model.linear.bias + 1).all()
    again = step(new, jnp.ones(3))
    assert (again.linear.bias == model.linear.bias + 2).all()
    assert model.calls.value == 2


def test_jit_with_a_model_argument_keeps_the_fast_path(getkey):
    model = Mixed(getkey())
    traced = []

    def loss(model, x):
        traced.append(1)
        return _loss(model, x)

    step = es.transform.jit(loss)
    step(model, jnp.ones(3))
    first_call = len(traced)  # one trace, or two on the two-pass fallback
    assert first_call >= 1
    for _ in range(5):
        step(model, jnp.ones(3) * 2)
    assert len(traced) == first_call  # no Python trace per call, and no retrace
    assert model.calls.value == 6


def test_jit_of_model_and_x_after_the_same_model_sees_every_change(getkey):
    # `f(model, x)` again with the model of the last call takes a shortcut past
    # splitting; each way the call can differ from the last must leave it.
    class Holder(eqx.Module):
        states: list
        weight: jax.Array

    @es.transform.jit
    def f(m, x):
        if isinstance(x, _Gate):  # a Module: its `bool` field stays static
            return x.weight * 2 if x.on is True else x.weight
        return sum(s.value for s in m.states) * m.weight + x

    a, b = es.State(jnp.ones(2)), es.State(jnp.full(2, 10.0))
    model = Holder([a], jnp.full(2, 2.0))
    x = jnp.zeros(2)
    for _ in range(3):
        assert (f(model, x) == 2.0).all()
    model.states.append(b)  # the same model, its list of handles changed
    assert (f(model, x) == 22.0).all()
    model.states[1] = a
    assert (f(model, x) == 4.0).all()
    other = Holder([b], jnp.full(2, 3.0))  # another model of the same structure
    assert (f(other, x) == 30.0).all()
    assert (f(model, x + 1) == 5.0).all()
    assert (f(model, _Gate(jnp.ones(2), True)) == 2.0).all()
    assert (f(model, 1.0) == 5.0).all()  # a Python float, traced
    assert (f(model, np.ones(2, np.float32)) == 5.0).all()
    assert (f(model, x, *()) == 4.0).all()
    with pytest.raises(TypeError):
        f(model)  # one argument fewer
    assert (f(model, x) == 4.0).all()


@pytest.mark.parametrize("labelled", [False, True])
@pytest.mark.parametrize("donate", [False, True])
def test_jit_of_model_and_x_switches_plans_for_one_model(donate, labelled):
    # Repeated `f(model, x)` calls reuse the plan found for the first (an output of
    # arrays alone, without donation: straight through that call's function); a
    # call whose shapes need other states, or a cleared cache, must not run the old
    # plan.
    class Pair(eqx.Module):
        short: es.State
        long: es.State
        scale: es.State

    model = Pair(es.State(jnp.zeros(())), es.State(jnp.zeros(())), es.State(2.0))
    mode = {"add": 1.0}

    @ft.partial(es.transform.jit, donate_states=donate)
    def f(m, x):
        target = m.short if x.shape[0] < 3 else m.long
        target.value = target.value + mode["add"] * x.sum()
        out = {"scaled": x * m.scale.value}
        return {**out, "label": "out"} if labelled else out

    expected = {"short": 0.0, "long": 0.0}
    for n in (2, 2, 2, 4, 4, 2, 4, 2, 2, 2):
        out = f(model, jnp.ones(n))
        expected["short" if n < 3 else "long"] += n
        assert out.get("label", "out") == "out" and (out["scaled"] == 2.0).all()
        assert float(model.short.value) == expected["short"]
        assert float(model.long.value) == expected["long"]
    mode["add"] = 10.0  # the function changed: stale until the cache is cleared
    f.clear_cache()
    f(model, jnp.ones(2))
    f(model, jnp.ones(2))
    assert float(model.short.value) == expected["short"] + 40.0
    assert float(model.scale.value) == 2.0


@pytest.mark.upstream_leak("eqx.error_if keeps its caller's frames alive")
@raises_at_run_time
def test_repeated_calls_of_model_and_x_follow_the_context_and_fail_cleanly():
    # After a few calls `f(model, x)` at top level, the next goes straight through
    # the last one's function: inside a scope or a raw transform it must still read
    # and write there, and a call that fails must write nothing.
    class Counter(eqx.Module):
        total: es.State

    model = Counter(es.State(jnp.zeros(())))

    @es.transform.jit
    def add(m, x):
        x = eqx.error_if(x, x < 0, "negative")
        m.total.value = m.total.value + x.sum()
        return m.total.value * 2

    for _ in range(3):
        add(model, jnp.ones(()))
    with es.scope(es.StateDict({model.total: jnp.array(10.0)})) as scope:
        assert add(model, jnp.ones(())) == 22.0
    assert float(model.total.value) == 3.0 and scope.states[model.total] == 11.0
    assert float(add(model, jnp.ones(()))) == 8.0
    with pytest.raises(es.TraceContextError):
        jax.vmap(lambda x: add(model, x))(jnp.ones(3))  # a write in a raw transform
    with pytest.raises(eqx.EquinoxRuntimeError, match="negative"):
        add(model, -jnp.ones(()))
    assert float(model.total.value) == 4.0
    assert float(add(model, jnp.ones(()))) == 10.0


def test_stateful_function_with_a_model_argument(getkey):
    model = Mixed(getkey())
    sf = es.transform.StatefulFunction(_loss).make_jaxpr(model, jnp.ones(3))
    assert set(sf.get_read_states()) == {model.scale}
    assert sf.get_write_states() == (model.calls,)
    states, out = sf.jaxpr_call(es.values_of(model), model, jnp.ones(3))
    assert states[model.calls] == 1 and model.calls.value == 0
    assert out == _loss(model, jnp.ones(3))


@pytest.mark.parametrize("transform", ["grad", "value_and_grad"])
def test_grad_of_a_model_gives_array_and_state_gradients_like_filter_grad(
    getkey, transform
):
    model = Mixed(getkey())
    x = jr.normal(getkey(), (3,))
    fn = getattr(es.transform, transform)(_loss, grad_states=es.ParamState, argnums=0)
    result = fn(model, x)
    state_grads, model_grads = result if transform == "grad" else result[1]
    ref_w, ref_b, ref_s = jax.grad(_pure_loss, argnums=(0, 1, 2))(
        model.linear.weight, model.linear.bias, model.scale.value, x
    )
    assert tree_allclose(model_grads.linear.weight, ref_w)
    assert tree_allclose(model_grads.linear.bias, ref_b)
    assert tree_allclose(state_grads[model.scale], ref_s)
    # Equinox's convention: `None` where nothing is differentiated.
    assert model_grads.scale is None and model_grads.calls is None
    assert model_grads.double is None
    assert model.calls.value == 1


def test_grad_of_a_model_matches_eqx_filter_grad(getkey):
    model = Mixed(getkey())
    x = jnp.ones(3)
    with pytest.warns(UserWarning, match="'scale', held by the differentiated"):
        grads = es.transform.grad(_loss)(model, x)
    values = es.values_of(model)
    with pytest.warns(UserWarning, match="ParamState 'scale' get no gradient"):
        reference = eqx.filter_grad(lambda m, x: es.run(_loss, values, m, x)[1])(
            model, x
        )
    assert tree_allclose(grads, reference)


class _Frozen(eqx.Module):
    linear: eqx.nn.Linear
    stats: es.LongTermState
    unused: es.ParamState

    def __call__(self, x):
        return self.linear(x) * self.stats.value


@pytest.mark.parametrize("grad_states", [None, es.ParamState])
def test_grad_of_a_model_warns_once_when_its_param_states_get_no_gradient(
    getkey, grad_states
):
    model = Mixed(getkey())
    grad = es.transform.grad(_loss, argnums=0, grad_states=grad_states)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grad(model, jnp.ones(3))
        grad(model, jnp.ones(3))
    messages = [str(w.message) for w in caught]
    if grad_states is None:
        assert len(messages) == 1
        assert (
            "'scale'" in messages[0] and "grad_states=eqstate.ParamState" in messages[0]
        )
    else:
        assert messages == []


def test_grad_of_a_model_using_no_param_state_does_not_warn(getkey):
    # Running statistics (a LongTermState) and an unused ParamState: nothing lost.
    model = _Frozen(
        eqx.nn.Linear(3, 3, key=getkey()),
        es.LongTermState(jnp.ones(3)),
        es.ParamState(jnp.ones(3)),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grads = es.transform.grad(lambda m, x: m(x).sum())(model, jnp.ones(3))
    assert grads.stats is None and grads.unused is None


def test_vjp_and_jvp_of_a_model(getkey):
    model = Mixed(getkey())
    x = jnp.ones(3)
    out, vjp_fn = es.transform.vjp(lambda m: m(x), model)
    (ct,) = vjp_fn(jnp.ones(3))
    scale = model.scale.value
    ref_w = jax.grad(lambda w: jnp.sum(_pure(w, model.linear.bias, scale, x)))(
        model.linear.weight
    )
    assert tree_allclose(ct.linear.weight, ref_w) and ct.scale is None
    # Tangents for the floating-point arrays only, as for `eqx.filter_jvp`.
    tangent = jax.tree.map(jnp.ones_like, eqx.filter(model, eqx.is_inexact_array))
    tangent = eqx.combine(tangent, eqx.filter(model, eqx.is_array, inverse=True))
    _, t_out = es.transform.jvp(lambda m: m(x), (model,), (tangent,))
    ref = jax.jvp(
        lambda w, b: _pure(w, b, scale, x),
        (model.linear.weight, model.linear.bias),
        (jnp.ones((3, 3)), jnp.ones(3)),
    )[1]
    assert tree_allclose(t_out, ref)


def test_vmap_with_a_model_argument(getkey):
    model = Mixed(getkey())
    xs = jr.normal(getkey(), (4, 3))
    ys = es.transform.vmap(lambda m, x: m.linear(x) * m.scale.value, in_axes=(None, 0))(
        model, xs
    )
    ref = jax.vmap(
        lambda x: _pure(model.linear.weight, model.linear.bias, model.scale.value, x)
    )(xs)
    assert tree_allclose(ys, ref)


def test_scan_with_a_model_in_the_carry_and_in_xs(getkey):
    model = Mixed(getkey())
    xs = jr.normal(getkey(), (5, 3))

    def body(m, x):
        return m, _loss(m, x)

    final, losses = es.transform.scan(body, model, xs)
    assert final.scale is model.scale and model.calls.value == 5
    ref = jax.vmap(
        lambda x: _pure_loss(
            model.linear.weight, model.linear.bias, model.scale.value, x
        )
    )(xs)
    assert tree_allclose(losses, ref, rtol=1e-5)
    # A handle in `xs` is not sliced: every iteration sees it.
    total, _ = es.transform.scan(
        lambda c, x: (c + x[1].value.sum() * x[0], None),
        0.0,
        (jnp.ones(4), model.scale),
    )
    assert total == 4 * model.scale.value.sum()


def test_loops_and_conditionals_take_a_model_operand(getkey):
    model = Mixed(getkey())
    x = jnp.ones(3)
    expected = _pure_loss(model.linear.weight, model.linear.bias, model.scale.value, x)
    assert es.transform.cond(True, _loss, lambda m, x: 0.0, model, x) == expected
    assert es.transform.switch(0, [_loss, lambda m, x: 0.0], model, x) == expected
    m, n = es.transform.while_loop(
        lambda c: c[1] < 3, lambda c: (c[0], c[1] + 1 + 0 * _loss(c[0], x)), (model, 0)
    )
    assert m.scale is model.scale and n == 3
    assert es.transform.checkpoint(_loss)(model, x) == expected
    assert es.transform.eval_shape(_loss, model, x).shape == ()


def test_vmap_new_states_and_shard_map_take_a_model_argument(getkey):
    model = Mixed(getkey())
    ensemble = es.transform.vmap_new_states(
        lambda m: es.ParamState(m.scale.value * es.random.normal(())),
        axis_size=3,
        in_axes=None,
    )(model)
    assert ensemble.value.shape == (3, 3)
    mesh = jax.make_mesh((len(jax.devices()),), ("x",), axis_types=(AxisType.Auto,))
    out = es.transform.shard_map(
        lambda m, x: m.linear(x) * m.scale.value,
        mesh=mesh,
        in_specs=(P(), P()),
        out_specs=P(),
    )(model, jnp.ones(3))
    assert tree_allclose(
        out,
        _pure(model.linear.weight, model.linear.bias, model.scale.value, jnp.ones(3)),
    )


@pytest.mark.numpy_promotion("optax.adam: a Python float to an int32 power")
def test_one_optimiser_trains_arrays_and_parameter_states(getkey):
    model = Mixed(getkey())
    x, y = jr.normal(getkey(), (3,)), jr.normal(getkey(), (3,))
    optimizer = optax.adam(0.1)
    opt_state = es.LongTermState(optimizer.init(es.trainable(model)))

    def loss(m, x, y):
        return jnp.sum((m(x) - y) ** 2)

    @es.transform.jit
    def train_step(m, x, y):
        grads, value = es.transform.grad(
            loss, grad_states=es.ParamState, argnums=0, return_value=True
        )(m, x, y)
        updates, opt_state.value = optimizer.update(
            grads, opt_state.value, es.trainable(m)
        )
        return es.apply_updates(m, updates), value

    # The same update by hand, in pure JAX.
    params = (model.linear.weight, model.linear.bias, model.scale.value)
    ref_state = optimizer.init(params)

    def pure_loss(p):
        return jnp.sum((_pure(*p, x) - y) ** 2)

    first = None
    for _ in range(20):
        model, value = train_step(model, x, y)
        grads = jax.grad(pure_loss)(params)
        updates, ref_state = optimizer.update(grads, ref_state, params)
        params = optax.apply_updates(params, updates)
        first = value if first is None else first
    assert value < first
    assert tree_allclose(model.linear.weight, params[0], rtol=1e-4, atol=1e-5)
    assert tree_allclose(model.scale.value, params[2], rtol=1e-4, atol=1e-5)


_GLOBAL_MODEL: Any = None
_TRAINER: Any = None


class _Trainer:
    """brainstate's style: a plain object holding the model."""

    def __init__(self, model):
        self.model = model

    def loss(self, x):
        return _loss(self.model, x)


class _Caller(eqx.Module):
    model: Mixed

    def __call__(self, x):
        return _loss(self.model, x)


def _global_loss(x):
    return _loss(_GLOBAL_MODEL, x)


def _global_trainer_loss(x):
    return _TRAINER.loss(x)


def _how_reached(how: str, model: Mixed) -> tuple[Callable, tuple, str]:
    """A loss reaching `model` without differentiating it, the extra arguments it
    takes besides `x`, and the name the warning gives the model."""
    return {
        "closure": (lambda x: _loss(model, x), (), "model"),
        "global": (_global_loss, (), "_GLOBAL_MODEL"),
        "method of a plain object": (_Trainer(model).loss, (), "self.model"),
        "attribute of a global": (_global_trainer_loss, (), "_TRAINER.model"),
        "module called": (_Caller(model), (), "fun.model"),
        "partial": (ft.partial(_loss, model), (), "fun(...)"),
        "argument outside argnums": (lambda x, m: _loss(m, x), (model,), "args[1]"),
    }[how]


@pytest.mark.parametrize("in_jit", (False, True))
@pytest.mark.parametrize(
    "how",
    [
        "closure",
        "global",
        "method of a plain object",
        "attribute of a global",
        "module called",
        "partial",
        "argument outside argnums",
    ],
)
def test_grad_of_states_alone_warns_naming_the_model_arrays_left_untrained(
    getkey, monkeypatch, how, in_jit
):
    model = Mixed(getkey())
    monkeypatch.setattr(f"{__name__}._GLOBAL_MODEL", model)
    monkeypatch.setattr(f"{__name__}._TRAINER", _Trainer(model))
    loss, extra, name = _how_reached(how, model)
    grad = es.transform.grad(loss, grad_states=es.ParamState)
    call = es.transform.jit(grad) if in_jit else grad
    weight = re.escape(f"`{name}.linear.weight`, `{name}.linear.bias`")
    with pytest.warns(UserWarning, match=f"arrays get no gradient .*: {weight}"):
        grads = call(jnp.ones(3), *extra)
    assert grads.states == (model.scale,)


def test_grad_of_states_alone_warns_about_a_traced_model_closed_over(getkey):
    # The model-in style of a jitted step, with the loss closing over the model.
    @es.transform.jit
    def step(m, x):
        return es.transform.grad(lambda x: _loss(m, x), grad_states=es.ParamState)(x)

    with pytest.warns(UserWarning, match="no gradient .*: `m.linear.weight`"):
        step(Mixed(getkey()), jnp.ones(3))


def test_grad_of_states_alone_names_only_the_arrays_the_function_uses(getkey):
    class Two(eqx.Module):
        used: Mixed
        frozen: eqx.nn.Linear

    model = Two(Mixed(getkey()), eqx.nn.Linear(3, 3, key=getkey()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        es.transform.grad(lambda x: _loss(model.used, x), grad_states=es.ParamState)(
            jnp.ones(3)
        )
    [message] = [str(w.message) for w in caught]
    assert "`model.used.linear.weight`" in message and "frozen" not in message


def test_grad_of_a_model_and_its_states_does_not_warn_and_matches_jax(getkey):
    model = Mixed(getkey())
    x = jr.normal(getkey(), (3,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grads = es.transform.grad(_loss, grad_states=es.ParamState, argnums=0)(model, x)
        # A frozen teacher: none of its values differentiated, nothing to warn about.
        teacher = Mixed(getkey())
        es.transform.grad(
            lambda m, x: _loss(m, x) + _loss(teacher, x),
            grad_states=es.trainable(model)[0],
            argnums=0,
            check_states=False,
        )(model, x)
    expected = jax.grad(_pure_loss, argnums=(0, 1, 2))(
        model.linear.weight, model.linear.bias, model.scale.value, x
    )
    got = (grads[1].linear.weight, grads[1].linear.bias, grads[0][model.scale])
    assert tree_allclose(got, expected)


class _Scaled(eqx.Module):
    """`Mixed` without its counter, which a raw transform could not write."""

    linear: eqx.nn.Linear
    scale: es.ParamState

    def __init__(self, key):
        self.linear = eqx.nn.Linear(3, 3, key=key)
        self.scale = es.ParamState(jnp.arange(1.0, 4.0), name="scale")

    def __call__(self, x):
        return self.linear(x) * self.scale.value


@pytest.mark.parametrize("where", ("eager", "in jit", "in a scope"))
@pytest.mark.parametrize(
    "transform",
    (
        eqx.filter_grad,
        eqx.filter_value_and_grad,
        lambda f: ft.partial(eqx.filter_vjp, f),
    ),
)
def test_a_param_state_read_inside_a_raw_differentiation_warns(
    getkey, where, transform
):
    model = _Scaled(getkey())
    differentiated = transform(lambda m: _loss(m, jnp.ones(3)))
    match = (
        r"ParamState 'scale' \(f32\[3\]\) is read inside a JAX differentiation .* no "
        r"gradient.*argnums=0, grad_states=eqstate.ParamState"
    )
    with pytest.warns(UserWarning, match=match):
        if where == "in jit":
            es.transform.jit(lambda m: differentiated(m) and None)(model)
        elif where == "in a scope":
            with es.scope(es.values_of(model)):
                differentiated(model)
        else:
            differentiated(model)


def test_other_states_read_inside_a_raw_differentiation_do_not_warn(getkey):
    model = _Frozen(
        eqx.nn.Linear(3, 3, key=getkey()),
        es.LongTermState(jnp.ones(3)),
        es.ParamState(jnp.ones(3)),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grads = eqx.filter_grad(lambda m, x: m(x).sum())(model, jnp.ones(3))
        # Read by eqstate's own transform, or through values passed in: no warning.
        es.transform.grad(lambda m: m.unused.value.sum(), argnums=0)
        es.transform.grad(
            lambda: model.unused.value.sum(), grad_states=[model.unused]
        )()
    assert grads.linear.weight is not None


def test_raw_grad_of_run_warns_naming_what_of_the_model_it_leaves_out(getkey):
    model, x = _Scaled(getkey()), jnp.ones(3)
    values = es.values_of(model)

    def loss(model, states):
        return es.run(_loss, states, model, x)[1]

    match = r"`eqstate.run` is differentiated .*: `args\[0\].linear.weight`"
    with pytest.warns(UserWarning, match=match):
        jax.grad(lambda states: loss(model, states))(values)
    with pytest.warns(UserWarning, match="only: ParamState 'scale' get no gradient"):
        eqx.filter_grad(lambda m: loss(m, values))(model)
    # Both differentiated: no warning, and JAX's gradients of the pure function.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model_grads, state_grads = eqx.filter_grad(lambda p: loss(*p))((model, values))
    expected = jax.grad(_pure_loss, argnums=(0, 1, 2))(
        model.linear.weight, model.linear.bias, model.scale.value, x
    )
    got = (
        model_grads.linear.weight,
        model_grads.linear.bias,
        state_grads[model.scale],
    )
    assert tree_allclose(got, expected)


def test_a_batch_norm_model_passes_through_eqx_and_eqstate_transforms(getkey):
    model = eqx.nn.Sequential([enn.BatchNorm(3), eqx.nn.Lambda(jnp.tanh)])
    xs = jr.normal(getkey(), (8, 3))
    step = es.transform.jit(lambda m, xs: jnp.mean(m(xs)))
    step(model, xs)
    assert not (model.layers[0].running_mean.value == 0).all()


def test_vmap_maps_a_stacked_mixed_model_and_keeps_its_flags_static(getkey):
    class Member(eqx.Module):
        linear: eqx.nn.Linear
        bn: enn.BatchNorm  # holds `inference: bool`, a Python scalar leaf

        def __init__(self, key):
            self.linear = eqx.nn.Linear(2, 3, key=key)
            self.bn = enn.BatchNorm(3)

        def __call__(self, x):
            return self.bn(jax.vmap(self.linear)(x))

    ensemble = es.transform.vmap_new_states(Member, axis_size=4)(jr.split(getkey(), 4))
    xs = jr.normal(getkey(), (5, 2))
    mapped = es.transform.vmap(lambda m: m(xs), in_states={0: es.states_of(ensemble)})
    lanes = mapped(ensemble)
    for i in range(4):
        h = xs @ ensemble.linear.weight[i].T + ensemble.linear.bias[i][None]
        ref = (h - h.mean(0, keepdims=True)) / jnp.sqrt(h.var(0, keepdims=True) + 1e-5)
        assert tree_allclose(lanes[i], ref, rtol=1e-4, atol=1e-5)
    assert ensemble.bn.running_mean.value.shape == (4, 3)
    assert not (ensemble.bn.running_mean.value == 0).any()


@pytest.mark.parametrize("container", ["list", "dict"])
def test_a_list_or_dict_changed_in_place_between_calls_is_seen(container):
    class Model(eqx.Module):
        parts: Any

    a, b = es.State(jnp.array(1.0), name="a"), es.State(jnp.array(10.0), name="b")
    parts = [a] if container == "list" else {"s": a}
    model = Model(parts)
    key = 0 if container == "list" else "s"

    @es.transform.jit
    def read(model, x):
        return model.parts[key].value + x

    assert read(model, 0.0) == 1.0
    assert read(model, 0.0) == 1.0  # the same objects: the split is reused
    parts[key] = b  # the same model and container, another state inside
    assert read(model, 0.0) == 10.0
    if container == "list":
        parts.append(a)  # a longer list: another structure
        assert read(model, 0.0) == 10.0


@pytest.mark.parametrize("container", ["list", "dict"])
def test_a_handle_replaced_by_an_object_claiming_equality_is_seen(container):
    # Lists and dicts of handles are compared with `==`; an object that calls itself
    # equal to anything must still count as a change.
    class EqualToAll:
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = object.__hash__

    class Model(eqx.Module):
        parts: Any

    a, b = es.State(jnp.array(1.0), name="a"), es.State(jnp.array(10.0), name="b")
    parts = [a, b] if container == "list" else {"a": a, "b": b}
    model = Model(parts)
    key = 0 if container == "list" else "a"

    @es.transform.jit
    def total(model):
        items = model.parts if container == "list" else model.parts.values()
        return sum(x.value for x in items if es.is_state(x))

    assert total(model) == 11.0
    parts[key] = EqualToAll()
    assert total(model) == 10.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Config:
    scale: float = dataclasses.field(metadata=dict(static=True))


@pytest.mark.parametrize("container", ["ordered_dict", "defaultdict", "metadata"])
def test_a_node_without_children_changed_in_place_is_seen(container):
    # Empty containers and nodes of metadata only have no leaves, but they are not
    # leaves: an in-place change to one is a new structure.
    class Model(eqx.Module):
        part: Any
        weight: es.ParamState  # a handle: the call is split

    if container == "metadata":
        part: Any = _Config(1.0)
    elif container == "ordered_dict":
        part = collections.OrderedDict()
    else:
        part = collections.defaultdict(list)
    model = Model(part, es.ParamState(jnp.array(2.0), name="weight"))

    @es.transform.jit
    def step(model):
        if container == "metadata":
            return model.weight.value * model.part.scale
        for s in model.part.values():
            s.value = s.value + 1
        return model.weight.value + sum(s.value for s in model.part.values())

    assert step(model) == 2.0
    assert step(model) == 2.0  # the same objects: the split may be reused
    added = es.State(jnp.array(10.0), name="added")
    if container == "metadata":
        part.scale = 10.0
        assert step(model) == 20.0
    else:
        part["a"] = added
        assert step(model) == 13.0
        assert added.value == 11.0


def test_vmap_maps_a_model_passed_by_keyword(getkey):
    # Keyword arguments are mapped along axis 0: their arrays, not their handles.
    class Member(eqx.Module):
        linear: eqx.nn.Linear
        scale: es.ParamState

    keys = jr.split(getkey(), 4)
    linears = eqx.filter_vmap(lambda k: eqx.nn.Linear(3, 2, key=k))(keys)
    model = Member(linears, es.ParamState(jnp.array(2.0), name="scale"))
    xs = jr.normal(getkey(), (4, 3))

    def apply(x, m):
        return m.linear(x) * m.scale.value

    by_keyword = es.transform.vmap(apply)(xs, m=model)
    assert tree_allclose(by_keyword, es.transform.vmap(apply)(xs, model))
    want = jnp.stack(
        [2.0 * (linears.weight[i] @ xs[i] + linears.bias[i]) for i in range(4)]
    )
    assert tree_allclose(by_keyword, want, rtol=1e-5, atol=1e-6)


def test_numpy_scalar_fields_are_arrays_as_in_equinox():
    # `eqx.filter_grad` differentiates a NumPy scalar field and `es.trainable` hands
    # it to the optimiser: eqstate's grad must give its gradient, not `None`.
    class Model(eqx.Module):
        w: jax.Array
        s: np.float32
        p: es.ParamState

    model = Model(jnp.array(2.0), np.float32(3.0), es.ParamState(jnp.array(1.0)))

    def loss(model, x):
        return model.w * model.s * model.p.value * x

    grad = es.transform.grad(loss, grad_states=es.ParamState, argnums=0)
    state_grads, model_grads = grad(model, 1.0)
    assert model_grads.s == 2.0 and model_grads.w == 3.0
    assert state_grads[model.p] == 6.0
    assert es.trainable(model)[1].s == 3.0

    runs = []

    @es.transform.jit
    def scaled(model):
        runs.append(None)
        return model.s * model.p.value

    assert scaled(model) == 3.0
    traced = len(runs)
    assert scaled(eqx.tree_at(lambda m: m.s, model, np.float32(5.0))) == 5.0
    assert len(runs) == traced  # traced, so a new value does not retrace


class _Gate(eqx.Module):
    weight: jax.Array
    on: bool


def test_a_module_flag_after_array_only_calls_stays_a_python_bool(getkey):
    # The first calls pass only arrays, which `jax.jit` takes as they are; a later
    # Module's `bool` field must still be static, not a traced bool.
    count = es.State(jnp.array(0))

    @es.transform.jit
    def scaled(gate, x):
        count.value += 1
        if isinstance(gate, _Gate):
            return x * gate.weight if gate.on is True else x
        return x * gate

    x = jnp.full(3, 2.0)
    assert (scaled(jnp.ones(3), x) == x).all()
    assert (scaled(_Gate(jnp.full(3, 3.0), True), x) == 3 * x).all()
    assert (scaled(_Gate(jnp.full(3, 3.0), False), x) == x).all()
    assert (scaled(jnp.full(3, 5.0), x) == 5 * x).all()
    assert count.value == 4


def test_an_equinox_dropout_after_array_only_calls_is_not_traced(getkey):
    count = es.State(jnp.array(0))
    model = eqx.nn.Sequential(
        [eqx.nn.Linear(3, 3, key=getkey()), eqx.nn.Dropout(0.5, inference=True)]
    )
    runs = []

    @es.transform.jit
    def apply(m, x):
        runs.append(None)
        count.value += 1
        return m(x) if isinstance(m, eqx.Module) else x * m

    x = jr.normal(getkey(), (3,))
    apply(jnp.ones(3), x)
    assert tree_allclose(apply(model, x), model(x))
    traced = len(runs)
    for _ in range(3):  # the split plan is kept: no trace per call
        assert tree_allclose(apply(model, x), model(x))
    assert len(runs) == traced


def test_a_scalar_bool_array_field_is_traced_like_any_array(getkey):
    # `jax.jit` cannot tell it from a Python bool, so it takes the split path, where
    # it is an array: traced, and a new value does not retrace.
    runs = []

    @es.transform.jit
    def pick(gate, x):
        runs.append(None)
        return jnp.where(gate.on, x * gate.weight, x)

    x = jnp.full(3, 2.0)
    on = _Gate(jnp.full(3, 3.0), jnp.array(True))  # pyright: ignore[reportArgumentType]
    off = _Gate(jnp.full(3, 3.0), jnp.array(False))  # pyright: ignore[reportArgumentType]
    assert (pick(on, x) == 3 * x).all()
    traced = len(runs)
    assert (pick(off, x) == x).all()
    assert (pick(on, x) == 3 * x).all()
    assert len(runs) == traced


def test_a_module_int_too_large_for_jax_after_array_only_calls_stays_static():
    # `jax.jit` refuses the int (it overflows int32) where eqstate keeps it static.
    class Config(eqx.Module):
        weight: jax.Array
        seed: int

    count = es.State(jnp.array(0))

    @es.transform.jit
    def shifted(config, x):
        count.value += 1
        if isinstance(config, Config):
            return x * config.weight + config.seed % 7
        return x * config

    x = jnp.full(3, 2.0)
    assert (shifted(jnp.ones(3), x) == x).all()
    big = Config(jnp.full(3, 3.0), 2**40)
    assert (shifted(big, x) == 3 * x + 2**40 % 7).all()
    assert count.value == 2


def test_apply_updates_that_do_not_fit_the_model_change_nothing(getkey):
    class Model(eqx.Module):
        linear: eqx.nn.Linear
        scale: es.ParamState

    model = Model(eqx.nn.Linear(2, 2, key=getkey()), es.ParamState(jnp.ones(2)))
    state_updates = jax.tree.map(jnp.ones_like, es.values_of(model))
    with pytest.raises(ValueError):
        es.apply_updates(model, (state_updates, {"not": "the model's arrays"}))
    assert (model.scale.value == 1).all()
    updated = es.apply_updates(model, (state_updates, None))
    assert (model.scale.value == 2).all() and updated.linear is model.linear


@pytest.mark.parametrize("n_states", [2, 3])
def test_apply_updates_given_a_state_dict_alone_says_to_assign_it(n_states):
    # With two states, unpacking the StateDict gave two handles.
    model = [es.ParamState(jnp.ones(2), name=f"p{i}") for i in range(n_states)]
    updates = jax.tree.map(jnp.ones_like, es.values_of(model, es.ParamState))
    with pytest.raises(
        TypeError,
        match=r"(?s)a pair `\(StateDict, arrays\)`; got a StateDict alone\..*"
        r"eqstate.assign\(optax.apply_updates\(params, updates\)\)",
    ):
        es.apply_updates(model, updates)
    with pytest.raises(TypeError, match="got a pair whose first element is a dict"):
        es.apply_updates(model, ({}, None))
    assert all((p.value == 1).all() for p in model)


class _Masked(eqx.Module):
    """A linear layer, a parameter state of a weight and an integer mask, and an
    integer parameter state."""

    linear: eqx.nn.Linear
    masked: es.ParamState
    bits: es.ParamState

    def __init__(self, key):
        self.linear = eqx.nn.Linear(3, 3, key=key)
        self.masked = es.ParamState(
            {"w": jnp.arange(1.0, 4.0), "mask": jnp.array([1, 0, 1])}
        )
        self.bits = es.ParamState(jnp.array(2))

    def __call__(self, x):
        with jax.numpy_dtype_promotion("standard"):
            value = self.masked.value
            return self.linear(x) * value["w"] * value["mask"] * self.bits.value


@pytest.mark.numpy_promotion("optax.adam: a Python float to an int32 power")
def test_one_optimiser_trains_a_model_with_mixed_and_integer_parameter_states(getkey):
    model = _Masked(getkey())
    x, y = jr.normal(getkey(), (3,)), jr.normal(getkey(), (3,))
    mask, bits = model.masked.value["mask"], model.bits.value

    def loss(m, x, y):
        return jnp.sum((m(x) - y) ** 2)

    grads = es.transform.grad(loss, grad_states=es.ParamState, argnums=0)(model, x, y)
    params = es.trainable(model)
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert (
        params[0].states == (model.masked,) and params[0][model.masked]["mask"] is None
    )

    optimizer = optax.adam(0.1)
    opt_state = optimizer.init(params)
    ref_params = (model.linear.weight, model.linear.bias, model.masked.value["w"])
    ref_state = optimizer.init(ref_params)

    def pure_loss(p):
        with jax.numpy_dtype_promotion("standard"):
            return jnp.sum(((p[0] @ x + p[1]) * p[2] * mask * bits - y) ** 2)

    for _ in range(5):
        grads = es.transform.grad(loss, grad_states=es.ParamState, argnums=0)(
            model, x, y
        )
        updates, opt_state = optimizer.update(grads, opt_state, es.trainable(model))
        model = es.apply_updates(model, updates)
        ref_grads = jax.grad(pure_loss)(ref_params)
        ref_updates, ref_state = optimizer.update(ref_grads, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, ref_updates)
    assert tree_allclose(model.linear.weight, ref_params[0], rtol=1e-4, atol=1e-5)
    assert tree_allclose(model.masked.value["w"], ref_params[2], rtol=1e-4, atol=1e-5)
    assert (model.masked.value["mask"] == mask).all() and model.bits.value == bits


def test_apply_updates_of_another_shape_than_a_state_is_an_error_changing_nothing():
    class Model(eqx.Module):
        v: es.ParamState
        w: es.ParamState

    model = Model(
        es.ParamState(jnp.zeros(2), name="v"),
        es.ParamState(jnp.zeros((1, 3)), name="w"),
    )
    updates = es.StateDict({model.v: jnp.ones(2), model.w: jnp.ones(3)})
    with pytest.raises(
        es.StateValueError, match=r"shape \(3,\) .* ParamState 'w' .*\(1, 3\)"
    ):
        es.apply_updates(model, (updates, None))
    assert (model.v.value == 0).all() and (model.w.value == 0).all()


def test_apply_updates_refuses_a_closed_over_teachers_gradient_changing_nothing():
    # `grad_states=es.ParamState` differentiates every ParamState the loss reads, a
    # frozen teacher's too; a stateless optimiser passes its update through.
    teacher = _Holder(es.ParamState(jnp.array(3.0), name="teacher"))
    student = _Holder(es.ParamState(jnp.array(0.0), name="student"))
    optimizer = optax.sgd(0.1)
    opt_state = optimizer.init(es.trainable(student))

    def loss(model):
        return (model.s.value - teacher.s.value) ** 2

    grads = es.transform.grad(loss, grad_states=es.ParamState, argnums=0)(student)
    updates, _ = optimizer.update(grads, opt_state, es.trainable(student))
    with pytest.raises(
        es.StateValueError, match=r"ParamState 'teacher'.*trainable\(model\)\[0\]"
    ):
        es.apply_updates(student, updates)
    assert student.s.value == 0 and teacher.s.value == 3

    own = es.trainable(student)[0]
    grad = es.transform.grad(loss, grad_states=own, argnums=0, check_states=False)
    grads = grad(student)
    updates, _ = optimizer.update(grads, opt_state, es.trainable(student))
    es.apply_updates(student, updates)
    assert student.s.value == pytest.approx(0.6) and teacher.s.value == 3


@pytest.mark.parametrize(
    "state_dtype, update_dtype", [("bfloat16", "float32"), ("float32", "bfloat16")]
)
def test_apply_updates_casts_a_sum_of_the_same_kind_to_the_state_dtype_as_optax(
    state_dtype, update_dtype
):
    # Also under strict promotion (as the tests run), where optax's sum would not
    # promote: the cast back to the state's dtype is `apply_updates`' rule.
    w = es.ParamState(jnp.linspace(-1, 1, 3, dtype=state_dtype), name="w")
    update = jnp.linspace(0.1, 0.3, 3, dtype=update_dtype)
    with jax.numpy_dtype_promotion("standard"):
        [want] = jax.tree.leaves(optax.apply_updates([w.value], [update]))
    es.apply_updates(w, (es.StateDict({w: update}), None))
    assert w.value.dtype == state_dtype == want.dtype
    assert (w.value == want).all()


@pytest.mark.parametrize(
    "state_dtype, update, fits",
    [
        (jnp.int32, jnp.array([1, -1], jnp.int8), True),
        (jnp.uint8, jnp.array([10, 10], jnp.int32), False),
        (jnp.int32, jnp.array([3_000_000_000, 1], jnp.uint32), False),
        (jnp.bool_, jnp.array([1, 0], jnp.int8), False),
    ],
)
def test_apply_updates_refuses_an_integer_update_that_could_wrap_around(
    state_dtype, update, fits
):
    n = es.ShortTermState(jnp.array([250, 1]).astype(state_dtype), name="n")
    before = n.value
    apply = lambda: es.apply_updates({"n": n}, (es.StateDict({n: update}), None))  # noqa: E731
    if fits:
        apply()
        assert n.value.dtype == state_dtype
        assert (n.value == before + update.astype(state_dtype)).all()
    else:
        with pytest.raises(es.StateValueError, match=r"dtype .* to ShortTermState 'n'"):
            apply()
        assert (n.value == before).all()


class _Holder(eqx.Module):
    s: es.State


@pytest.mark.parametrize("first_four", (True, False))
def test_a_negative_static_position_moves_with_the_number_of_arguments(first_four):
    # `static_argnums=-1` makes `c` dynamic in `f(model, x, c, flag)` and static in
    # `f(model, x, c)`: a split remembered for the one must not serve the other.
    model = _Holder(es.State(jnp.array(1.0), name="s"))
    c = 2.0

    def f(model, x, *rest):
        scale = 100.0 if isinstance(rest[-1], float) else 1.0
        return x * scale * rest[0] + model.s.value

    jf = es.transform.jit(f, static_argnums=-1)
    x = jnp.ones(())
    calls = ((x, c, 7), (x, c)) if first_four else ((x, c), (x, c, 7))
    for args in calls * 2:
        assert jf(model, *args) == f(model, *args)
