import re

import eqstate as es
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

from .helpers import traces_per_key, tree_allclose


_GRAD_FAMILY = (
    es.transform.grad,
    es.transform.value_and_grad,
    es.transform.vector_grad,
    es.transform.jacrev,
    es.transform.jacfwd,
    es.transform.hessian,
)


pytestmark = pytest.mark.usefixtures("tracing_mode")


@pytest.fixture
def linear(getkey):
    w = es.ParamState(jr.normal(getkey(), (3, 2)), name="w")
    b = es.ParamState(jr.normal(getkey(), (2,)), name="b")
    calls = es.ShortTermState(jnp.array(0), name="calls")

    def loss(x):
        calls.value = calls.value + 1
        y = x @ w.value + b.value[None]
        return jnp.sum(y**2), y

    def pure(w, b, x):
        y = x @ w + b[None]
        return jnp.sum(y**2), y

    return loss, pure, w, b, calls


def test_grad_with_respect_to_states_matches_jax(linear, getkey):
    loss, pure, w, b, calls = linear
    x = jr.normal(getkey(), (4, 3))
    grads = es.transform.grad(loss, grad_states=[w, b], has_aux=True)(x)[0]
    ref_w, ref_b = jax.grad(lambda w, b: pure(w, b, x)[0], argnums=(0, 1))(
        w.value, b.value
    )
    assert isinstance(grads, es.StateDict) and grads.states == (w, b)
    assert tree_allclose(grads[w], ref_w) and tree_allclose(grads[b], ref_b)
    assert calls.value == 1


def test_grad_states_as_a_filter(linear, getkey):
    loss, pure, w, b, calls = linear
    x = jr.normal(getkey(), (4, 3))
    grads, _ = es.transform.grad(loss, grad_states=es.ParamState, has_aux=True)(x)
    assert grads.states == (w, b)


def test_grad_with_respect_to_arguments_only(linear, getkey):
    loss, pure, w, b, calls = linear
    x = jr.normal(getkey(), (4, 3))
    gx = es.transform.grad(lambda x: loss(x)[0])(x)
    wv, bv = w.value, b.value
    ref = jax.grad(lambda x: pure(wv, bv, x)[0])(x)
    assert tree_allclose(gx, ref)


@pytest.mark.parametrize("has_aux", [False, True])
@pytest.mark.parametrize("return_value", [False, True])
@pytest.mark.parametrize("argnums", [None, 0, (0,)])
def test_grad_output_layout(linear, getkey, has_aux, return_value, argnums):
    loss, pure, w, b, calls = linear
    x = jr.normal(getkey(), (4, 3))
    f = loss if has_aux else (lambda x: loss(x)[0])
    out = es.transform.grad(
        f, grad_states=[w], argnums=argnums, has_aux=has_aux, return_value=return_value
    )(x)
    bv = b.value
    ref_value, ref_y = pure(w.value, bv, x)
    ref_gw, ref_gx = jax.grad(lambda w, x: pure(w, bv, x)[0], argnums=(0, 1))(
        w.value, x
    )
    parts = list(out) if (has_aux or return_value) else [out]
    grads = parts.pop(0)
    if argnums is None:
        assert tree_allclose(grads[w], ref_gw)
    else:
        state_grads, arg_grads = grads
        assert tree_allclose(state_grads[w], ref_gw)
        assert tree_allclose(arg_grads if argnums == 0 else arg_grads[0], ref_gx)
    if return_value:
        assert tree_allclose(parts.pop(0), ref_value)
    if has_aux:
        assert tree_allclose(parts.pop(0), ref_y)


def test_value_and_grad_follows_jax_layout(linear, getkey):
    loss, pure, w, b, calls = linear
    x = jr.normal(getkey(), (4, 3))
    (value, y), grads = es.transform.value_and_grad(
        loss, grad_states=[w], has_aux=True
    )(x)
    bv = b.value
    ref = jax.value_and_grad(lambda w: pure(w, bv, x), has_aux=True)(w.value)
    assert tree_allclose((value, y), ref[0]) and tree_allclose(grads[w], ref[1])


def test_written_states_are_written_back_with_primal_values():
    running = es.LongTermState(jnp.zeros(2), name="running")
    w = es.ParamState(jnp.ones(2))

    def loss(x):
        running.value = 0.9 * running.value + 0.1 * x
        return jnp.sum(w.value * x)

    es.transform.grad(loss, grad_states=[w])(jnp.full(2, 5.0))
    assert tree_allclose(running.value, jnp.full(2, 0.5))


def test_unused_explicit_grad_state_is_an_error_unless_unchecked(linear):
    loss, _, w, b, calls = linear
    unused = es.ParamState(jnp.ones(2), name="unused")
    with pytest.raises(ValueError, match=r"ParamState 'unused'.* does not use"):
        es.transform.grad(lambda x: loss(x)[0], grad_states=[w, unused])(
            jnp.ones((1, 3))
        )
    grads = es.transform.grad(
        lambda x: loss(x)[0], grad_states=[w, unused], check_states=False
    )(jnp.ones((1, 3)))
    assert (grads[unused] == 0).all()
    assert calls.value == 1


def test_grads_feed_optax(linear, getkey):
    loss, pure, w, b, calls = linear
    # The function's own states: the world may still list dropped ones (on Python
    # 3.13 the states of earlier tests often wait there for the cycle collector).
    params = es.values_of((w, b))
    optimizer = optax.sgd(0.1)
    opt_state = optimizer.init(params)
    x = jr.normal(getkey(), (4, 3))
    grads = es.transform.grad(lambda: loss(x)[0], grad_states=es.ParamState)()
    updates, opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    assert isinstance(new_params, es.StateDict)
    assert tree_allclose(new_params[w], params[w] - 0.1 * grads[w])


def test_jacrev_and_jacfwd_match_jax(getkey):
    w = es.ParamState(jr.normal(getkey(), (3,)))
    f = lambda x: jnp.sin(w.value * x)  # noqa: E731
    x = jr.normal(getkey(), (3,))
    for ours, theirs in [
        (es.transform.jacrev, jax.jacrev),
        (es.transform.jacfwd, jax.jacfwd),
    ]:
        jac = ours(f, grad_states=[w])(x)
        ref = theirs(lambda w: jnp.sin(w * x))(w.value)
        assert tree_allclose(jac[w], ref)
        jx = ours(f)(x)
        wv = w.value
        assert tree_allclose(jx, theirs(lambda x, wv=wv: jnp.sin(wv * x))(x))


@pytest.mark.parametrize("name", ["jacrev", "jacfwd"])
def test_jacobians_of_pytree_outputs_are_laid_out_as_jax_lays_them_out(name, getkey):
    ours, theirs = getattr(es.transform, name), getattr(jax, name)
    w = es.ParamState(jr.normal(getkey(), (3,)))
    a, b = jr.normal(getkey(), (2,)), jr.normal(getkey(), (3,))
    pure = lambda w, a, b: {"x": w * 2 + b, "y": (jnp.sum(w) * a[0], 5 * a)}  # noqa: E731
    f = lambda a, b: pure(w.value, a, b)  # noqa: E731
    # Output structure outermost, inputs inside: tuples of inputs and outputs of the
    # same length would otherwise swap blocks silently.
    jac_args = ours(f, argnums=(0, 1))(a, b)
    assert tree_allclose(jac_args, theirs(pure, argnums=(1, 2))(w.value, a, b))
    jac_w, jac_a = ours(f, grad_states=[w], argnums=0)(a, b)
    by_w = jax.tree.map(lambda sd: sd[w], jac_w, is_leaf=_is_state_dict)
    assert tree_allclose(by_w, theirs(pure, argnums=0)(w.value, a, b))
    assert tree_allclose(jac_a, theirs(pure, argnums=1)(w.value, a, b))


def _is_state_dict(x):
    return isinstance(x, es.StateDict)


def test_hessian_blocks_between_two_inputs_are_not_transposed(getkey):
    a_val, b_val = jr.normal(getkey(), (2,)), jr.normal(getkey(), (3,))
    m = jr.normal(getkey(), (2, 3))
    pure = lambda a, b: a @ m @ b + jnp.sum(a**3)  # noqa: E731
    h = es.transform.hessian(pure, argnums=(0, 1))(a_val, b_val)
    assert tree_allclose(h, jax.hessian(pure, argnums=(0, 1))(a_val, b_val))
    a, b = es.ParamState(a_val), es.ParamState(b_val)
    hs = es.transform.hessian(lambda: pure(a.value, b.value), grad_states=[a, b])()
    assert hs[a][b].shape == (2, 3) and tree_allclose(hs[a][b], m)
    assert tree_allclose(hs[b][a], m.T)


def test_hessian(getkey):
    w = es.ParamState(jr.normal(getkey(), (3,)))
    f = lambda x: jnp.sum(jnp.sin(w.value) * x**2)  # noqa: E731
    x = jr.normal(getkey(), (3,))
    h = es.transform.hessian(f, grad_states=[w])(x)
    assert tree_allclose(
        h[w][w], jax.hessian(lambda w: jnp.sum(jnp.sin(w) * x**2))(w.value)
    )
    hx = es.transform.hessian(f, argnums=0)(x)
    wv = w.value
    assert tree_allclose(hx, jax.hessian(lambda x: jnp.sum(jnp.sin(wv) * x**2))(x))


def test_vjp_matches_jax(getkey):
    w = es.ParamState(jr.normal(getkey(), (3,)))
    x = jr.normal(getkey(), (3,))
    out, vjp_fn = es.transform.vjp(lambda x: w.value * x, x, grad_states=es.ParamState)
    ct = jr.normal(getkey(), (3,))
    state_ct, (x_ct,) = vjp_fn(ct)
    ref_out, ref_vjp = jax.vjp(lambda w, x: w * x, w.value, x)
    ref_w, ref_x = ref_vjp(ct)
    assert tree_allclose(out, ref_out) and tree_allclose(state_ct[w], ref_w)
    assert tree_allclose(x_ct, ref_x)
    out, vjp_fn, aux = es.transform.vjp(lambda x: (x * 2, "aux"), x, has_aux=True)
    assert aux == "aux" and tree_allclose(vjp_fn(ct)[0], 2 * ct)


def test_vjp_returns_state_cotangents_in_the_structure_of_grad_states(getkey):
    w, b = es.ParamState(jr.normal(getkey(), (3,))), es.ParamState(jnp.ones(3))
    x = jr.normal(getkey(), (3,))

    def pure(w, b):
        return jnp.sum(jnp.tanh(w * x + b))

    ref_w, ref_b = jax.grad(pure, argnums=(0, 1))(w.value, b.value)
    loss = lambda: pure(w.value, b.value)  # noqa: E731
    # brainstate's convention: no primals, no `argnums`, the states alone.
    ct_w, ct_b = es.transform.vjp(loss, grad_states=[w, b])[1](1.0)
    assert tree_allclose((ct_w, ct_b), (ref_w, ref_b))
    cts = es.transform.vjp(loss, grad_states={"w": w, "b": b})[1](1.0)
    assert tree_allclose(cts, {"w": ref_w, "b": ref_b})
    assert tree_allclose(es.transform.vjp(loss, grad_states=w)[1](1.0), ref_w)
    by_filter = es.transform.vjp(loss, grad_states=es.ParamState)[1](1.0)
    assert isinstance(by_filter, es.StateDict)
    assert tree_allclose((by_filter[w], by_filter[b]), (ref_w, ref_b))


@pytest.mark.parametrize("with_states", (False, True))
def test_vjp_argnums_picks_the_primals_as_jax_grad_does(getkey, with_states):
    w = es.ParamState(jr.normal(getkey(), (3,)))
    x, y = jr.normal(getkey(), (3,)), jr.normal(getkey(), (3,))

    def pure(w, x, y):
        return jnp.sum(w * x * y**2)

    f = lambda x, y: pure(w.value, x, y)  # noqa: E731
    grad_states = [w] if with_states else None
    ref_w, ref_x, ref_y = jax.grad(pure, argnums=(0, 1, 2))(w.value, x, y)
    for argnums, expected in ((1, ref_y), ((0, 1), (ref_x, ref_y)), ((-1,), (ref_y,))):
        _, vjp_fn = es.transform.vjp(f, x, y, grad_states=grad_states, argnums=argnums)
        got = vjp_fn(1.0)
        if with_states:
            assert tree_allclose(got[0], [ref_w])
            got = got[1]
        assert tree_allclose(got, expected)
    with pytest.raises(TypeError, match="`argnums=2` needs argument 2"):
        es.transform.vjp(f, x, y, argnums=2)


def test_jvp_matches_jax(getkey):
    w = es.ParamState(jr.normal(getkey(), (3,)))
    x, tx, tw = (jr.normal(getkey(), (3,)) for _ in range(3))
    out, tangent = es.transform.jvp(
        lambda x: jnp.sin(w.value * x),
        (x,),
        (tx,),
        state_tangents=es.StateDict({w: tw}),
    )
    ref = jax.jvp(lambda w, x: jnp.sin(w * x), (w.value, x), (tw, tx))
    assert tree_allclose((out, tangent), ref)


@pytest.mark.parametrize("tangents", ((1.0,), (1.0, 2.0, 5.0)))
def test_jvp_needs_one_tangent_per_primal(tangents):
    w = es.ParamState(jnp.array(2.0), name="w")

    def f(x, y):
        return w.value * x * y

    with pytest.raises(TypeError):
        jax.jvp(lambda x, y: 2.0 * x * y, (1.0, 3.0), tangents)
    with pytest.raises(TypeError, match=rf"2 primals but {len(tangents)} tangents"):
        es.transform.jvp(f, (1.0, 3.0), tangents)
    assert w.value == 2.0


def test_a_tangent_for_a_state_jvp_does_not_use_is_an_error_unless_unchecked(getkey):
    w = es.ParamState(jr.normal(getkey(), (3,)), name="w")
    unused = es.ParamState(jnp.ones(3), name="unused")
    x, tx, tw = (jr.normal(getkey(), (3,)) for _ in range(3))
    tangents = es.StateDict({w: tw, unused: jnp.ones(3)})

    def f(x):
        return jnp.sin(w.value * x)

    match = r"`state_tangents` holds ParamState 'unused'.*`check_states=False`"
    with pytest.raises(ValueError, match=match):
        es.transform.jvp(f, (x,), (tx,), state_tangents=tangents)
    out = es.transform.jvp(f, (x,), (tx,), state_tangents=tangents, check_states=False)
    ref = jax.jvp(lambda w, x: jnp.sin(w * x), (w.value, x), (tw, tx))
    assert tree_allclose(out, ref)


def test_jvp_takes_float0_tangents_for_integer_states_and_names_the_state_otherwise(
    getkey,
):
    counts = es.ParamState(jnp.array([1, 2, 3]), name="counts")
    w = es.ParamState(jr.normal(getkey(), (3,)), name="w")
    x, tx, tw = (jr.normal(getkey(), (3,)) for _ in range(3))

    def f(x):
        return w.value * counts.value.astype(x.dtype) * x

    def pure(w, counts, x):
        return w * counts.astype(x.dtype) * x

    for bad in (jnp.ones(3, jnp.int32), jnp.ones(3)):
        with pytest.raises(TypeError, match=r"ParamState 'counts'.*`float0`"):
            es.transform.jvp(
                f, (x,), (tx,), state_tangents=es.StateDict({w: tw, counts: bad})
            )
    zero = np.zeros(3, jax.dtypes.float0)
    out = es.transform.jvp(
        f, (x,), (tx,), state_tangents=es.StateDict({w: tw, counts: zero})
    )
    ref = jax.jvp(pure, (w.value, counts.value, x), (tw, zero, tx))
    assert tree_allclose(out, ref)


def test_nested_grad_of_grad():
    w = es.ParamState(jnp.array(2.0))
    inner = es.transform.grad(lambda x: w.value * x**3)
    second = es.transform.grad(inner)(3.0)
    assert second == pytest.approx(6 * 2.0 * 3.0)


def test_grad_under_jit_and_jit_under_grad(linear, getkey):
    loss, pure, w, b, calls = linear
    x = jr.normal(getkey(), (4, 3))
    step = es.transform.jit(es.transform.grad(lambda x: loss(x)[0], grad_states=[w]))
    g1 = step(x)
    inner = es.transform.jit(lambda x: loss(x)[0])
    g2 = es.transform.grad(inner, grad_states=[w])(x)
    assert tree_allclose(g1[w], g2[w]) and calls.value == 2


def test_failure_inside_grad_keeps_values(linear):
    loss, _, w, b, calls = linear

    def bad(x):
        loss(x)
        raise RuntimeError("nope")

    with pytest.raises(RuntimeError, match="nope"):
        es.transform.grad(bad, grad_states=[w])(jnp.ones((1, 3)))
    assert calls.value == 0


def _aux_of(transform, f):
    if transform == "grad":
        return es.transform.grad(f, has_aux=True)(1.0)[1]
    if transform == "value_and_grad":
        return es.transform.value_and_grad(f, has_aux=True)(1.0)[0][1]
    if transform == "jacrev":
        return es.transform.jacrev(f, has_aux=True)(1.0)[1]
    if transform == "vjp":
        return es.transform.vjp(f, 1.0, has_aux=True)[2]
    return es.transform.jvp(f, (1.0,), (1.0,), has_aux=True)[2]


@pytest.mark.parametrize(
    "transform", ("grad", "value_and_grad", "jacrev", "vjp", "jvp")
)
def test_python_scalars_in_aux_come_back_as_they_are(transform):
    w = es.ParamState(jnp.array(2.0), name="w")
    aux = {"converged": True, "n_steps": 3, "tol": 0.5, "y": jnp.array(1.0)}

    def loss(x):
        return w.value * x, aux

    got = _aux_of(transform, loss)
    assert got["converged"] is True and got["n_steps"] == 3 and got["tol"] == 0.5
    assert type(got["n_steps"]) is int and type(got["tol"]) is float
    ref = jax.grad(lambda x: (2.0 * x, aux), has_aux=True)(1.0)[1]
    assert jax.tree.map(type, got) == jax.tree.map(type, ref)

    @es.transform.jit
    def step(x):
        grad, found = es.transform.grad(loss, has_aux=True)(x)
        return grad if found["converged"] else -grad  # Python control flow on aux

    assert step(1.0) == 2.0


def test_has_aux_needs_a_pair_and_says_so():
    with pytest.raises(TypeError, match=r"has_aux=True`, loss must return a pair"):

        def loss(x):
            return x**2

        es.transform.grad(loss, has_aux=True)(1.0)


@pytest.mark.parametrize(
    "argnums, args, kwargs, match",
    (
        ((0, 3), (1.0,), {}, r"`argnums=\(0, 3\)` needs argument 3, but f was called "),
        (None, (), {}, r"`argnums=0` \(the default without `grad_states`\) needs"),
        (None, (), {"x": 1.0}, r"Keyword arguments \(x\) are not differentiated"),
        (-3, (1.0, 2.0), {}, "`argnums=-3` needs argument -3"),
    ),
)
def test_argnums_errors_speak_of_the_users_argnums(argnums, args, kwargs, match):
    def f(x=1.0, y=2.0):
        return x * y

    with pytest.raises((TypeError, ValueError)) as from_jax:
        jax.grad(f, argnums=0 if argnums is None else argnums)(*args, **kwargs)
    with pytest.raises(type(from_jax.value), match=match):
        es.transform.grad(f, argnums=argnums)(*args, **kwargs)


@pytest.mark.parametrize("transform", _GRAD_FAMILY, ids=lambda t: t.__name__)
@pytest.mark.parametrize("argnums", ((0, 0), (0, -2), (1, 0, 1)))
def test_repeated_argnums_are_rejected_by_name(transform, argnums):
    def f(x, y):
        return x**2 * y

    with pytest.raises(ValueError, match=re.escape(f"`argnums={argnums}` names")):
        transform(f, argnums=argnums)(3.0, 2.0)


@pytest.mark.parametrize("argnums", (-1, (-2, -1), (1, -2)))
def test_negative_argnums_count_from_the_end_as_in_jax(argnums):
    w = es.ParamState(jnp.array(3.0), name="w")

    def f(x, y):
        return w.value * x * y**2

    ours = es.transform.grad(f, argnums=argnums)(2.0, 5.0)
    ref = jax.grad(lambda x, y: 3.0 * x * y**2, argnums=argnums)(2.0, 5.0)
    assert tree_allclose(ours, ref)


@pytest.mark.parametrize("transform", _GRAD_FAMILY, ids=lambda t: t.__name__)
def test_decorator_and_keyword_forms_match_the_direct_call(transform, getkey):
    w = es.ParamState(jr.normal(getkey(), (2,)), name="w")
    x = jr.normal(getkey(), (2,))

    def loss(x):
        return jnp.sum(jnp.sin(w.value * x))

    direct = transform(loss, grad_states=[w], argnums=0)(x)
    decorated = transform(grad_states=[w], argnums=0)(loss)(x)
    keyword = transform(fun=loss, grad_states=[w], argnums=0)(x)
    assert tree_allclose(decorated, direct) and tree_allclose(keyword, direct)


class _TwoHeads(eqx.Module):
    linear: eqx.nn.Linear
    head_a: es.ParamState
    head_b: es.ParamState

    def __init__(self, key):
        self.linear = eqx.nn.Linear(2, 2, key=key)
        self.head_a = es.ParamState(jnp.ones(2), name="head_a")
        self.head_b = es.ParamState(jnp.ones(2), name="head_b")


def test_a_filter_gives_unused_states_of_a_model_argument_zero_gradients(getkey):
    model = _TwoHeads(getkey())
    x = jnp.array([1.0, -1.0])
    loss = lambda m: (m.linear(x) @ m.head_a.value) ** 2  # noqa: E731
    grad = es.transform.grad(loss, argnums=0, grad_states=es.ParamState)
    state_grads, arg_grads = grad(model)
    params = es.trainable(model)
    assert jax.tree.structure((state_grads, arg_grads)) == jax.tree.structure(params)
    assert (state_grads[model.head_b] == 0).all()
    h = model.linear(x)
    assert tree_allclose(state_grads[model.head_a], 2 * (h @ model.head_a.value) * h)
    # One optax optimiser takes both, as the how-to promises (Adam's bias correction
    # needs JAX's standard promotion; the suite also runs under strict promotion).
    optimizer = optax.adam(0.1)
    with jax.numpy_dtype_promotion("standard"):
        optimizer.update((state_grads, arg_grads), optimizer.init(params), params)


def test_a_filter_gives_unused_states_zero_gradients_under_vmap(getkey):
    model = {
        "a": es.ParamState(jr.normal(getkey(), (3, 2)), name="a"),
        "unused": es.ParamState(jnp.ones((3, 4)), name="unused"),
    }
    x = jnp.array([1.0, 2.0])
    loss = lambda m, x: jnp.sum(m["a"].value * x)  # noqa: E731
    grad = es.transform.grad(loss, argnums=0, grad_states=es.ParamState)
    per_member = es.transform.vmap(
        grad, in_axes=(None, None), in_states={0: es.ParamState}
    )
    grads = per_member(model, x)
    assert jax.tree.structure(grads) == jax.tree.structure(es.trainable(model))
    assert (grads[0][model["unused"]] == 0).all()
    assert tree_allclose(grads[0][model["a"]], jnp.broadcast_to(x, (3, 2)))


def _steps(x, n):
    for _ in range(n):  # needs a concrete `n`, as jax.grad passes it
        x = jnp.sin(x)
    return x


@pytest.mark.parametrize(
    "call",
    [
        lambda x, n: es.transform.grad(_steps)(x, n),
        lambda x, n: es.transform.grad(_steps, argnums=0)(x, n=n),
        lambda x, n: es.transform.jit(
            lambda x, n: es.transform.grad(_steps)(x, n), static_argnums=1
        )(x, n),
        lambda x, n: es.transform.grad(
            es.transform.checkpoint(_steps, static_argnums=(1,))
        )(x, n),
        lambda x, n: es.transform.value_and_grad(_steps)(x, n)[1],
        lambda x, n: es.transform.jacrev(_steps)(x, n),
    ],
    ids=[
        "grad",
        "keyword",
        "jit-static",
        "checkpoint-static",
        "value_and_grad",
        "jacrev",
    ],
)
def test_python_scalars_outside_argnums_reach_the_function_as_they_are(call):
    expected = jax.grad(_steps)(1.0, 3)
    assert tree_allclose(call(1.0, 3), expected)
    assert not tree_allclose(call(1.0, 2), expected)  # another value, another trace


def _surrogate_spike(threshold):
    @jax.custom_jvp
    def spike(x):
        return (x > threshold.value).astype(x.dtype)

    @spike.defjvp
    def spike_jvp(primals, tangents):
        (x,), (dx,) = primals, tangents
        slope = 1 / (1 + jnp.abs(x - threshold.value)) ** 2  # reads the state too
        return spike(x), slope * dx

    return spike


def _expected_surrogate(x, threshold):
    return 1 / (1 + jnp.abs(x - threshold)) ** 2


@pytest.mark.parametrize(
    "differentiate",
    (
        es.transform.grad,
        lambda f: es.transform.jit(es.transform.grad(f)),
        es.transform.jacfwd,
    ),
)
def test_a_custom_rule_reading_a_state_an_inner_vmap_maps_is_an_error(
    getkey, differentiate
):
    threshold = es.ParamState(jnp.array([0.1, 0.3, 0.45]), name="threshold")
    spike = _surrogate_spike(threshold)
    x = jr.normal(getkey(), (3, 3))
    # One threshold per member: a rule run from outside the vmap cannot see its own.
    per_member = es.transform.vmap(
        lambda x: spike(x).sum(), in_axes=0, in_states={0: threshold}
    )
    with pytest.raises(es.TraceContextError, match=r"'threshold' .*vmap.* maps it"):
        differentiate(lambda x: per_member(x).sum())(x)
    inside = es.transform.vmap(
        es.transform.grad(lambda x: spike(x).sum()), in_axes=0, in_states={0: threshold}
    )(x)
    assert tree_allclose(inside, _expected_surrogate(x, threshold.value[:, None]))
    # A state the vmap shares between members is read as it is.
    shared = es.transform.vmap(lambda x: spike(x).sum(), in_axes=0)
    got = differentiate(lambda x: shared(x).sum())(x)
    assert tree_allclose(got, _expected_surrogate(x, threshold.value[None]))


@pytest.mark.parametrize(
    "differentiate",
    [
        lambda f: es.transform.grad(f),
        lambda f: jax.grad(es.transform.StatefulFunction(f)),
        lambda f: es.transform.jit(es.transform.grad(f)),
        lambda f: es.transform.grad(lambda x: es.transform.checkpoint(f)(x)),
    ],
    ids=["grad", "jax.grad-of-stateful-function", "jit-of-grad", "grad-of-checkpoint"],
)
def test_custom_rules_read_the_states_the_function_reads(differentiate):
    threshold = es.ParamState(jnp.array(0.3), name="threshold")
    spike = _surrogate_spike(threshold)
    got = differentiate(spike)(0.5)
    assert tree_allclose(got, _expected_surrogate(0.5, 0.3))
    threshold.value = jnp.array(0.1)  # a later call reads the new value
    assert tree_allclose(differentiate(spike)(0.5), _expected_surrogate(0.5, 0.1))


@pytest.mark.parametrize(
    "differentiate",
    [
        jax.grad,
        lambda f: es.transform.grad(f),
        lambda f: es.transform.jit(es.transform.grad(f)),
    ],
    ids=["jax.grad", "grad", "jit-of-grad"],
)
def test_custom_rules_of_a_kept_function_read_the_current_values(differentiate):
    threshold = es.ParamState(jnp.array(0.3), name="threshold")
    # One function, differentiated again and again: a rule never sees a value
    # left from an earlier call (JAX keeps what a rule computed).
    differentiated = differentiate(
        es.transform.StatefulFunction(_surrogate_spike(threshold))
    )
    for value in (0.3, 0.1, 0.2):
        threshold.value = jnp.array(value)
        assert tree_allclose(differentiated(0.5), _expected_surrogate(0.5, value))
        assert tree_allclose(
            differentiated(jnp.float32(0.5)), _expected_surrogate(0.5, value)
        )


def test_a_custom_vjp_rule_reads_the_states_the_function_reads():
    scale = es.ParamState(jnp.array(3.0), name="scale")

    @jax.custom_vjp
    def clipped(x):
        return x * scale.value

    clipped.defvjp(
        lambda x: (clipped(x), None),
        lambda _, g: (jnp.clip(g * scale.value, -1.0, 1.0),),
    )
    assert es.transform.grad(clipped)(2.0) == 1.0
    scale.value = jnp.array(0.5)
    assert es.transform.grad(clipped)(2.0) == 0.5


@pytest.mark.parametrize(
    "differentiate",
    [
        lambda f, x: es.transform.grad(f)(x),
        lambda f, x: es.transform.vjp(f, x)[1](1.0)[0],
    ],
    ids=["grad", "vjp"],
)
def test_a_custom_vjp_backward_rule_reads_the_values_of_the_forward_pass(
    differentiate,
):
    scale = es.ParamState(jnp.array(3.0), name="scale")

    @jax.custom_vjp
    def straight_through(x):
        return x

    straight_through.defvjp(lambda x: (x, None), lambda _, g: (g * scale.value,))

    def reads(x):
        return straight_through(x) * scale.value

    assert differentiate(reads, 2.0) == 9.0

    def writes_first(x):
        scale.value = scale.value * 2.0
        return straight_through(x)

    with pytest.raises(es.TraceContextError, match="custom differentiation rule"):
        differentiate(writes_first, 2.0)


def test_an_eager_raw_pullback_runs_its_backward_rule_when_called_unlike_eqstates():
    # As `docs/concepts.md` says: under a raw `jax.vjp` called eagerly, a rule is
    # eager code, run when the pullback is, so it reads the values states hold then.
    # `es.transform.vjp` keeps the forward pass's.
    scale = es.State(jnp.array(2.0), name="scale")

    @jax.custom_vjp
    def times_scale(x):
        return x * scale.value

    times_scale.defvjp(
        lambda x: (x * scale.value, None), lambda _, g: (g * scale.value,)
    )
    with es.scope(es.StateDict({scale: jnp.array(5.0)})):
        out, raw_pullback = jax.vjp(times_scale, 3.0)
        out_eqstate, eqstate_pullback = es.transform.vjp(times_scale, 3.0)
    assert out == out_eqstate == 15.0
    assert eqstate_pullback(1.0)[0] == 5.0
    assert raw_pullback(1.0)[0] == 2.0  # the world's value, after the scope


def _surrogate_reading(threshold):
    @jax.custom_vjp
    def surrogate(x):
        return jnp.sign(x)

    surrogate.defvjp(
        lambda x: (jnp.sign(x), x),
        lambda x, g: (g * threshold.value / (1 + jnp.abs(x)),),
    )
    return surrogate


@pytest.mark.upstream_leak(
    reason="JAX keeps the tracer the rule closed over in the jaxpr it cannot compile"
)
@pytest.mark.parametrize("loop", ["scan", "for_loop", "nested jit"])
def test_a_backward_rule_reading_a_state_in_a_loop_under_jit_says_what_to_do(loop):
    # JAX traces the loop's backward pass apart, and cannot compile the traced value
    # the rule closes over ("No constant handler"): outside `jit`, the value is an
    # array, and the same loss differentiates.
    threshold = es.State(jnp.array(3.0), name="threshold")
    w = es.ParamState(jnp.array(0.5), name="w")
    surrogate = _surrogate_reading(threshold)
    xs = jnp.arange(1.0, 4.0)
    body = {
        "scan": lambda: es.transform.scan(
            lambda c, x: (c, surrogate(w.value * x)), None, xs
        )[1],
        "for_loop": lambda: es.transform.for_loop(lambda x: surrogate(w.value * x), xs),
        "nested jit": es.transform.jit(lambda: surrogate(w.value * xs)),
    }[loop]

    def loss():
        return body().sum() + 0 * threshold.value

    want = jnp.sum(3.0 * xs / (1 + 0.5 * xs))
    grads = es.transform.grad(loss, grad_states=[w])
    assert tree_allclose(grads()[w], want)
    try:
        got = es.transform.jit(grads)()
    except es.TraceContextError as error:
        assert re.search(r"(?s)custom_vjp.*state's value .* as an argument", str(error))
    else:  # The two-pass fallback traces a nested `jit` where the rule can read.
        assert tree_allclose(got[w], want)
    assert w.value == 0.5 and threshold.value == 3.0


def test_a_custom_rule_reading_a_written_state_or_writing_one_says_what_to_do():
    threshold = es.ParamState(jnp.array(0.3), name="threshold")
    spike = _surrogate_spike(threshold)

    def moves_the_threshold(x):
        threshold.value = threshold.value + 0.1
        return spike(x)

    with pytest.raises(es.TraceContextError, match="custom differentiation rule"):
        es.transform.grad(moves_the_threshold)(0.5)
    assert threshold.value == 0.3

    count = es.State(jnp.array(0), name="count")

    @jax.custom_jvp
    def counted(x):
        return x

    @counted.defjvp
    def counted_jvp(primals, tangents):
        count.value = jnp.array(1)
        return primals[0], tangents[0]

    with pytest.raises(es.TraceContextError, match="Cannot write State 'count'"):
        es.transform.grad(counted)(0.5)


def test_a_filter_leaves_out_unused_integer_and_key_states_of_a_model(getkey):
    model = {
        "w": es.ParamState(jnp.ones(2), name="w"),
        "step": es.State(jnp.array(0), name="step"),
        "rng": es.RandomState(0),
        "unused": es.ParamState(jnp.ones(3), name="unused"),
    }
    loss = lambda m: jnp.sum(m["w"].value ** 2)  # noqa: E731
    grads, _ = es.transform.grad(loss, argnums=0, grad_states=es.State)(model)
    assert set(grads.states) == {model["w"], model["unused"]}
    assert (grads[model["unused"]] == 0).all()


@pytest.mark.parametrize(
    "transform", (es.transform.grad, es.transform.jacrev, es.transform.jacfwd)
)
def test_a_filter_leaves_out_used_integer_and_key_states(transform):
    w = es.ParamState(jnp.array([1.0, 2.0]), name="w")
    step = es.State(jnp.array(0), name="step")
    rng = es.RandomState(0)

    def loss(x):
        step.value = step.value + 1
        return jnp.sum(w.value**2) * x + 0 * jax.random.normal(rng.value)

    grads = transform(loss, grad_states=es.State)(1.0)
    assert grads.states == (w,)
    assert tree_allclose(grads[w], jax.grad(lambda w: jnp.sum(w**2))(w.value))
    assert step.value == 1


@pytest.mark.parametrize(
    "transform, hint",
    (
        (es.transform.grad, "or pass `allow_int=True`"),
        (es.transform.jacrev, "or pass `allow_int=True`"),
        (es.transform.jacfwd, r"Remove it from `grad_states`\.$"),
        (es.transform.vector_grad, r"Remove it from `grad_states`\.$"),
    ),
)
def test_an_integer_or_key_state_named_in_grad_states_is_an_error_naming_it(
    transform, hint
):
    step = es.State(jnp.array(0), name="step")
    rng = es.RandomState(0, name="rng")

    def loss(x):
        step.value = step.value + 1
        return x + 0 * jax.random.normal(rng.value)

    with pytest.raises(TypeError):
        jax.grad(lambda n: n * 1.0)(jnp.array(0))
    for state in (step, rng):
        with pytest.raises(TypeError, match=rf"names {type(state).__name__} '.*{hint}"):
            transform(loss, grad_states=[state])(1.0)
    assert step.value == 0
    ints = es.transform.grad(loss, grad_states=[step, rng], allow_int=True)(1.0)
    assert ints[step].dtype == jax.dtypes.float0


def test_a_function_whose_custom_rules_read_no_state_is_traced_once():
    scale = es.ParamState(jnp.array(2.0), name="scale")
    runs = []

    @jax.custom_jvp
    def clipped(x):
        return jnp.clip(x, -1.0, 1.0)

    clipped.defjvp(lambda p, t: (clipped(p[0]), t[0]))  # straight-through

    def f(x):
        runs.append(None)
        return clipped(x) * scale.value

    sf = es.transform.StatefulFunction(f)
    for _ in range(3):
        assert sf(0.5) == 1.0 and jax.grad(sf)(0.5) == 2.0
    assert len(runs) == traces_per_key()


@pytest.mark.parametrize("transform", _GRAD_FAMILY[:5], ids=lambda t: t.__name__)
@pytest.mark.parametrize("spec", ("filter", "handle"))
def test_a_mixed_state_gets_gradients_for_its_float_leaves_and_none_for_the_others(
    transform, spec, getkey
):
    w, x = jr.normal(getkey(), (3,)), jr.normal(getkey(), (3,))
    mask = jnp.array([1, 0, 1])
    p = es.ParamState({"w": w, "mask": mask}, name="p")

    def loss(x):
        with jax.numpy_dtype_promotion("standard"):
            return jnp.sum(jnp.sin(p.value["w"] * p.value["mask"] * x))

    def pure(w, x):
        with jax.numpy_dtype_promotion("standard"):
            return jnp.sum(jnp.sin(w * mask * x))

    grad_states = es.ParamState if spec == "filter" else [p]
    grads = transform(loss, grad_states=grad_states)(x)
    if transform is es.transform.value_and_grad:
        grads = grads[1]
    assert grads.states == (p,) and grads[p]["mask"] is None
    assert tree_allclose(grads[p]["w"], jax.grad(pure)(w, x))
    assert (p.value["mask"] == mask).all()


@pytest.mark.parametrize("spec", ("filter", "handle"))
def test_vjp_of_a_mixed_state_gives_none_at_its_integer_leaves_as_grad_does(
    spec, getkey
):
    w, x = jr.normal(getkey(), (3,)), jr.normal(getkey(), (3,))
    mask = jnp.array([1, 0, 1])
    p = es.ParamState({"w": w, "mask": mask}, name="p")
    count = es.State(jnp.array(0), name="count")

    def f(x):
        count.value = count.value + 1
        with jax.numpy_dtype_promotion("standard"):
            return jnp.sin(p.value["w"] * p.value["mask"] * x)

    def pure(w, x):
        with jax.numpy_dtype_promotion("standard"):
            return jnp.sin(w * mask * x)

    grad_states = es.ParamState if spec == "filter" else [p, count]
    out, vjp_fn = es.transform.vjp(f, x, grad_states=grad_states)
    state_ct, (x_ct,) = vjp_fn(jnp.ones(3))
    if spec == "handle":  # in the structure of `grad_states`
        state_ct = dict(zip([p, count], state_ct))
    _, pure_vjp = jax.vjp(pure, w, x)
    w_ct, expected_x_ct = pure_vjp(jnp.ones(3))
    assert state_ct[p]["mask"] is None
    assert tree_allclose(state_ct[p]["w"], w_ct) and tree_allclose(x_ct, expected_x_ct)
    if spec == "handle":  # an integer state named explicitly: float0, as jax.vjp
        assert state_ct[count].dtype == jax.dtypes.float0


@pytest.mark.parametrize("n", [3, jnp.array(3), np.int8(3), True])
def test_jvp_of_an_integer_argument_takes_float0_or_none_and_refuses_other_tangents(
    n,
):
    # As `jax.jvp`: a float tangent for an integer primal is refused, not dropped.
    scale = es.ParamState(jnp.float32(2.0), name="scale")

    def f(x, n):
        return scale.value * x * jnp.asarray(n, x.dtype)

    x, tx = jnp.arange(3.0), jnp.ones(3)
    want = jax.jvp(lambda x: 2.0 * x * jnp.asarray(n, x.dtype), (x,), (tx,))
    zero = np.zeros(np.shape(n), jax.dtypes.float0)
    for tangent in (zero, None):
        got = es.transform.jvp(f, (x, n), (tx, tangent))
        assert tree_allclose(got, want)
    for bad in (1.0, jnp.ones(np.shape(n)), np.ones(np.shape(n), np.int32)):
        with pytest.raises(TypeError, match=r"primals\[1\].*`float0`"):
            es.transform.jvp(f, (x, n), (tx, bad))
        with pytest.raises(TypeError):
            jax.jvp(lambda x, n: x * jnp.asarray(n, x.dtype), (x, n), (tx, bad))


def test_jvp_of_a_key_argument_refuses_a_float_tangent():
    def f(x, key):
        return x * jr.uniform(key)

    x, key = jnp.float32(2.0), jr.key(0)
    zero = np.zeros((), jax.dtypes.float0)
    assert tree_allclose(
        es.transform.jvp(f, (x, key), (1.0, zero)), jax.jvp(f, (x, key), (1.0, zero))
    )
    with pytest.raises(TypeError, match=r"primals\[1\], which has the .* key dtype"):
        es.transform.jvp(f, (x, key), (1.0, jnp.float32(1.0)))


@pytest.mark.parametrize("name", ["grad", "jacrev", "jacfwd", "hessian"])
def test_derivatives_along_integer_arguments_alone_are_none(name):
    # Equinox's convention, as `grad` follows: `None` where nothing is differentiated.
    # (JAX's Jacobians take no empty input.)
    calls = es.ShortTermState(jnp.array(0), name="calls")
    transform = getattr(es.transform, name)

    def f(n):
        calls.value = calls.value + 1
        if name == "grad":
            return n * 2.0
        return {"a": n * 2.0, "b": jnp.ones(2) * n}

    got = transform(f)(3)
    assert got == (None if name == "grad" else {"a": None, "b": None})
    assert calls.value == 1  # the write is kept once, as for any derivative


def test_jvp_refuses_a_complex_tangent_for_a_real_state_rather_than_dropping_it():
    w = es.ParamState(jnp.array([1.0, 2.0]), name="w")
    x = jnp.array([3.0, 4.0])
    tangents = es.StateDict({w: jnp.array([1j, 1j])})
    with pytest.raises(TypeError, match=r"ParamState 'w' a complex tangent"):
        es.transform.jvp(
            lambda x: jnp.sum(w.value * x), (x,), (x,), state_tangents=tangents
        )


def test_a_gradient_made_once_sees_the_globals_of_each_jitted_function_using_it():
    # As `jax.grad` does: each jitted function tracing it runs its Python again.
    w = es.ParamState(jnp.array(1.0), name="w")
    mask = {"now": jnp.array([1.0, 1.0])}

    def loss(x):
        return w.value * jnp.sum(mask["now"] * x)

    grad = es.transform.grad(loss, grad_states=w)
    x = jnp.array([2.0, 3.0])
    first = es.transform.jit(lambda x: grad(x)[w])
    assert first(x) == 5.0
    mask["now"] = jnp.array([1.0, 0.0])
    second = es.transform.jit(lambda x: grad(x)[w])
    assert second(x) == 2.0
    first.clear_cache()
    assert first(x) == 2.0


def test_clear_cache_of_a_jitted_gradient_finds_states_created_since():
    # The docs' remedy for a function that lists the world's states.
    class Bias(es.ParamState):
        pass

    keep = Bias(jnp.array(1.0))

    def total():
        return sum(v**2 for v in es.world().filter(Bias).values())

    value_and_grad = es.transform.value_and_grad(total, grad_states=Bias)
    step = es.transform.jit(lambda: value_and_grad())
    assert step()[0] == 1.0
    more = Bias(jnp.array(10.0))
    step.clear_cache()
    value, grads = step()
    assert value == 101.0 and set(grads.states) == {keep, more}


def test_calls_in_one_enclosing_trace_trace_the_function_once():
    w = es.ParamState(jnp.array(2.0), name="w")
    traced = []

    def loss(x):
        traced.append(None)
        return w.value * x

    grad = es.transform.grad(loss, grad_states=w)

    @es.transform.jit
    def three(x):
        return [grad(x + i)[w] for i in range(3)]

    es.transform.jit(lambda x: grad(x)[w])(jnp.array(1.0))
    once = len(traced)  # two traces in the two-pass mode
    traced.clear()
    assert three(jnp.array(1.0)) == [1.0, 2.0, 3.0]
    assert len(traced) == once


@pytest.mark.parametrize(
    "make",
    (
        es.transform.grad,
        es.transform.vector_grad,
        es.transform.jacrev,
        es.transform.jacfwd,
        es.transform.hessian,
    ),
)
def test_the_gradient_transforms_decorate_methods(make):
    w = es.ParamState(jnp.array(2.0), name="w")

    class Model:
        k = 3.0

        def loss(self, x):
            return self.k * w.value**2 * x

        grad = make(loss, grad_states=w)

    got = jax.tree.leaves(Model().grad(jnp.array(1.0)))
    want = make(lambda w: Model.k * w**2)(jnp.array(2.0))
    assert tree_allclose(got, [want])


def test_calls_in_an_enclosing_trace_and_in_traces_nested_in_it_keep_their_traces():
    # One cache per trace: calls alternating between the jitted function's trace and
    # a branch's do not evict each other's.
    w = es.ParamState(jnp.ones(3), name="w")
    traced = []

    def loss(x):
        traced.append(None)
        return jnp.sum(w.value * x)

    grad = es.transform.grad(loss, grad_states=w)

    def in_branch(x):
        return es.transform.cond(x[0] > 0, lambda: grad(x)[w].sum(), lambda: 0.0)

    def count(body):
        traced.clear()
        es.transform.jit(lambda x: sum(body(x) for _ in range(5)))(jnp.ones(3))
        return len(traced)

    direct = count(lambda x: grad(x)[w].sum())
    branches = count(in_branch)
    assert count(lambda x: grad(x)[w].sum() + in_branch(x)) == direct + branches


@pytest.mark.parametrize("grad_states", ["params", [], (), es.NonBatchState])
def test_grad_states_selecting_nothing_without_argnums_is_an_error(grad_states):
    w = es.ParamState(jnp.ones(2), name="w")

    def loss(x):
        return jnp.sum(w.value * x)

    with pytest.raises(ValueError, match="selects none of the floating-point"):
        es.transform.grad(loss, grad_states=grad_states)(jnp.ones(2))
    # With `argnums`, the arguments are differentiated: generic code may give a
    # filter that a model without such states does not match.
    state_grads, x_grad = es.transform.grad(loss, grad_states=grad_states, argnums=0)(
        jnp.ones(2)
    )
    assert len(state_grads) == 0 and (x_grad == 1).all()


_EAGER_AD_CALLS = {
    "grad": lambda f, x: es.transform.grad(f)(x),
    "value_and_grad": lambda f, x: es.transform.value_and_grad(f)(x),
    "vector_grad": lambda f, x: es.transform.vector_grad(f)(x),
    "jacrev": lambda f, x: es.transform.jacrev(f)(x),
    "jacfwd": lambda f, x: es.transform.jacfwd(f)(x),
    "hessian": lambda f, x: es.transform.hessian(f)(x),
    "vjp": lambda f, x: es.transform.vjp(f, x),
    "jvp": lambda f, x: es.transform.jvp(f, (x,), (x,)),
}


_COPYING_CALLS = {
    **{
        name: _EAGER_AD_CALLS[name] for name in ("grad", "value_and_grad", "vjp", "jvp")
    },
    "checkpoint": lambda f, x: es.transform.checkpoint(f)(x),
}


@pytest.mark.parametrize("name", list(_COPYING_CALLS))
def test_a_state_written_with_a_large_numpy_argument_never_shares_its_buffer(name):
    # JAX 0.8.0 on the CPU may hand a large NumPy argument on as a JAX array sharing
    # its buffer (in 1 to 6 of 100 calls, depending on the transform): the state must
    # hold a copy all the same.
    s = es.State(jnp.zeros(1024), name="s")

    def f(x):
        s.value = x
        return jnp.sum(x**2)

    arguments = []  # Kept alive, so that each call gets a new buffer.
    for _ in range(100):
        x = np.ones(1024, np.float32)
        arguments.append(x)
        _COPYING_CALLS[name](f, x)
        x[0] = 100.0
        assert (s.value == 1).all(), s.value


@pytest.mark.parametrize(
    "call", list(_EAGER_AD_CALLS.values()), ids=list(_EAGER_AD_CALLS)
)
def test_a_state_written_with_an_argument_holds_a_copy_as_a_jax_array(call):
    # Eagerly, JAX hands back an input passed through as it is: the caller's NumPy
    # array, a NumPy float64, a Python float. A state holds a `jax.Array` copy of
    # it, in the dtype its write was traced with, as after `jit`.
    s = es.State(jnp.zeros(3), name="s")
    weak = es.State(jnp.asarray(0.0), name="weak")

    def f(x):
        s.value = x
        return jnp.sum(x**2)

    for x in (np.ones(3, np.float32), np.ones(3, np.float64)):
        call(f, x)
        x[0] = 100.0  # The caller reuses its buffer.
        assert type(s.value) is type(jnp.zeros(3)) and s.value.dtype == jnp.float32
        assert (s.value == 1).all(), s.value

    def g(x):
        weak.value = x
        return x**2

    call(g, 3.0)
    assert isinstance(weak.value, jax.Array) and weak.value.weak_type
    assert weak.value == 3.0
