"""`eqstate.nn` against `equinox.nn` (used the Equinox way, with an explicit state) and
against plain JAX."""

import functools as ft

import eqstate as es
import eqstate.nn as enn
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest

from .helpers import tree_allclose, tree_bitwise_equal


_TOL = dict(rtol=1e-5, atol=1e-5)


# --- BatchNorm ------------------------------------------------------------------------


def _eqx_batch_norm(num_features, *, momentum, affine=True, dtype=None):
    return eqx.nn.make_with_state(eqx.nn.BatchNorm)(
        num_features,
        "batch",
        momentum=momentum,
        channelwise_affine=affine,
        mode="batch",
        dtype=dtype,
    )


def _eqx_apply(bn, state, x, *, inference=None):
    fn = jax.vmap(
        ft.partial(bn, inference=inference),
        axis_name="batch",
        in_axes=(0, None),
        out_axes=(0, None),
    )
    return fn(x, state)


def _eqx_running_stats(bn, state):
    return state.get(bn.batch_state_index)


@pytest.mark.parametrize(
    "shape, affine", [((16, 3), True), ((8, 3, 5), False), ((4, 3, 2, 5), True)]
)
@pytest.mark.parametrize("inference_via", ["argument", "field"])
def test_batch_norm_matches_equinox(getkey, shape, affine, inference_via):
    momentum = 0.9
    bn = enn.BatchNorm(3, momentum=momentum, affine=affine)
    ref, ref_state = _eqx_batch_norm(3, momentum=momentum, affine=affine)
    for _ in range(4):
        x = jr.normal(getkey(), shape) * 2.0 + 0.5
        y = bn(x)
        ref_y, ref_state = _eqx_apply(ref, ref_state, x)
        assert tree_allclose(y, ref_y, **_TOL)
        assert tree_allclose(
            (bn.running_mean.value, bn.running_var.value),
            _eqx_running_stats(ref, ref_state),
            **_TOL,
        )

    # `eqx.nn.BatchNorm` divides the running statistics by `1 - momentum**counter` in
    # inference; with its counter at zero it uses them as they are, as eqstate does.
    ref_state = ref_state.set(ref.batch_counter, jnp.array(0))
    x = jr.normal(getkey(), shape)
    before = es.values_of(bn)
    if inference_via == "field":
        y = eqx.tree_at(lambda m: m.inference, bn, True)(x)
    else:
        y = bn(x, inference=True)
    ref_y, _ = _eqx_apply(ref, ref_state, x, inference=True)
    assert tree_allclose(y, ref_y, **_TOL)
    assert tree_bitwise_equal(es.values_of(bn), before)


def test_batch_norm_of_complex_inputs_matches_equinox(getkey):
    bn = enn.BatchNorm(3, momentum=0.9, dtype=jnp.complex64)
    ref, ref_state = _eqx_batch_norm(3, momentum=0.9, dtype=jnp.complex64)
    weight, bias = jr.normal(getkey(), (2, 3), jnp.complex64)
    es.assign({bn.weight: weight, bn.bias: bias})
    ref = eqx.tree_at(lambda m: (m.weight, m.bias), ref, (weight, bias))
    for _ in range(3):
        x = 2.0 * jr.normal(getkey(), (16, 3, 2), jnp.complex64) + 1j
        y = bn(x)
        ref_y, ref_state = _eqx_apply(ref, ref_state, x)
        assert y.dtype == jnp.complex64 and tree_allclose(y, ref_y, **_TOL)
        # `eqx.nn.BatchNorm` keeps its running variance complex, with a zero imaginary part.
        ref_mean, ref_var = _eqx_running_stats(ref, ref_state)
        assert bn.running_var.value.dtype == jnp.float32
        assert tree_allclose(bn.running_mean.value, ref_mean, **_TOL)
        assert tree_allclose(bn.running_var.value, jnp.real(ref_var), **_TOL)
    normalised = (y - bias.reshape(1, 3, 1)) / weight.reshape(1, 3, 1)
    assert tree_allclose(jnp.mean(jnp.abs(normalised) ** 2), jnp.array(1.0), **_TOL)

    ref_state = ref_state.set(ref.batch_counter, jnp.array(0))
    x = jr.normal(getkey(), (16, 3, 2), jnp.complex64)
    ref_y, _ = _eqx_apply(ref, ref_state, x, inference=True)
    assert tree_allclose(bn(x, inference=True), ref_y, **_TOL)


def test_batch_norm_refuses_a_complex_input_to_real_states(getkey):
    bn = enn.BatchNorm(3)
    before = es.values_of(bn)
    with pytest.raises(
        ValueError, match=r"complex64 input.*LongTermState 'running_mean'.*float32"
    ):
        bn(jr.normal(getkey(), (8, 3), jnp.complex64))
    assert tree_bitwise_equal(es.values_of(bn), before)


def test_batch_norm_call_argument_overrides_the_inference_field(getkey):
    bn = enn.BatchNorm(2, inference=True)
    x = jr.normal(getkey(), (8, 2)) + 3.0
    before = es.values_of(bn)
    assert tree_allclose(bn(x), (x - 0.0) / jnp.sqrt(1.0 + bn.eps))
    assert tree_bitwise_equal(es.values_of(bn), before)
    y = bn(x, inference=False)
    assert tree_allclose(y.mean(0), jnp.zeros(2), atol=1e-5)
    assert not tree_allclose(bn.running_mean.value, jnp.zeros(2))


def test_batch_norm_uses_the_biased_variance_and_the_momentum_of_the_old_value(getkey):
    bn = enn.BatchNorm(3, momentum=0.75, affine=False)
    x = jr.normal(getkey(), (10, 3, 4))
    bn(x)
    mean = x.mean(axis=(0, 2))
    var = x.var(axis=(0, 2))  # ddof=0
    assert tree_allclose(bn.running_mean.value, 0.25 * mean, **_TOL)
    assert tree_allclose(bn.running_var.value, 0.75 + 0.25 * var, **_TOL)


def test_eqx_inference_mode_switches_the_layers_and_shares_their_states(getkey):
    model = (enn.BatchNorm(3), enn.Dropout(0.5))
    inference_model = eqx.nn.inference_mode(model)
    assert inference_model[0].inference and inference_model[1].inference
    assert es.states_of(inference_model) == es.states_of(model)
    x = jr.normal(getkey(), (4, 3))
    key = es.random.get_key()
    before = es.values_of(model)
    y = inference_model[1](inference_model[0](x))
    assert tree_allclose(y, x / jnp.sqrt(1.0 + 1e-5))
    assert tree_bitwise_equal(es.values_of(model), before)
    assert tree_bitwise_equal(es.random.get_key(), key)


def test_batch_norm_keeps_the_dtype_of_its_states(getkey):
    bn = enn.BatchNorm(3)
    bn(jr.normal(getkey(), (8, 3)).astype(jnp.bfloat16))
    assert bn.running_mean.value.dtype == jnp.float32
    bn16 = enn.BatchNorm(3, dtype=jnp.bfloat16)
    y = bn16(jr.normal(getkey(), (8, 3)).astype(jnp.bfloat16))
    assert y.dtype == jnp.bfloat16 and bn16.running_var.value.dtype == jnp.bfloat16


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_batch_norm_of_half_precision_inputs_computes_in_float32(getkey, dtype):
    # Deviations above 256 overflow float16 when squared; bfloat16 rounds the mean.
    x = (100 + 300 * jr.normal(getkey(), (16, 4))).astype(dtype)
    exact = np.asarray(x, np.float64)
    mean, var = exact.mean(0), exact.var(0)
    bn = enn.BatchNorm(4, momentum=0.0)  # float32 states
    y = bn(x)
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, (exact - mean) / np.sqrt(var + 1e-5), rtol=1e-5)
    np.testing.assert_allclose(bn.running_mean.value, mean, rtol=1e-6)
    np.testing.assert_allclose(bn.running_var.value, var, rtol=1e-5)
    # All in half precision: a variance that fits, of deviations whose squares don't.
    x = (100 * jr.normal(getkey(), (64, 4))).astype(dtype)
    exact = np.asarray(x, np.float64)
    half = enn.BatchNorm(4, momentum=0.0, dtype=dtype)
    out = half(x)
    assert out.dtype == dtype and jnp.isfinite(half.running_var.value).all()
    expected = (exact - exact.mean(0)) / exact.std(0)
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=2e-2)


@pytest.mark.usefixtures("tracing_mode")
def test_batch_norm_inside_jit_matches_eager(getkey):
    eager, jitted = enn.BatchNorm(3), enn.BatchNorm(3)
    train = es.transform.jit(lambda x: jitted(x))
    infer = es.transform.jit(lambda x: jitted(x, inference=True))
    for _ in range(3):
        x = jr.normal(getkey(), (16, 3, 2))
        assert tree_allclose(train(x), eager(x), **_TOL)
    assert tree_allclose(
        (jitted.running_mean.value, jitted.running_var.value),
        (eager.running_mean.value, eager.running_var.value),
        **_TOL,
    )
    before = es.values_of(jitted)
    assert tree_allclose(infer(x), eager(x, inference=True), **_TOL)
    assert tree_bitwise_equal(es.values_of(jitted), before)


@pytest.mark.usefixtures("tracing_mode")
def test_batch_norm_gradients_match_equinox_and_running_stats_are_written(getkey):
    bn = enn.BatchNorm(3, momentum=0.8)
    ref, ref_state = _eqx_batch_norm(3, momentum=0.8)
    weight, bias = jr.normal(getkey(), (3,)), jr.normal(getkey(), (3,))
    es.assign({bn.weight: weight, bn.bias: bias})
    ref = eqx.tree_at(lambda m: (m.weight, m.bias), ref, (weight, bias))
    x = jr.normal(getkey(), (12, 3, 4))
    target = jr.normal(getkey(), (12, 3, 4))

    def loss():
        return jnp.sum(jnp.sin(bn(x)) * target)

    @eqx.filter_grad(has_aux=True)
    def ref_grads(model, state):
        y, state = _eqx_apply(model, state, x)
        return jnp.sum(jnp.sin(y) * target), state

    grads = es.transform.jit(es.transform.grad(loss, grad_states=es.ParamState))()
    expected, ref_state = ref_grads(ref, ref_state)
    assert set(grads) == {bn.weight, bn.bias}
    assert tree_allclose(
        (grads[bn.weight], grads[bn.bias]), (expected.weight, expected.bias), **_TOL
    )
    assert tree_allclose(
        (bn.running_mean.value, bn.running_var.value),
        _eqx_running_stats(ref, ref_state),
        **_TOL,
    )


@pytest.mark.usefixtures("tracing_mode")
def test_batch_norm_ensemble_matches_separate_layers(getkey):
    ensemble = es.transform.vmap_new_states(
        lambda: enn.BatchNorm(3, momentum=0.5), axis_size=4
    )()
    states = es.states_of(ensemble)
    assert ensemble.running_mean.value.shape == (4, 3)
    train = es.transform.vmap(lambda x: ensemble(x), in_states={0: states})
    infer = es.transform.vmap(
        lambda x: ensemble(x, inference=True), in_states={0: states}
    )
    singles = [enn.BatchNorm(3, momentum=0.5) for _ in range(4)]
    for _ in range(2):
        xs = jr.normal(getkey(), (4, 8, 3)) * jnp.arange(1.0, 5.0)[:, None, None]
        ys = train(xs)
        assert tree_allclose(ys, jnp.stack([b(x) for b, x in zip(singles, xs)]), **_TOL)
    assert tree_allclose(
        ensemble.running_var.value,
        jnp.stack([b.running_var.value for b in singles]),
        **_TOL,
    )
    ys = infer(xs)
    expected = jnp.stack([b(x, inference=True) for b, x in zip(singles, xs)])
    assert tree_allclose(ys, expected, **_TOL)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("jit", [False, True])
def test_a_batch_norm_ensemble_called_outside_vmap_says_to_map_it(getkey, affine, jit):
    ensemble = es.transform.vmap_new_states(
        lambda: enn.BatchNorm(3, affine=affine), axis_size=4
    )()
    before = es.values_of(ensemble)
    call = es.transform.jit(ensemble) if jit else ensemble
    x = jr.normal(getkey(), (8, 3))
    with pytest.raises(
        ValueError,
        match=r"BatchNorm\(num_features=3\) is an ensemble of 4 members: its "
        r"LongTermState 'running_mean' has shape \(4, 3\), a single layer's "
        r"\(3,\).*eqstate.transform.vmap.*in_states.*eqstate.member",
    ):
        call(x)
    assert tree_bitwise_equal(es.values_of(ensemble), before)
    member = es.member(ensemble, 1)
    assert tree_allclose(member(x), enn.BatchNorm(3, affine=affine)(x), **_TOL)


def test_batch_norm_input_with_the_wrong_feature_size_names_both_sizes():
    bn = enn.BatchNorm(3)
    with pytest.raises(
        ValueError,
        match=r"BatchNorm\(num_features=3\).*got shape \(8, 4\), whose feature "
        r"axis \(axis 1\) has size 4, not 3",
    ):
        bn(jnp.zeros((8, 4)))


def test_batch_norm_called_per_example_says_to_call_it_on_the_batch_outside_vmap():
    bn = enn.BatchNorm(3)
    per_example = es.transform.vmap(bn, axis_name="batch")
    match = (
        r"got shape \(3,\)\..*one example.*call it on the whole batch.*outside `vmap`"
    )
    with pytest.raises(ValueError, match=match) as info:
        per_example(jnp.ones((4, 3)))
    assert "x[None]" not in str(info.value)


@pytest.mark.parametrize("vmap", (jax.vmap, eqx.filter_vmap), ids=("jax", "eqx"))
def test_batch_norm_in_inference_per_example_of_square_shape_is_refused(vmap):
    # One example (channels, height, width) with height == channels passes the
    # feature-axis check, and would be normalised along its height.
    bn = enn.BatchNorm(3)
    bn(jnp.arange(60.0).reshape(5, 3, 4))
    images = jnp.ones((2, 3, 3, 4))
    with pytest.raises(ValueError, match=r"(?s)shape \(3, 3, 4\).*one example"):
        vmap(eqx.nn.inference_mode(bn))(images)
    # What is unambiguous runs: the whole batch, and the lanes of an ensemble,
    # whose statistics are mapped too.
    assert bn(images, inference=True).shape == images.shape
    ensemble = es.transform.vmap_new_states(
        lambda: enn.BatchNorm(3, inference=True), axis_size=2
    )()
    lanes = es.transform.vmap(
        lambda x: ensemble(x), in_states={0: es.states_of(ensemble)}
    )
    assert lanes(images).shape == images.shape


def test_batch_norm_channels_last_input_gets_a_hint_about_the_feature_axis():
    bn = enn.BatchNorm(3)
    with pytest.raises(
        ValueError, match=r"last axis has size 3.*jnp.moveaxis\(x, -1, 1\)"
    ) as info:
        bn(jnp.ones((4, 5, 3)))
    assert "one example" not in str(info.value) and "x[None]" not in str(info.value)


def test_batch_norm_refuses_one_value_per_feature_in_training_only():
    bn = enn.BatchNorm(3)
    with pytest.raises(ValueError, match="one value per feature"):
        bn(jnp.zeros((1, 3)))
    assert bn(jnp.zeros((1, 3)), inference=True).shape == (1, 3)


def test_batch_norm_refuses_bad_options():
    with pytest.raises(
        ValueError, match="`num_features` must be a positive integer, got 0"
    ):
        enn.BatchNorm(0)
    with pytest.raises(ValueError, match=r"must be in \[0, 1\], got 1.5"):
        enn.BatchNorm(3, momentum=1.5)
    with pytest.raises(ValueError, match="non-negative, got -1"):
        enn.BatchNorm(3, eps=-1.0)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_])
def test_batch_norm_refuses_a_dtype_that_is_not_floating_or_complex(dtype):
    with pytest.raises(
        ValueError,
        match=rf"floating or complex `dtype`.*got {jnp.dtype(dtype)}.*truncate",
    ):
        enn.BatchNorm(2, dtype=dtype)


# --- Dropout --------------------------------------------------------------------------


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9])
def test_dropout_with_a_key_matches_equinox_bitwise(getkey, p):
    x = jr.normal(getkey(), (7, 33))
    key = getkey()
    expected = eqx.nn.Dropout(p)(x, key=key)
    assert tree_bitwise_equal(enn.Dropout(p)(x, key=key), expected)
    # Compiled, XLA may turn `x / q` into a multiplication: compare compiled to compiled.
    jitted = es.transform.jit(lambda x, k: enn.Dropout(p)(x, key=k))
    ref_jitted = eqx.filter_jit(lambda x, k: eqx.nn.Dropout(p)(x, key=k))
    assert tree_bitwise_equal(jitted(x, key), ref_jitted(x, key))


def test_dropout_draws_from_and_advances_the_default_key(getkey):
    x = jr.normal(getkey(), (50,))
    before = es.random.get_key()
    y = enn.Dropout(0.3)(x)
    new_default, used = jr.split(before)
    assert tree_bitwise_equal(es.random.get_key(), new_default)
    assert tree_bitwise_equal(y, eqx.nn.Dropout(0.3)(x, key=used))


def test_dropout_keep_rate_and_scale():
    dropout = enn.Dropout(0.3)
    y = dropout(jnp.ones(200_000), key=jr.key(0))  # a fixed key: never flaky
    kept = y != 0
    # Five standard deviations of the mean of 200_000 Bernoulli(0.7) draws is ~0.005.
    assert abs(kept.mean() - 0.7) < 0.005
    assert tree_allclose(y[kept], jnp.full(int(kept.sum()), 1 / 0.7))
    assert abs(y.mean() - 1.0) < 0.01


def test_dropout_repeated_calls_differ():
    dropout = enn.Dropout(0.5)
    masks = {tuple((dropout(jnp.ones(64)) != 0).tolist()) for _ in range(5)}
    assert len(masks) == 5


def test_dropout_in_inference_is_the_identity_and_draws_nothing(getkey):
    x = jr.normal(getkey(), (4, 5))
    key = es.random.get_key()
    assert tree_bitwise_equal(enn.Dropout(0.5, inference=True)(x), x)
    assert tree_bitwise_equal(enn.Dropout(0.5)(x, inference=True), x)
    assert tree_bitwise_equal(enn.Dropout(0.0)(x), x)
    assert tree_bitwise_equal(es.random.get_key(), key)
    assert not tree_bitwise_equal(
        enn.Dropout(0.5, inference=True)(x, inference=False), x
    )


@pytest.mark.usefixtures("tracing_mode")
def test_dropout_inside_jit_matches_eager_and_advances_the_key():
    dropout = enn.Dropout(0.4)
    step = es.transform.jit(lambda x: dropout(x))
    es.random.seed(3)
    a, b = step(jnp.ones(100)), step(jnp.ones(100))
    key = es.random.get_key()
    es.random.seed(3)
    eager = (dropout(jnp.ones(100)), dropout(jnp.ones(100)))
    assert tree_bitwise_equal((a != 0, b != 0), (eager[0] != 0, eager[1] != 0))
    assert tree_allclose((a, b), eager)
    assert tree_bitwise_equal(es.random.get_key(), key)
    assert not tree_bitwise_equal(a, b)


@pytest.mark.usefixtures("tracing_mode")
def test_dropout_gradient_is_the_scaled_mask():
    w = es.ParamState(jnp.ones(1000))
    dropout = enn.Dropout(0.2)
    es.random.seed(7)
    grads = es.transform.grad(
        lambda: jnp.sum(dropout(w.value)), grad_states=es.ParamState
    )()
    es.random.seed(7)
    mask = dropout(jnp.ones(1000)) != 0
    assert tree_allclose(grads[w], jnp.where(mask, 1 / 0.8, 0.0))


@pytest.mark.usefixtures("tracing_mode")
def test_dropout_draws_a_different_mask_in_each_vmap_lane():
    dropout = enn.Dropout(0.5)
    ys = es.transform.vmap(lambda x: dropout(x))(jnp.ones((4, 64)))
    assert len({tuple(row) for row in (ys != 0).tolist()}) == 4


@pytest.mark.parametrize(
    "p", [np.float32(0.25), jnp.array(0.25), np.linspace(0.0, 0.25, 3)[2]]
)
def test_dropout_with_an_array_p_matches_a_float_p_under_jit(getkey, p):
    x = jr.normal(getkey(), (64,))
    key = getkey()
    apply = es.transform.jit(lambda layer, x, key: layer(x, key=key))
    expected = enn.Dropout(0.25)(x, key=key)
    assert tree_allclose(apply(enn.Dropout(p), x, key), expected)
    changed = eqx.tree_at(lambda d: d.p, enn.Dropout(0.5), p)
    assert tree_allclose(apply(changed, x, key), expected)
    assert tree_allclose(apply(enn.Dropout(jnp.array(0.0)), x, key), x)


@pytest.mark.parametrize("p", [1.0, -0.1, 1.5])
def test_dropout_refuses_p_outside_zero_one(p):
    with pytest.raises(ValueError, match=rf"must be in \[0, 1\), got {p}"):
        enn.Dropout(p)


# --- Recurrent cells ------------------------------------------------------------------


def _eqx_scan(cell, xs, carry0):
    """`eqx.nn` cell over a sequence, the Equinox way: returns the final carry and
    every hidden state."""

    def step(carry, x):
        carry = cell(x, carry)
        h = carry[0] if isinstance(carry, tuple) else carry
        return carry, h

    return jax.lax.scan(step, carry0, xs)


def _eqx_pair(kind, input_size, hidden_size, key, **kwargs):
    """An eqstate cell and the `eqx.nn` cell with the same weights, and the Equinox
    cell's zero carry."""
    cell = getattr(enn, kind)(input_size, hidden_size, key=key, **kwargs)
    ref = getattr(eqx.nn, kind)(
        input_size, hidden_size, kwargs.get("use_bias", True), key=key
    )
    zeros = jnp.zeros(hidden_size)
    return cell, ref, (zeros, zeros) if kind == "LSTMCell" else zeros


def _eqx_batched(ref, xs, carry0, batch_shape):
    """`_eqx_scan` over every example of a batch of shape `batch_shape` (`xs` has
    shape `(time, *batch_shape, input_size)`), with `jax.vmap`."""
    if not batch_shape:
        return _eqx_scan(ref, xs, carry0)
    flat = xs.reshape(xs.shape[0], -1, xs.shape[-1])
    final, hs = jax.vmap(ft.partial(_eqx_scan, ref), in_axes=(1, None))(flat, carry0)
    final = jtu.tree_map(lambda c: c.reshape(*batch_shape, -1), final)
    return final, jnp.moveaxis(hs, 0, 1).reshape(*xs.shape[:-1], -1)


def _carry(cell):
    return tuple(s.value for s in es.states_of(cell, es.ShortTermState))


_CELLS_WITH_EQX = ["GRUCell", "LSTMCell"]


@pytest.mark.parametrize("kind", _CELLS_WITH_EQX)
@pytest.mark.parametrize("use_bias", [True, False])
def test_cells_have_the_weights_of_equinox_for_the_same_key(getkey, kind, use_bias):
    cell, ref, _ = _eqx_pair(kind, 3, 5, getkey(), use_bias=use_bias)
    names = ["weight_ih", "weight_hh", "bias"] + (
        ["bias_n"] if kind == "GRUCell" else []
    )
    for name in names:
        state, array = getattr(cell, name), getattr(ref, name)
        if array is None:
            assert state is None
        else:
            assert tree_bitwise_equal(state.value, array)


@pytest.mark.parametrize("kind", _CELLS_WITH_EQX)
@pytest.mark.parametrize("use_bias", [True, False])
def test_one_step_is_bitwise_that_of_equinox(getkey, kind, use_bias):
    cell, ref, zeros = _eqx_pair(kind, 3, 5, getkey(), use_bias=use_bias)
    x1, x2 = jr.normal(getkey(), (2, 3))
    expected = ref(x2, ref(x1, zeros))
    cell(x1)
    h = cell(x2)
    assert tree_bitwise_equal(
        _carry(cell), expected if kind == "LSTMCell" else (expected,)
    )
    assert tree_bitwise_equal(h, _carry(cell)[0])


@pytest.mark.usefixtures("tracing_mode")
@pytest.mark.parametrize("kind", _CELLS_WITH_EQX)
@pytest.mark.parametrize("batch_shape", [(), (4,), (2, 3)])
def test_cells_match_equinox_over_a_sequence(getkey, kind, batch_shape):
    cell, ref, zeros = _eqx_pair(kind, 3, 5, getkey(), batch_size=batch_shape)
    xs = jr.normal(getkey(), (12, *batch_shape, 3))
    hs = es.transform.for_loop(cell, xs)
    final, ref_hs = _eqx_batched(ref, xs, zeros, batch_shape)
    assert hs.shape == (12, *batch_shape, 5)
    assert tree_allclose(hs, ref_hs, **_TOL)
    final = final if kind == "LSTMCell" else (final,)
    assert tree_allclose(_carry(cell), final, **_TOL)

    # The hidden state carries on into the next sequence until reset.
    xs2 = jr.normal(getkey(), (4, *batch_shape, 3))
    flat = xs2.reshape(4, -1, 3)
    carry = jtu.tree_map(lambda c: c.reshape(-1, 5), final)
    carry = carry if kind == "LSTMCell" else carry[0]
    _, ref_hs2 = jax.vmap(ft.partial(_eqx_scan, ref), in_axes=(1, 0))(flat, carry)
    ref_hs2 = jnp.moveaxis(ref_hs2, 0, 1).reshape(4, *batch_shape, 5)
    assert tree_allclose(es.transform.for_loop(cell, xs2), ref_hs2, **_TOL)


@pytest.mark.parametrize("cls", [enn.GRUCell, enn.LSTMCell, enn.RNNCell])
def test_reset_restores_zeros_and_the_first_run(getkey, cls):
    cell = cls(2, 4, key=getkey())
    xs = jr.normal(getkey(), (5, 2))
    first = es.transform.for_loop(cell, xs)
    assert not (cell.hidden.value == 0).all()
    cell.reset()
    assert tree_bitwise_equal(_carry(cell), tuple(jnp.zeros(4) for _ in _carry(cell)))
    assert tree_allclose(es.transform.for_loop(cell, xs), first)


@pytest.mark.parametrize("cls", [enn.GRUCell, enn.LSTMCell, enn.RNNCell])
def test_batch_shape_follows_reset_and_each_example_matches_an_unbatched_run(
    getkey, cls
):
    key = getkey()
    cell, single = cls(2, 4, key=key), cls(2, 4, key=key)  # built unbatched
    xs = jr.normal(getkey(), (6, 3, 2))
    cell.reset(batch_size=3)
    assert cell.hidden.value.shape == (3, 4)
    hs = es.transform.for_loop(cell, xs)
    for b in range(3):
        single.reset()
        assert tree_allclose(hs[:, b], es.transform.for_loop(single, xs[:, b]), **_TOL)

    cell.reset()  # keeps the batch shape
    assert cell.hidden.value.shape == (3, 4) and (cell.hidden.value == 0).all()
    cell.reset(batch_size=(2, 5))
    assert es.transform.for_loop(cell, jnp.ones((4, 2, 5, 2))).shape == (4, 2, 5, 4)
    cell.reset(batch_size=())
    assert cell(jnp.ones(2)).shape == (4,)


@pytest.mark.usefixtures("tracing_mode")
def test_a_jitted_unroll_retraces_for_a_new_batch(getkey):
    key = getkey()
    cell, eager = enn.LSTMCell(2, 3, key=key), enn.LSTMCell(2, 3, key=key)
    unroll = es.transform.jit(lambda xs: es.transform.for_loop(cell, xs))
    for batch in (2, 5, 2):
        xs = jr.normal(getkey(), (4, batch, 2))
        cell.reset(batch_size=batch)
        eager.reset(batch_size=batch)
        assert tree_allclose(unroll(xs), es.transform.for_loop(eager, xs), **_TOL)
        assert cell.cell.value.shape == (batch, 3)


def test_reset_to_a_batch_inside_run_under_filter_jit(getkey):
    cell, states = es.make_with_states(enn.GRUCell)(2, 4, key=getkey())

    @eqx.filter_jit
    def unroll(states, xs):
        def body():
            cell.reset(batch_size=xs.shape[1])
            return es.transform.for_loop(cell, xs)

        return es.run(body, states)

    xs = jr.normal(getkey(), (5, 3, 2))
    new_states, hs = unroll(states, xs)
    assert hs.shape == (5, 3, 4) and new_states[cell.hidden].shape == (3, 4)
    assert states[cell.hidden].shape == (4,)  # the input dictionary is unchanged
    with es.scope(states) as sc:
        cell.reset(batch_size=3)
        expected = es.transform.for_loop(cell, xs)
    assert sc.states is not None and sc.states[cell.hidden].shape == (3, 4)
    assert tree_allclose(hs, expected, **_TOL)


@pytest.mark.usefixtures("tracing_mode")
@pytest.mark.parametrize("cls", [enn.GRUCell, enn.LSTMCell, enn.RNNCell])
def test_vmap_over_a_single_example_cell_matches_the_batched_call(getkey, cls):
    key = getkey()
    cell, batched = cls(3, 4, key=key), cls(3, 4, key=key)
    cell.reset(batch_size=5)
    batched.reset(batch_size=5)
    step = es.transform.vmap(cell, in_states={0: es.states_of(cell, es.ShortTermState)})
    for x in jr.normal(getkey(), (3, 5, 3)):
        assert tree_allclose(step(x), batched(x), **_TOL)
    assert tree_allclose(_carry(cell), _carry(batched), **_TOL)


@pytest.mark.parametrize("batch_size", [None, 3])
def test_rnn_cell_matches_plain_jax(getkey, batch_size):
    cell = enn.RNNCell(2, 6, batch_size=batch_size, key=getkey())
    shape = (9, 2) if batch_size is None else (9, batch_size, 2)
    xs = jr.normal(getkey(), shape)
    w_ih, w_hh = cell.weight_ih.value, cell.weight_hh.value
    assert cell.bias is not None
    b = cell.bias.value

    def step(h, x):
        h = jnp.tanh(x @ w_ih.T + h @ w_hh.T + jnp.broadcast_to(b, h.shape))
        return h, h

    h0 = jnp.zeros(cell.hidden.value.shape)
    h_final, ref_hs = jax.lax.scan(step, h0, xs)
    assert tree_allclose(es.transform.for_loop(cell, xs), ref_hs, **_TOL)
    assert tree_allclose(cell.hidden.value, h_final, **_TOL)


def test_rnn_cell_initialisation_is_uniform_in_the_equinox_range(getkey):
    cell = enn.RNNCell(50, 16, key=getkey())
    w = cell.weight_ih.value
    assert jnp.abs(w).max() <= 0.25 and jnp.abs(w).max() > 0.24
    assert enn.RNNCell(2, 3, use_bias=False, key=getkey()).bias is None


def test_cells_without_a_key_draw_from_the_default_random_state():
    before = es.random.get_key()
    a, b = enn.GRUCell(2, 3), enn.GRUCell(2, 3)
    assert not tree_allclose(a.weight_ih.value, b.weight_ih.value)
    assert not tree_bitwise_equal(es.random.get_key(), before)
    ref = eqx.nn.GRUCell(2, 3, key=jr.split(before)[1])
    assert tree_bitwise_equal(a.weight_ih.value, ref.weight_ih)


@pytest.mark.usefixtures("tracing_mode")
@pytest.mark.parametrize("cls", [enn.GRUCell, enn.LSTMCell, enn.RNNCell])
def test_cells_inside_jit_match_eager(getkey, cls):
    key = getkey()
    eager, jitted = cls(3, 4, key=key), cls(3, 4, key=key)

    @es.transform.jit
    def run(xs):
        jitted.reset()
        return es.transform.for_loop(jitted, xs)

    xs = jr.normal(getkey(), (7, 3))
    assert tree_allclose(run(xs), es.transform.for_loop(eager, xs), **_TOL)
    assert tree_allclose(_carry(jitted), _carry(eager), **_TOL)
    eager.reset()
    assert tree_allclose(run(xs), es.transform.for_loop(eager, xs), **_TOL)


@pytest.mark.usefixtures("tracing_mode")
@pytest.mark.parametrize("kind", _CELLS_WITH_EQX)
def test_cell_gradients_match_equinox(getkey, kind):
    cell, ref, zeros = _eqx_pair(kind, 3, 4, getkey())
    xs = jr.normal(getkey(), (8, 3))

    def loss():
        cell.reset()
        return jnp.sum(es.transform.for_loop(cell, xs) ** 2)

    @eqx.filter_grad
    def ref_grads(model):
        _, hs = _eqx_scan(model, xs, zeros)
        return jnp.sum(hs**2)

    grads = es.transform.jit(es.transform.grad(loss, grad_states=es.ParamState))()
    expected = ref_grads(ref)
    params = es.states_of(cell, es.ParamState)
    assert set(grads) == set(params)
    assert tree_allclose(
        [grads[s] for s in params],
        [getattr(expected, s.name) for s in params],
        **_TOL,
    )


def _as_eqx_gru(cell, values):
    """An `eqx.nn.GRUCell` holding the parameters `values` of an `enn.GRUCell`."""
    ref = eqx.nn.GRUCell(cell.input_size, cell.hidden_size, key=jr.key(0))
    names = ["weight_ih", "weight_hh", "bias", "bias_n"]
    return eqx.tree_at(
        lambda m: [getattr(m, n) for n in names],
        ref,
        [values[getattr(cell, n)] for n in names],
    )


@pytest.mark.usefixtures("tracing_mode")
def test_gru_cell_ensemble_matches_each_member(getkey):
    ensemble = es.transform.vmap_new_states(lambda: enn.GRUCell(2, 4), axis_size=3)()
    states = es.states_of(ensemble)
    assert ensemble.weight_ih.value.shape == (3, 12, 2)

    @es.transform.vmap(in_states={0: states}, in_axes=None)
    def run(xs):
        ensemble.reset()
        return es.transform.for_loop(ensemble, xs)

    xs = jr.normal(getkey(), (6, 2))
    hs = run(xs)
    assert hs.shape == (3, 6, 4)
    assert len({tuple(h.ravel().tolist()) for h in hs}) == 3
    values = es.values_of(ensemble)
    for i in range(3):
        member = _as_eqx_gru(ensemble, {s: v[i] for s, v in values.items()})
        _, ref_hs = _eqx_scan(member, xs, jnp.zeros(4))
        assert tree_allclose(hs[i], ref_hs, **_TOL)
        assert tree_allclose(ensemble.hidden.value[i], ref_hs[-1], **_TOL)


def test_an_ensemble_cell_takes_a_batch_after_its_members_axis(getkey):
    ensemble = es.transform.vmap_new_states(lambda: enn.GRUCell(2, 4), axis_size=3)()
    run = es.transform.vmap(
        lambda xs: es.transform.for_loop(ensemble, xs),
        in_states={0: es.states_of(ensemble)},
        in_axes=None,
    )
    xs = jr.normal(getkey(), (6, 5, 2))
    ensemble.reset(batch_size=5)  # drops the members axis: each lane has (4,)
    with pytest.raises(ValueError, match=r"members axis first"):
        run(xs)
    ensemble.reset(batch_size=(3, 5))
    assert run(xs).shape == (3, 6, 5, 4)


@pytest.mark.parametrize("cls", [enn.GRUCell, enn.LSTMCell, enn.RNNCell])
def test_an_ensemble_cell_called_outside_vmap_says_to_map_it(cls):
    ensemble = es.transform.vmap_new_states(lambda: cls(2, 4), axis_size=3)()
    rows = ensemble.weight_ih.value.shape[1]
    with pytest.raises(
        ValueError,
        match=rf"{cls.__name__}\(input_size=2, hidden_size=4\) is an ensemble of 3 "
        rf"members: its ParamState 'weight_ih' has shape \(3, {rows}, 2\), a "
        rf"single cell's \({rows}, 2\).*eqstate.transform.vmap.*in_states"
        r".*eqstate.member",
    ):
        ensemble(jnp.ones((3, 2)))
    assert tree_bitwise_equal(ensemble.hidden.value, jnp.zeros((3, 4)))


def test_cell_input_of_the_wrong_shape_names_the_cell_and_both_shapes():
    cell = enn.GRUCell(3, 5)
    with pytest.raises(
        ValueError,
        match=r"GRUCell\(input_size=3, hidden_size=5\) takes one time step of shape "
        r"\(\*batch, 3\), got shape \(4,\).*for_loop",
    ):
        cell(jnp.zeros(4))
    batched = enn.LSTMCell(3, 5, batch_size=2)
    with pytest.raises(
        ValueError,
        match=r"LSTMCell\(input_size=3, hidden_size=5\) got an input of shape "
        r"\(10, 3\) \(batch shape \(10,\)\), but its hidden state has shape \(2, 5\)"
        r".*reset\(batch_size=10\)",
    ):
        batched(jnp.zeros((10, 3)))


def test_lstm_under_vmap_with_only_its_hidden_state_mapped_names_the_cell_state():
    lstm = enn.LSTMCell(2, 4, batch_size=8)
    step = es.transform.vmap(lstm, in_states={0: lstm.hidden})
    with pytest.raises(
        ValueError,
        match=r"got an input of shape \(2,\) \(batch shape \(\)\), but its state "
        r"'cell' has shape \(8, 4\).*map every carried state",
    ):
        step(jnp.zeros((8, 2)))
    both = es.transform.vmap(lstm, in_states={0: es.states_of(lstm, es.ShortTermState)})
    assert both(jnp.zeros((8, 2))).shape == (8, 4)


@pytest.mark.parametrize("cls", [enn.GRUCell, enn.LSTMCell, enn.RNNCell])
def test_real_cells_refuse_a_complex_input_instead_of_dropping_its_imaginary_part(cls):
    cell = cls(3, 4)
    x = jnp.array([1.0 + 2.0j, -0.5 + 1.0j, 0.3 - 0.7j], jnp.complex64)
    name = cls.__name__
    with pytest.raises(
        ValueError,
        match=rf"{name}\(input_size=3, hidden_size=4\) got a complex64 input, "
        r"but its ParamState 'weight_ih' is float32.*drop the imaginary part",
    ):
        cell(x)
    assert tree_bitwise_equal(cell.hidden.value, jnp.zeros(4))


def test_complex_cells_take_a_complex_input(getkey):
    x = jnp.array([1.0 + 2.0j, -0.5 + 1.0j, 0.3 - 0.7j], jnp.complex64)
    cell = enn.GRUCell(3, 4, dtype=jnp.complex64, key=getkey())
    assert cell(x).dtype == jnp.complex64


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
@pytest.mark.parametrize("cls", [enn.GRUCell, enn.LSTMCell, enn.RNNCell])
def test_cells_refuse_a_dtype_that_is_not_floating(cls, dtype):
    name = jnp.dtype(dtype).name
    with pytest.raises(
        ValueError,
        match=rf"{cls.__name__} needs a .*floating.* `dtype`.*got {name}.*jnp.float32",
    ):
        cls(3, 4, dtype=dtype)


def test_rnn_cell_refuses_a_complex_dtype_and_points_to_the_complex_cells():
    with pytest.raises(
        ValueError,
        match=r"RNNCell needs a real floating `dtype`.*got complex64: it has no "
        r"complex parameters.*jnp.concatenate.*GRUCell.*LSTMCell",
    ):
        enn.RNNCell(3, 4, dtype=jnp.complex64)
    for cls in (enn.GRUCell, enn.LSTMCell):
        assert cls(3, 4, dtype=jnp.complex64).weight_ih.value.dtype == jnp.complex64


@pytest.mark.parametrize(
    "batch_size, shape",
    [
        (np.int64(8), (8,)),
        (np.prod((2, 4)), (8,)),
        (jnp.array(8), (8,)),
        ((np.int32(2), jnp.array(3)), (2, 3)),
        (np.array([2, 3]), (2, 3)),
    ],
)
@pytest.mark.parametrize("cls", [enn.GRUCell, enn.LSTMCell, enn.RNNCell])
def test_batch_size_may_be_any_integer(cls, batch_size, shape):
    cell = cls(3, 4, batch_size=batch_size)
    assert cell.hidden.value.shape == (*shape, 4)
    assert all(type(n) is int for n in cell.hidden.value.shape)
    cell = cls(3, 4)
    cell.reset(batch_size=batch_size)
    assert cell.hidden.value.shape == (*shape, 4)
    assert cell(jnp.zeros((*shape, 3))).shape == (*shape, 4)


def test_cells_refuse_non_positive_sizes():
    with pytest.raises(ValueError, match="GRUCell's `hidden_size` must be a positive"):
        enn.GRUCell(3, 0)
    with pytest.raises(ValueError, match="RNNCell's `batch_size` must be a positive"):
        enn.RNNCell(3, 2, batch_size=0)
    with pytest.raises(ValueError, match="LSTMCell's `batch_size` must be a positive"):
        enn.LSTMCell(3, 2).reset(batch_size=(2, 0))


# --- Equinox conventions and strict promotion -------------------------------------------


def test_layers_compose_in_eqx_sequential_with_and_without_a_key(getkey):
    key = getkey()
    model = eqx.nn.Sequential(
        [
            enn.BatchNorm(3),
            enn.Dropout(0.5),
            eqx.nn.Lambda(jnp.tanh),
        ]
    )
    x = jr.normal(getkey(), (16, 3))
    y_key = model(x, key=key)
    # With a key, Dropout uses the key that `Sequential` hands it, as `eqx.nn.Dropout`.
    bn_out = enn.BatchNorm(3)(x)
    dropout_key = jr.split(key, 3)[1]
    expected = jnp.tanh(eqx.nn.Dropout(0.5)(bn_out, key=dropout_key))
    assert tree_allclose(y_key, expected, **_TOL)
    # Without a key, the default random state is used and advances.
    before = es.random.get_key()
    assert model(x).shape == (16, 3)
    assert not tree_bitwise_equal(es.random.get_key(), before)
    assert model(x, key=key).shape == (16, 3)
    # `eqx.nn.inference_mode` switches every layer; the states are shared.
    inference = eqx.nn.inference_mode(model)
    bn = model.layers[0]
    expected = jnp.tanh(bn(x, inference=True))
    assert tree_bitwise_equal(inference(x, key=key), expected)


@pytest.mark.parametrize("cls", [enn.GRUCell, enn.LSTMCell, enn.RNNCell])
def test_cells_take_a_key_and_run_in_eqx_sequential(getkey, cls):
    cell = cls(3, 4, key=getkey())
    model = eqx.nn.Sequential([eqx.nn.Linear(3, 3, key=getkey()), cell])
    x = jr.normal(getkey(), (3,))
    h = model(x, key=getkey())
    assert tree_bitwise_equal(h, cell.hidden.value) and h.shape == (4,)


@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
def test_layers_pass_strict_dtype_and_rank_promotion(getkey, state_dtype):
    bn = enn.BatchNorm(3, dtype=state_dtype)
    dropout = enn.Dropout(0.3)
    cells = [
        cls(3, 4, batch_size=5, key=getkey())
        for cls in (enn.GRUCell, enn.LSTMCell, enn.RNNCell)
    ]
    x = jr.normal(getkey(), (5, 3))
    with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
        y = bn(x)
        bn(x, inference=True)
        assert bn(jnp.arange(15).reshape(5, 3)).dtype == state_dtype  # int inputs
        dropout(x)
        for cell in cells:
            assert cell(x).shape == (5, 4)
    assert y.dtype == jnp.float32  # as with standard promotion
    assert bn.running_mean.value.dtype == state_dtype


@pytest.mark.parametrize("per_lane", (4, 3))
def test_batch_norm_trains_per_lane_under_jax_vmap_over_run(per_lane):
    # Each lane a batch of its own (per-task statistics): a square batch of 3
    # examples of 3 features is a batch, not one example.
    bn = enn.BatchNorm(3)
    values = es.values_of(bn)
    xs = jr.normal(jr.key(0), (2, per_lane, 3))
    new, ys = jax.vmap(lambda x: es.run(bn, values, x))(xs)
    for lane in range(2):
        want = (1 - bn.momentum) * xs[lane].mean(axis=0)  # from zeros
        assert tree_allclose(new[bn.running_mean][lane], want, rtol=1e-5, atol=1e-6)
