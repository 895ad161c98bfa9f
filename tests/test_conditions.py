import eqstate as es
import equinox as eqx
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .helpers import raises_at_run_time, tree_allclose, unchecked


pytestmark = pytest.mark.usefixtures("tracing_mode")


@pytest.mark.parametrize("pred", [True, False])
def test_cond_matches_lax(pred):
    a = es.State(jnp.array(1.0), name="a")
    b = es.State(jnp.array(10.0), name="b")

    def true_fun(x):
        a.value = a.value + x
        return x * 2

    def false_fun(x):
        b.value = b.value - x
        return x * 3

    out = es.transform.cond(pred, true_fun, false_fun, 2.0)
    ref = jax.lax.cond(pred, lambda x: x * 2, lambda x: x * 3, 2.0)
    assert out == ref
    assert (a.value, b.value) == ((3.0, 10.0) if pred else (1.0, 8.0))


def test_cond_under_jit_with_a_traced_predicate():
    hits = es.State(jnp.array(0))

    def hit(x):
        hits.value = hits.value + 1
        return x

    f = es.transform.jit(lambda x: es.transform.cond(x > 0, hit, lambda x: -x, x))
    assert f(1.0) == 1.0 and f(-2.0) == 2.0 and f(3.0) == 3.0
    assert hits.value == 2


def test_switch_threads_the_union_of_states():
    states = [es.State(jnp.array(0), name=f"s{i}") for i in range(3)]
    reader = es.State(jnp.array(5), name="reader")

    def make(i):
        def branch(x):
            states[i].value = states[i].value + x + reader.value
            return x * i

        return branch

    sf = es.transform.StatefulFunction(
        lambda i, x: es.transform.switch(i, [make(0), make(1), make(2)], x)
    )
    sf.make_jaxpr(1, 1)
    assert set(sf.get_write_states()) == set(states)
    assert sf.get_read_states() == (reader,)
    assert sf(1, 2) == 2 and [int(s.value) for s in states] == [0, 7, 0]
    assert sf(7, 2) == 4 and [int(s.value) for s in states] == [0, 7, 7]


@pytest.mark.parametrize("writer_first", (True, False))
@pytest.mark.parametrize("kind", ("cond", "switch"))
@pytest.mark.parametrize("jitted", (False, True))
def test_every_branch_reads_a_weakly_typed_state_as_on_entry(
    writer_first, kind, jitted
):
    # A branch traced after one that writes a weak state strongly still sees it weak,
    # as `jax.lax.cond` does: bfloat16 * it stays in bfloat16, whatever the order.
    x = jnp.array([3.0], jnp.bfloat16)
    s = es.State(1.3, name="s")  # weakly typed

    def writer(x):
        s.value = jnp.float32(3.0)
        return x

    def reader(x):
        with jax.numpy_dtype_promotion("standard"):
            return (x * s.value).astype(jnp.bfloat16)

    branches = [writer, reader] if writer_first else [reader, writer]
    index = 1 if writer_first else 0  # the reader runs

    def run(index, x):
        if kind == "cond":
            return es.transform.cond(index == 1, *reversed(branches), x)
        return es.transform.switch(index, branches, x)

    out = es.transform.jit(run)(index, x) if jitted else run(index, x)
    with jax.numpy_dtype_promotion("standard"):
        expected = (x * jnp.asarray(1.3)).astype(jnp.bfloat16)
    assert out.dtype == jnp.bfloat16 and (out == expected).all()
    # After it, as after `jax.lax.cond`, the state is strong: a branch writes it so.
    assert not s.value.weak_type and s.value == jnp.float32(1.3)


def test_ifelse_runs_the_first_true_branch():
    def sign(x):
        return es.transform.ifelse(
            [x > 0, x < 0, True], [lambda: 1, lambda: -1, lambda: 0], check_cond=False
        )

    assert [int(sign(v)) for v in (2.0, -3.0, 0.0)] == [1, -1, 0]


@pytest.mark.upstream_leak("eqx.error_if keeps its caller's frames alive")
@raises_at_run_time
def test_ifelse_checks_that_exactly_one_condition_holds():
    f = es.transform.jit(
        lambda x: es.transform.ifelse([x > 0, x > 1], [lambda: 1, lambda: 2])
    )
    assert f(0.5) == 1
    with pytest.raises(eqx.EquinoxRuntimeError, match="exactly one condition"):
        f(2.0)


def test_eager_ifelse_checks_its_conditions_before_running_a_branch():
    ran = []
    branches = [lambda: ran.append(0), lambda: ran.append(1)]
    with pytest.raises(eqx.EquinoxRuntimeError, match="exactly one condition"):
        es.transform.ifelse([jnp.array(True), jnp.array(True)], branches)
    assert ran == []


def test_a_traced_ifelse_check_on_a_tpu_warns_and_takes_the_first_branch(
    monkeypatch,
):
    # A TPU program cannot raise: Equinox's check would wait at a prompt forever.
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.delenv("EQX_ON_ERROR", raising=False)
    f = es.transform.jit(
        lambda x: es.transform.ifelse([x > 0, x > 1], [lambda: 1, lambda: 2])
    )
    with pytest.warns(UserWarning, match="cannot check that exactly one condition"):
        assert f(2.0) == 1


@pytest.mark.upstream_leak("eqx.error_if keeps its caller's frames alive")
@raises_at_run_time
def test_ifelse_with_an_else_branch_and_check_cond_says_to_pass_check_cond_false():
    f = es.transform.jit(
        lambda x: es.transform.ifelse([x > 0, True], [lambda: 1, lambda: 0])
    )
    with pytest.raises(eqx.EquinoxRuntimeError, match=r"pass `check_cond=False`"):
        f(3.0)
    else_branch = es.transform.jit(
        lambda x: es.transform.ifelse(
            [x > 0, True], [lambda: 1, lambda: 0], check_cond=False
        )
    )
    assert else_branch(3.0) == 1 and else_branch(-3.0) == 0


@pytest.mark.parametrize("check_cond", (True, False))
def test_ifelse_refuses_conditions_that_are_not_scalars(check_cond):
    hits = es.State(jnp.array(0))

    def hit():
        hits.value = hits.value + 1
        return 1

    conditions = [jnp.array([False, False]), jnp.array([True, False])]
    with pytest.raises(TypeError, match=r"condition 0 of shape \(2,\)"):
        unchecked(es.transform.ifelse)(
            conditions, [lambda: 0, hit], check_cond=check_cond
        )
    assert hits.value == 0


def test_ifelse_without_a_true_condition_runs_the_first_branch_unchecked():
    out = es.transform.ifelse([False, False], [lambda: 1, lambda: 2], check_cond=False)
    assert out == 1


def test_ifelse_needs_one_condition_per_branch():
    with pytest.raises(ValueError, match="one condition per branch"):
        es.transform.ifelse([True], [lambda: 1, lambda: 2])


def test_branches_must_not_create_states():
    with pytest.raises(ValueError, match="`true_fun` of `cond` creates states"):
        es.transform.cond(True, lambda: es.State(0.0).name, lambda: None)
    with pytest.raises(ValueError, match="`false_fun` of `cond` creates states"):
        es.transform.cond(True, lambda: None, lambda: es.State(0.0).name)
    with pytest.raises(ValueError, match="branch 1 of a conditional creates states"):
        es.transform.switch(0, [lambda: None, lambda: es.State(0.0).name])


def test_branches_with_different_outputs_fail_and_keep_values():
    s = es.State(jnp.array(0))

    def a():
        s.value = s.value + 1
        return jnp.zeros(2)

    with pytest.raises(TypeError):
        es.transform.cond(True, a, lambda: jnp.zeros(3))
    assert s.value == 0


def test_branches_with_different_outputs_fail_naming_the_branch_functions():
    # The user's functions, each as `cond` calls it, and the place in their output
    # (not in what eqstate makes of it).
    def small():
        return {"y": jnp.zeros(2), "n": jnp.int32(0)}

    def big():
        return {"y": jnp.zeros(3), "n": jnp.int32(0)}

    def other_dtype():
        return {"y": jnp.zeros(2), "n": jnp.float32(0)}

    with pytest.raises(
        TypeError,
        match=r"`false_fun` of `cond` \(`.*big`, at test_conditions.py:\d+\) returns "
        r"f32\[3\] at `output\['y'\]`, but `true_fun` of `cond` \(`.*small`, at "
        r"test_conditions.py:\d+\) returns f32\[2\]",
    ):
        es.transform.cond(True, small, big)
    with pytest.raises(
        TypeError, match=r"returns i32\[\] at `output\['n'\]`, but `true_fun` .*f32"
    ):
        es.transform.cond(True, other_dtype, small)
    with pytest.raises(TypeError, match=r"branch 0 of a conditional \(`.*small`"):
        es.transform.switch(0, [small, big])
    with pytest.raises(TypeError, match=r"structure PyTreeDef\(\(\*,\)\), but"):
        es.transform.cond(True, lambda: jnp.zeros(2), lambda: (jnp.zeros(2),))


class _Out(eqx.Module):
    flag: object  # a Python value: static, as for `eqx.filter_jit`


@pytest.mark.parametrize(
    "static", [(True, 1), (1, 1.0), (-0.0, 0.0)], ids=["bool-int", "int-float", "zeros"]
)
def test_branches_returning_static_values_that_are_equal_but_not_the_same_fail(static):
    # `jax.lax.cond` refuses them too; picking one would return a branch's value
    # whatever the predicate.
    a, b = static
    match = (
        rf"`false_fun` of `cond` returns {b!r} at `output.flag`, but `true_fun` of "
        rf"`cond` returns {a!r}: .* Return arrays"
    )
    for pred in (True, jnp.array(True)):
        with pytest.raises(TypeError, match=match):
            es.transform.cond(pred, lambda: _Out(a), lambda: _Out(b))
    with pytest.raises(TypeError, match=rf"branch 0 .* returns {a!r} at `output.flag`"):
        es.transform.switch(1, [lambda: _Out(a), lambda: _Out(b)])
    assert es.transform.cond(True, lambda: _Out(a), lambda: _Out(a)).flag is a


@pytest.mark.parametrize("traced_pred", [False, True])
def test_branches_returning_different_handles_fail_naming_the_branches_and_states(
    traced_pred,
):
    a, b = es.State(jnp.zeros(2), name="a"), es.State(jnp.zeros(2), name="b")

    def choose(pred):
        return es.transform.cond(pred, lambda: (a.value, a), lambda: (a.value, b))

    match = (
        r"`false_fun` of `cond` returns State 'b' at `output\[1\]`, but `true_fun` "
        r"of `cond` returns State 'a'.* Return the state's value \(`state.value`\)"
    )
    with pytest.raises(TypeError, match=match):
        if traced_pred:
            es.transform.jit(choose)(jnp.array(True))
        else:
            choose(jnp.array(True))
    with pytest.raises(TypeError, match=r"returns an array at `output\['s'\]`"):
        es.transform.cond(True, lambda: {"s": a}, lambda: {"s": a.value})
    with pytest.raises(TypeError, match="branch 2 of a conditional returns State 'b'"):
        es.transform.switch(2, [lambda: a, lambda: a, lambda: b])
    assert es.transform.cond(True, lambda: a, lambda: a) is a


def test_branches_returning_the_same_nan_python_float_are_the_same():
    nan = float("nan")
    out = es.transform.cond(jnp.array(True), lambda: _Out(nan), lambda: _Out(nan))
    assert out.flag is nan


def test_cond_matches_lax_under_grad():
    w = es.ParamState(jnp.array(2.0))

    def f(x):
        return es.transform.cond(
            x > 0, lambda x: w.value * x**2, lambda x: -w.value * x, x
        )

    g = es.transform.grad(f, grad_states=[w], argnums=0)
    (gw, gx) = g(3.0)
    assert tree_allclose((gw[w], gx), (9.0, 12.0))
    (gw, gx) = g(-3.0)
    assert tree_allclose((gw[w], gx), (3.0, -2.0))


_VALUES = (-2, -1, -0.25, 0, 0.5, 1, 3, float("nan"), float("inf"))
_DTYPES = ("bool", "int8", "uint8", "int32", "uint32", "float16", "bfloat16", "float32")


def _typed(dtype: str, value: float) -> np.ndarray:
    """`value` as a 0-d NumPy array of `dtype`, taken as that dtype can hold it."""
    kind = np.dtype(jnp.dtype(dtype)).kind
    if kind in "iu" and not np.isfinite(value):
        value = 7
    if kind in "iu":
        value = abs(int(value)) if kind == "u" else int(value)
    return np.asarray(value, dtype=jnp.dtype(dtype))


_PREDICATES = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(_VALUES),
    st.integers(-(2**31), 2**31 - 1),
    st.floats(width=32),
    st.complex_numbers(max_magnitude=4),
    st.text(max_size=2),
    st.builds(_typed, st.sampled_from(_DTYPES), st.sampled_from(_VALUES)),
    st.builds(
        lambda d, v: jnp.asarray(_typed(d, v)),
        st.sampled_from((*_DTYPES, "complex64")),
        st.sampled_from(_VALUES),
    ),
    st.builds(
        lambda v, n: jnp.full((n,), v), st.sampled_from(_VALUES), st.integers(0, 2)
    ),
)


def _outcome(run):
    try:
        return int(run())
    except TypeError:
        return TypeError


@hypothesis.settings(max_examples=150)
@hypothesis.given(pred=_PREDICATES)
def test_cond_takes_the_branch_jax_lax_cond_takes(pred):
    hits = es.State(jnp.array(0), name="hits")

    def true_fun():
        hits.value = hits.value + 1
        return 1

    ours = _outcome(lambda: es.transform.cond(pred, true_fun, lambda: 0))
    assert ours == _outcome(lambda: jax.lax.cond(pred, lambda: 1, lambda: 0))
    assert int(hits.value) == (ours == 1)
    if isinstance(pred, jax.Array):  # the same through a traced predicate
        traced = _outcome(
            lambda: es.transform.jit(
                lambda p: es.transform.cond(p, true_fun, lambda: 0)
            )(pred)
        )
        raw = _outcome(
            lambda: jax.jit(lambda p: jax.lax.cond(p, lambda: 1, lambda: 0))(pred)
        )
        assert traced == raw


@hypothesis.settings(max_examples=100)
@hypothesis.given(index=_PREDICATES)
def test_switch_takes_the_branch_jax_lax_switch_takes(index):
    branches = [lambda: 0, lambda: 1, lambda: 2]
    ours = _outcome(lambda: es.transform.switch(index, branches))
    assert ours == _outcome(lambda: jax.lax.switch(index, branches))


@pytest.mark.parametrize(
    "index",
    (np.uint32(2**31 + 5), np.uint32(2**32 - 1), np.int64(-7), 5, 1, 2**40, -(2**40)),
)
def test_switch_takes_the_branch_jax_lax_switch_takes_under_disable_jit(index):
    branches = [lambda: 0, lambda: 1, lambda: 2]
    compiled = int(es.transform.switch(index, branches))

    def jax_switch():
        try:
            return jax.lax.switch(index, branches)
        except OverflowError:  # JAX 0.12.1 on: a Python int beyond int32
            assert isinstance(index, int) and abs(index) >= 2**31
            return compiled

    with jax.disable_jit():
        assert es.transform.switch(index, branches) == compiled
        assert jax_switch() == compiled
    assert jax_switch() == compiled


@pytest.mark.parametrize("pred", (-1, 0.5, -0.25, jnp.float32(-0.5), jnp.int8(-3)))
def test_cond_reads_a_non_zero_number_as_true(pred):
    assert es.transform.cond(pred, lambda: 1, lambda: 0) == 1
    assert jax.lax.cond(pred, lambda: 1, lambda: 0) == 1


@pytest.mark.parametrize("pred", (2j, None, jnp.complex64(1), jnp.ones(2), "yes"))
def test_cond_refuses_what_jax_lax_cond_refuses(pred):
    hits = es.State(jnp.array(0), name="hits")

    def true_fun():
        hits.value = hits.value + 1
        return 1

    with pytest.raises(TypeError, match="`cond`"):
        unchecked(es.transform.cond)(pred, true_fun, lambda: 0)
    with pytest.raises(TypeError, match=r"[Pp]red"):
        jax.lax.cond(pred, lambda: 1, lambda: 0)
    assert hits.value == 0


def test_cond_and_switch_run_their_branch_eagerly_under_disable_jit(capsys):
    seen = es.State(jnp.array(0.0), name="seen")

    def branch(x):
        print("inside, x =", float(x))  # needs a concrete value
        seen.value = seen.value + x
        return x * 2

    with jax.disable_jit():
        assert es.transform.cond(True, branch, lambda x: x, 2.0) == 4.0
        assert es.transform.switch(5, [lambda x: x, branch], 3.0) == 6.0
    assert capsys.readouterr().out == "inside, x = 2.0\ninside, x = 3.0\n"
    assert seen.value == 5.0


def test_an_eager_branch_that_fails_leaves_the_states_as_they_were():
    seen = es.State(jnp.array(0.0), name="seen")

    def branch():
        seen.value = seen.value + 1
        raise RuntimeError("in the branch")

    with jax.disable_jit(), pytest.raises(RuntimeError, match="in the branch"):
        es.transform.cond(1, branch, lambda: None)
    assert seen.value == 0.0


@pytest.mark.parametrize("disable_jit", (False, True))
def test_a_branch_may_not_create_states_eagerly_or_not(disable_jit):
    # The same error with or without `jax.disable_jit()`, which runs the branch eagerly.
    match = r"`true_fun` of `cond` creates states \(State 'made'\)"
    with jax.disable_jit(disable_jit), pytest.raises(es.NewStateError, match=match):
        es.transform.cond(
            True, lambda: es.State(jnp.zeros(2), name="made").name, lambda: None
        )


def test_a_traced_predicate_under_disable_jit_takes_the_compiled_path():
    # As `jax.lax.cond`: a predicate with no value yet cannot pick a branch in Python.
    scale = es.State(jnp.array(3.0), name="scale")

    def cond(x):
        return es.transform.cond(x > 0, lambda y: y * scale.value, lambda y: -y, x)

    with jax.disable_jit():
        out = es.transform.vmap(cond)(jnp.array([1.0, -2.0]))
    assert (out == jnp.array([3.0, 2.0])).all()
