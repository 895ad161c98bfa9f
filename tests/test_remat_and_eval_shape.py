import eqstate as es
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest

from .helpers import tree_allclose


pytestmark = pytest.mark.usefixtures("tracing_mode")


@pytest.mark.parametrize(
    "policy",
    [
        None,
        jax.checkpoint_policies.nothing_saveable,
        jax.checkpoint_policies.dots_saveable,
    ],
)
def test_checkpoint_gives_the_same_gradients(getkey, policy):
    w = es.ParamState(jr.normal(getkey(), (4, 4)) * 0.5)
    calls = es.ShortTermState(jnp.array(0))

    def layer(x):
        calls.value = calls.value + 1
        return jnp.tanh(w.value @ x)

    remat_layer = es.transform.checkpoint(layer, policy=policy)
    x = jr.normal(getkey(), (4,))
    plain = es.transform.grad(lambda x: jnp.sum(layer(layer(x))), grad_states=[w])(x)
    remat = es.transform.grad(
        lambda x: jnp.sum(remat_layer(remat_layer(x))), grad_states=[w]
    )(x)
    assert tree_allclose(plain[w], remat[w], atol=1e-5)
    assert calls.value == 4


def test_checkpoint_recomputes_in_the_backward_pass(getkey):
    w = es.ParamState(jnp.ones((3, 3)))
    layer = es.transform.remat(lambda x: jnp.sin(w.value @ x))
    jaxpr = jax.make_jaxpr(
        lambda sd, x: es.run(
            es.transform.grad(lambda x: jnp.sum(layer(x)), grad_states=[w]), sd, x
        )[1]
    )(es.world().filter(w), jnp.ones(3))
    assert "checkpoint" in str(jaxpr) or "remat" in str(jaxpr)


def test_checkpoint_static_argnums_and_decorator():
    @es.transform.checkpoint(static_argnums=1)
    def f(x, n):
        return x * n

    assert f(2.0, 3) == 6.0


def test_checkpoint_keeps_outputs_static_leaves():
    s = es.State(jnp.array(1.0))
    out = es.transform.checkpoint(lambda x: {"y": x * s.value, "tag": "ok"})(2.0)
    assert out["tag"] == "ok" and out["y"] == 2.0


@pytest.mark.parametrize(
    "initial, constant",
    [
        (jnp.float32(0.0), lambda: jnp.float32(5.0)),
        (1.0, lambda: 3.0),
        (jnp.array(False), lambda: True),
        (jnp.array(0, jnp.int8), lambda: 7),
        ({"a": jnp.zeros(2), "n": 0}, lambda: {"a": jnp.ones(2), "n": 7}),
    ],
    ids=["numpy-scalar", "weak-float", "bool", "int8", "dict"],
)
def test_checkpoint_writes_constants_as_an_eager_write_does(initial, constant):
    """Called eagerly, `jax.checkpoint` returns constant outputs as Python or NumPy
    scalars: a state written a constant must still hold arrays, typed as an eager
    write types them."""

    def written_by(transform):
        s = es.State(initial)

        def f(x):
            s.value = constant()
            return x, es.State(constant())

        _, made = transform(f)(1.0)
        return [s.value, made.value]

    eager = written_by(lambda f: f)
    remat = written_by(es.transform.checkpoint)
    for want, got in zip(jax.tree.leaves(eager), jax.tree.leaves(remat)):
        assert isinstance(got, jax.Array)
        assert (got.dtype, got.weak_type) == (want.dtype, want.weak_type)
        assert (got == want).all()


def test_eval_shape_touches_no_value():
    w = es.ParamState(jnp.ones((3, 5)))
    count = es.State(jnp.array(0))

    def f(x):
        count.value = count.value + 1
        return {"y": x @ w.value, "n": count.value}

    out = es.transform.eval_shape(f, jax.ShapeDtypeStruct((2, 3), jnp.float32))
    assert out["y"].shape == (2, 5) and out["n"].dtype == jnp.int32
    assert count.value == 0


def test_eval_shape_of_a_constructor_keeps_handles():
    def ctor():
        return es.ParamState(jnp.zeros(4), name="p")

    out = es.transform.eval_shape(ctor)
    assert isinstance(out, es.ParamState) and out.name == "p"
    # It has shapes only: a read says so, not that it escaped through a side effect.
    with pytest.raises(
        es.TraceContextError, match=r"eval_shape` of `ctor`.*Call `ctor"
    ):
        out.value


class _Out(eqx.Module):
    y: jax.Array
    training: bool
    rate: float


@pytest.mark.parametrize("under_jit", [False, True])
def test_checkpoint_returns_a_modules_python_fields_as_they_are(under_jit):
    # Static, as in every other transform and in `eqx.filter_checkpoint`: not arrays.
    layer = es.transform.checkpoint(lambda x: _Out(x * 2, True, 0.5))

    def pick(x):
        out = layer(x)
        assert out.training is True and type(out.rate) is float
        return out.y

    x = jnp.arange(3.0)
    got = es.transform.jit(pick)(x) if under_jit else pick(x)
    assert (got == 2 * x).all()


def test_grad_aux_returns_a_modules_python_fields_as_they_are():
    w = es.ParamState(jnp.array(2.0))
    grad = es.transform.grad(
        lambda: (w.value**2, _Out(w.value, True, 0.5)), grad_states=[w], has_aux=True
    )
    grads, aux = grad()
    assert grads[w] == 4.0
    assert aux.training is True and type(aux.rate) is float
