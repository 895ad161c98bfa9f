import eqstate as es
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from hypothesis import given, settings

from .helpers import tree_allclose, unchecked


def _pure(x):
    return {"sum": jnp.sum(x * 2.0), "tail": jnp.sin(x[1:])}


@settings(max_examples=40)
@given(
    n=st.integers(0, 12),
    batch_size=st.one_of(st.none(), st.integers(1, 14)),
    seed=st.integers(0, 2**16),
)
def test_map_equals_lax_map_on_pure_functions(n, batch_size, seed):
    xs = jr.normal(jr.key(seed), (n, 3))
    got = es.transform.map(_pure, xs, batch_size=batch_size)
    expected = jax.lax.map(_pure, xs, batch_size=batch_size)
    assert tree_allclose(got, expected, rtol=1e-6)


@pytest.mark.parametrize("batch_size", (None, 1, 2, 4, 9))
def test_map_of_several_operands_equals_lax_map(getkey, batch_size):
    a, b = jr.normal(getkey(), (7, 2)), jr.normal(getkey(), (7,))
    got = es.transform.map(lambda x, y: x * y, a, b, batch_size=batch_size)
    expected = jax.lax.map(lambda t: t[0] * t[1], (a, b), batch_size=batch_size)
    assert tree_allclose(got, expected)


@pytest.mark.parametrize("batch_size", (None, 1, 2, 3, 5, 8))
def test_map_reads_states_and_keeps_the_last_elements_write(getkey, batch_size):
    w = es.ParamState(jr.normal(getkey(), (3,)), name="w")
    last = es.ShortTermState(jnp.zeros(3), name="last")
    xs = jr.normal(getkey(), (5, 3))

    def f(x):
        last.value = w.value * x
        return jnp.sum(last.value)

    w0 = w.value
    ys = es.transform.map(f, xs, batch_size=batch_size)
    assert tree_allclose(ys, jax.lax.map(lambda x: jnp.sum(w0 * x), xs))
    assert tree_allclose(last.value, w0 * xs[-1]) and (w.value == w0).all()


def test_sequential_map_carries_writes_from_element_to_element():
    count = es.State(jnp.array(0), name="count")

    def f(x):
        count.value = count.value + 1
        return x * count.value.astype(x.dtype)

    ys = es.transform.map(f, jnp.ones(4))
    assert (ys == jnp.arange(1.0, 5.0)).all() and count.value == 4


def test_batched_map_refuses_a_state_carried_from_element_to_element():
    count = es.State(jnp.array(0), name="count")

    def f(x):
        count.value = count.value + 1
        return x

    with pytest.raises(ValueError, match="State 'count' may carry a value from one"):
        es.transform.map(f, jnp.ones(4), batch_size=2)
    assert count.value == 0


def _write_in_jit(state, value):
    es.transform.jit(lambda v: setattr(state, "value", v))(value)


def _write_in_checkpoint(state, value):
    es.transform.checkpoint(lambda v: setattr(state, "value", v))(value)


def _write_in_both_branches(state, value):
    es.transform.cond(
        value > 2,
        lambda: setattr(state, "value", value),
        lambda: setattr(state, "value", -value),
    )


@pytest.mark.parametrize(
    "write", (_write_in_jit, _write_in_checkpoint, _write_in_both_branches)
)
def test_batched_map_allows_a_state_overwritten_in_a_nested_transform(write):
    last = es.State(jnp.zeros(()), name="last")

    def f(x):
        write(last, x * 2)
        return last.value + x

    xs = jnp.arange(5.0)
    ys = es.transform.map(f, xs)
    sequential = last.value
    last.value = jnp.zeros(())
    assert (es.transform.map(f, xs, batch_size=2) == ys).all()
    assert last.value == sequential


@pytest.mark.parametrize(
    "write",
    (
        lambda s: es.transform.jit(lambda: setattr(s, "value", s.value + 1))(),
        lambda s: es.transform.cond(
            True, lambda: setattr(s, "value", jnp.ones(())), lambda: None
        ),
    ),
    ids=("jit", "cond_one_branch"),
)
def test_batched_map_refuses_a_state_carried_through_a_nested_transform(write):
    count = es.State(jnp.zeros(()), name="count")

    def f(x):
        write(count)
        return x

    with pytest.raises(ValueError, match="State 'count' may carry a value from one"):
        es.transform.map(f, jnp.ones(4), batch_size=2)
    assert count.value == 0


def test_batched_map_allows_a_state_written_then_read():
    scratch = es.State(jnp.zeros(()), name="scratch")

    def f(x):
        scratch.value = x * 2
        return scratch.value + 1

    ys = es.transform.map(f, jnp.arange(5.0), batch_size=2)
    assert (ys == jnp.arange(5.0) * 2 + 1).all() and scratch.value == 8.0


def test_batched_map_draws_different_numbers_per_element():
    es.random.seed(0)
    draws = es.transform.map(
        lambda x: es.random.normal(()) + x, jnp.zeros(6), batch_size=4
    )
    assert len(np.unique(np.asarray(draws))) == 6
    again = es.transform.map(
        lambda x: es.random.normal(()) + x, jnp.zeros(6), batch_size=4
    )
    assert not (again == draws).any()  # the key advanced


@pytest.mark.parametrize("batch_size", (2, 5))
def test_batched_map_keeps_the_last_elements_write_to_an_overwritten_key(batch_size):
    rng = es.RandomState(0, name="rng")

    def f(x):
        rng.value = jr.key(x)
        return x

    es.transform.map(f, jnp.arange(5))
    sequential = jr.key_data(rng.value)
    rng.seed(0)
    es.transform.map(f, jnp.arange(5), batch_size=batch_size)
    assert (jr.key_data(rng.value) == sequential).all()


@pytest.mark.parametrize("batch_size", (None, 2, 5))
def test_map_draws_per_element_and_advances_a_key_drawn_from(batch_size):
    rng = es.RandomState(0, name="rng")
    before = jr.key_data(rng.value)
    draws = es.transform.map(
        lambda x: jr.normal(rng.split_key(), ()) + x,
        jnp.zeros(5),
        batch_size=batch_size,
    )
    assert len(np.unique(np.asarray(draws))) == 5
    assert not (jr.key_data(rng.value) == before).all()


def test_batched_map_splits_a_key_the_function_only_reads_as_vmap_does():
    rng = es.RandomState(0, name="rng")
    before = jr.key_data(rng.value)

    def f(x):
        return jr.normal(rng.value) + x

    sequential = es.transform.map(f, jnp.zeros(4))
    assert len(np.unique(np.asarray(sequential))) == 1
    assert (jr.key_data(rng.value) == before).all()
    batched = es.transform.map(f, jnp.zeros(4), batch_size=2)
    assert len(np.unique(np.asarray(batched))) == 4
    assert not (jr.key_data(rng.value) == before).all()
    rng.seed(0)
    vmapped = es.transform.vmap(f)(jnp.zeros(4))
    assert len(np.unique(np.asarray(vmapped))) == 4
    assert not (jr.key_data(rng.value) == before).all()


@pytest.mark.parametrize("batch_size", (None, 3))
def test_map_under_jit_and_grad_matches_lax(getkey, batch_size):
    w = es.ParamState(jr.normal(getkey(), (3,)), name="w")
    xs = jr.normal(getkey(), (7, 3))

    def loss(w_value):
        ys = jax.lax.map(lambda x: jnp.tanh(w_value @ x), xs, batch_size=batch_size)
        return jnp.sum(ys)

    def stateful_loss():
        ys = es.transform.map(
            lambda x: jnp.tanh(w.value @ x), xs, batch_size=batch_size
        )
        return jnp.sum(ys)

    grads = es.transform.jit(es.transform.grad(stateful_loss, grad_states=[w]))()
    assert tree_allclose(grads[w], jax.grad(loss)(w.value), rtol=1e-5)


def test_map_may_not_create_states():
    with pytest.raises(ValueError, match="`map` creates states"):
        es.transform.map(lambda x: es.State(x).value, jnp.ones(3), batch_size=2)
    with pytest.raises(ValueError, match="body of `map` creates states"):
        es.transform.map(lambda x: es.State(x).value, jnp.ones(3))


def test_map_runs_eagerly_under_disable_jit(capsys):
    with jax.disable_jit():
        ys = es.transform.map(lambda x: print(float(x)) or x * 2, jnp.arange(2.0))
    assert capsys.readouterr().out == "0.0\n1.0\n" and (ys == jnp.array([0, 2.0])).all()


@pytest.mark.parametrize(
    "batch_size, error, match",
    (
        (0, ValueError, "positive integer, got 0"),
        (2.5, TypeError, "`batch_size` must be a positive integer or None"),
    ),
)
def test_map_refuses_a_bad_batch_size(batch_size, error, match):
    with pytest.raises(error, match=match):
        unchecked(es.transform.map)(lambda x: x, jnp.ones(3), batch_size=batch_size)


def test_map_needs_arrays_of_one_length():
    with pytest.raises(ValueError, match="`map` needs arrays to map over"):
        es.transform.map(lambda: 1)
    with pytest.raises(ValueError, match=r"`xs\[0\]` has 2, `xs\[1\]` has 3"):
        es.transform.map(lambda x, y: x, jnp.ones(2), jnp.ones(3), batch_size=2)


@pytest.mark.parametrize("batch_size", (None, 2, 5))
def test_map_over_a_stacked_model_holding_handles(getkey, batch_size):
    import equinox as eqx

    class Member(eqx.Module):
        linear: eqx.nn.Linear
        scale: es.ParamState

        def __call__(self, x):
            return self.linear(x) * self.scale.value

    keys = jr.split(getkey(), 5)
    linears = eqx.filter_vmap(lambda k: eqx.nn.Linear(2, 3, key=k))(keys)
    stacked = Member(linears, es.ParamState(jnp.array(2.0), name="scale"))
    x = jr.normal(getkey(), (2,))
    got = es.transform.map(lambda member: member(x), stacked, batch_size=batch_size)
    expected = jax.lax.map(lambda lin: lin(x) * 2.0, linears, batch_size=batch_size)
    assert tree_allclose(got, expected, rtol=1e-6)


def test_an_overwrite_inside_a_nested_loop_is_refused_in_chunks_saying_why():
    # eqstate cannot see through a nested loop that the old value is unused, so it
    # refuses the chunked map, and says that it cannot tell; sequentially it works.
    s = es.State(jnp.array(0.0), name="s")

    def f(x):
        es.transform.for_loop(lambda i: setattr(s, "value", x * i), jnp.arange(3.0))
        return x

    with pytest.raises(ValueError, match="cannot tell that it does not"):
        es.transform.map(f, jnp.arange(5.0), batch_size=2)
    assert s.value == 0
    es.transform.map(f, jnp.arange(5.0))
    assert s.value == 8
