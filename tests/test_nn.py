"""`eqstate.nn` against `equinox.nn` (used the Equinox way, with an explicit state) and
against plain JAX."""

import functools as ft

import eqstate as es
import eqstate.nn as enn
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest

from .helpers import tree_allclose, tree_bitwise_equal


_TOL = dict(rtol=1e-5, atol=1e-5)


# --- BatchNorm ------------------------------------------------------------------------


def _eqx_batch_norm(num_features, *, momentum, affine=True):
    return eqx.nn.make_with_state(eqx.nn.BatchNorm)(
        num_features,
        "batch",
        momentum=momentum,
        channelwise_affine=affine,
        mode="batch",
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


def test_batch_norm_input_with_the_wrong_feature_size_names_both_sizes():
    bn = enn.BatchNorm(3)
    with pytest.raises(
        ValueError,
        match=r"BatchNorm\(num_features=3\).*got shape \(8, 4\), whose feature "
        r"axis \(axis 1\) has size 4, not 3",
    ):
        bn(jnp.zeros((8, 4)))
    with pytest.raises(ValueError, match=r"got shape \(3,\).*bn\(x\[None\]\)\[0\]"):
        bn(jnp.zeros(3))


def test_batch_norm_refuses_one_value_per_feature_in_training_only():
    bn = enn.BatchNorm(3)
    with pytest.raises(ValueError, match="one value per feature"):
        bn(jnp.zeros((1, 3)))
    assert bn(jnp.zeros((1, 3)), inference=True).shape == (1, 3)


def test_batch_norm_refuses_bad_options():
    with pytest.raises(ValueError, match="positive `num_features`, got 0"):
        enn.BatchNorm(0)
    with pytest.raises(ValueError, match=r"must be in \[0, 1\], got 1.5"):
        enn.BatchNorm(3, momentum=1.5)
    with pytest.raises(ValueError, match="non-negative, got -1"):
        enn.BatchNorm(3, eps=-1.0)


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
    y = dropout(jnp.ones(200_000))
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


@pytest.mark.parametrize("p", [1.0, -0.1, 1.5])
def test_dropout_refuses_p_outside_zero_one(p):
    with pytest.raises(ValueError, match=rf"must be in \[0, 1\), got {p}"):
        enn.Dropout(p)


# --- Recurrent cells ------------------------------------------------------------------


def _eqx_gru_scan(cell, xs, h0):
    def step(h, x):
        h = cell(x, h)
        return h, h

    return jax.lax.scan(step, h0, xs)


def _as_eqx_gru(cell, values=None):
    """An `eqx.nn.GRUCell` holding the parameters of an `enn.GRUCell`."""
    values = es.values_of(cell) if values is None else values
    ref = eqx.nn.GRUCell(
        cell.input_size, cell.hidden_size, cell.use_bias, key=jr.key(0)
    )
    names = ["weight_ih", "weight_hh"] + (["bias", "bias_n"] if cell.use_bias else [])
    return eqx.tree_at(
        lambda m: [getattr(m, n) for n in names],
        ref,
        [values[getattr(cell, n)] for n in names],
    )


@pytest.mark.usefixtures("tracing_mode")
@pytest.mark.parametrize("use_bias", [True, False])
def test_gru_cell_matches_equinox_over_a_sequence(getkey, use_bias):
    key = getkey()
    cell = enn.GRUCell(3, 5, use_bias=use_bias, key=key)
    ref = eqx.nn.GRUCell(3, 5, use_bias, key=key)
    assert tree_bitwise_equal(
        (cell.weight_ih.value, cell.weight_hh.value), (ref.weight_ih, ref.weight_hh)
    )
    if use_bias:
        assert cell.bias is not None and cell.bias_n is not None
        assert tree_bitwise_equal(
            (cell.bias.value, cell.bias_n.value), (ref.bias, ref.bias_n)
        )
    xs = jr.normal(getkey(), (12, 3))
    hs = es.transform.for_loop(cell, xs)
    h_final, ref_hs = _eqx_gru_scan(ref, xs, jnp.zeros(5))
    assert tree_allclose(hs, ref_hs, **_TOL)
    assert tree_allclose(cell.hidden.value, h_final, **_TOL)

    # The hidden state carries on into the next sequence until reset.
    xs2 = jr.normal(getkey(), (4, 3))
    _, ref_hs2 = _eqx_gru_scan(ref, xs2, h_final)
    assert tree_allclose(es.transform.for_loop(cell, xs2), ref_hs2, **_TOL)


def test_gru_cell_with_a_batch_matches_vmapped_equinox(getkey):
    key = getkey()
    cell = enn.GRUCell(3, 5, batch_size=4, key=key)
    ref = eqx.nn.GRUCell(3, 5, key=key)
    xs = jr.normal(getkey(), (6, 4, 3))
    hs = es.transform.for_loop(cell, xs)
    _, ref_hs = jax.vmap(_eqx_gru_scan, in_axes=(None, 1, 0), out_axes=1)(
        ref, xs, jnp.zeros((4, 5))
    )
    assert hs.shape == (6, 4, 5) and tree_allclose(hs, ref_hs, **_TOL)


@pytest.mark.parametrize("cls", [enn.GRUCell, enn.RNNCell])
def test_reset_restores_zeros_and_the_first_run(getkey, cls):
    cell = cls(2, 4, key=getkey())
    xs = jr.normal(getkey(), (5, 2))
    first = es.transform.for_loop(cell, xs)
    assert not (cell.hidden.value == 0).all()
    cell.reset()
    assert tree_bitwise_equal(cell.hidden.value, jnp.zeros(4))
    assert tree_allclose(es.transform.for_loop(cell, xs), first)


@pytest.mark.parametrize("batch_size", [None, 3])
def test_rnn_cell_matches_plain_jax(getkey, batch_size):
    cell = enn.RNNCell(2, 6, batch_size=batch_size, key=getkey())
    shape = (9, 2) if batch_size is None else (9, batch_size, 2)
    xs = jr.normal(getkey(), shape)
    w_ih, w_hh = cell.weight_ih.value, cell.weight_hh.value
    assert cell.bias is not None
    b = cell.bias.value

    def step(h, x):
        h = jnp.tanh(x @ w_ih.T + h @ w_hh.T + b)
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
@pytest.mark.parametrize("cls", [enn.GRUCell, enn.RNNCell])
def test_cells_inside_jit_match_eager(getkey, cls):
    key = getkey()
    eager, jitted = cls(3, 4, key=key), cls(3, 4, key=key)

    @es.transform.jit
    def run(xs):
        jitted.reset()
        return es.transform.for_loop(jitted, xs)

    xs = jr.normal(getkey(), (7, 3))
    assert tree_allclose(run(xs), es.transform.for_loop(eager, xs), **_TOL)
    assert tree_allclose(jitted.hidden.value, eager.hidden.value, **_TOL)
    eager.reset()
    assert tree_allclose(run(xs), es.transform.for_loop(eager, xs), **_TOL)


@pytest.mark.usefixtures("tracing_mode")
def test_gru_cell_gradients_match_equinox(getkey):
    key = getkey()
    cell = enn.GRUCell(3, 4, key=key)
    ref = eqx.nn.GRUCell(3, 4, key=key)
    xs = jr.normal(getkey(), (8, 3))

    def loss():
        cell.reset()
        return jnp.sum(es.transform.for_loop(cell, xs) ** 2)

    @eqx.filter_grad
    def ref_grads(model):
        _, hs = _eqx_gru_scan(model, xs, jnp.zeros(4))
        return jnp.sum(hs**2)

    grads = es.transform.jit(es.transform.grad(loss, grad_states=es.ParamState))()
    expected = ref_grads(ref)
    assert set(grads) == set(es.states_of(cell, es.ParamState))
    assert cell.bias is not None and cell.bias_n is not None
    assert tree_allclose(
        [grads[s] for s in (cell.weight_ih, cell.weight_hh, cell.bias, cell.bias_n)],
        [expected.weight_ih, expected.weight_hh, expected.bias, expected.bias_n],
        **_TOL,
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
        _, ref_hs = _eqx_gru_scan(member, xs, jnp.zeros(4))
        assert tree_allclose(hs[i], ref_hs, **_TOL)
        assert tree_allclose(ensemble.hidden.value[i], ref_hs[-1], **_TOL)


def test_cell_input_of_the_wrong_shape_names_the_cell_and_both_shapes():
    cell = enn.GRUCell(3, 5)
    with pytest.raises(
        ValueError,
        match=r"GRUCell\(input_size=3, hidden_size=5\) takes one time step of shape "
        r"\(3,\), got shape \(4,\).*batch_size=",
    ):
        cell(jnp.zeros(4))
    batched = enn.RNNCell(3, 5, batch_size=2)
    with pytest.raises(
        ValueError,
        match=r"RNNCell\(input_size=3, hidden_size=5, batch_size=2\) takes one time "
        r"step of shape \(2, 3\), got shape \(10, 2, 3\).*for_loop",
    ):
        batched(jnp.zeros((10, 2, 3)))


def test_cells_refuse_non_positive_sizes():
    with pytest.raises(ValueError, match="GRUCell needs a positive `hidden_size`"):
        enn.GRUCell(3, 0)
    with pytest.raises(ValueError, match="RNNCell needs a positive `batch_size`"):
        enn.RNNCell(3, 2, batch_size=0)
