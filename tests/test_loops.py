import io

import eqstate as es
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest

from .helpers import tree_allclose, tree_bitwise_equal, unchecked


pytestmark = pytest.mark.usefixtures("tracing_mode")


def test_scan_matches_lax(getkey):
    xs = jr.normal(getkey(), (5, 3))
    count = es.ShortTermState(jnp.array(0))

    def step(carry, x):
        count.value = count.value + 1
        return carry + x, carry

    def pure_step(carry_and_count, x):
        carry, n = carry_and_count
        return (carry + x, n + 1), carry

    final, ys = es.transform.scan(step, jnp.zeros(3), xs)
    (final2, n2), ys2 = jax.lax.scan(pure_step, (jnp.zeros(3), 0), xs)
    assert tree_allclose((final, ys), (final2, ys2))
    assert count.value == n2


def test_scan_reads_states_as_constants_and_reports_them(getkey):
    w = es.ParamState(jr.normal(getkey(), (3, 3)))
    h = es.ShortTermState(jnp.zeros(3))
    xs = jr.normal(getkey(), (4, 3))

    def step(_, x):
        h.value = jnp.tanh(w.value @ h.value + x)
        return None, h.value

    sf = es.transform.StatefulFunction(lambda xs: es.transform.scan(step, None, xs)[1])
    sf.make_jaxpr(xs)
    assert sf.get_read_states() == (w,) and sf.get_write_states() == (h,)
    hs = sf(xs)
    ref, wv = jnp.zeros(3), w.value
    for i in range(4):
        ref = jnp.tanh(wv @ ref + xs[i])
        assert tree_allclose(hs[i], ref, atol=1e-5)


def test_scan_reverse_length_and_no_xs():
    total = es.State(jnp.array(0))

    def step(c, _):
        total.value = total.value + c
        return c + 1, c

    c, ys = es.transform.scan(step, 0, None, length=4)
    assert c == 4 and total.value == 6 and (ys == jnp.arange(4)).all()
    _, ys = es.transform.scan(lambda c, x: (c, x * 2), 0, jnp.arange(3), reverse=True)
    assert (ys == jnp.arange(3) * 2).all()


def test_scan_with_weakly_typed_states_keeps_the_carry_type():
    n = es.State(0)  # a weakly typed int32
    f = es.State(0.0)

    def step(c, x):
        n.value = n.value + 1
        f.value = f.value + x
        return c, None

    es.transform.scan(step, None, jnp.arange(3.0))
    assert n.value == 3 and f.value == 3.0


def _bf16_times(state):
    with jax.numpy_dtype_promotion("standard"):
        return (jnp.ones(2, jnp.bfloat16) * state.value).dtype


_WEAK_CASES = {
    "scan": lambda s: es.transform.scan(
        lambda c, x: (setattr(s, "value", s.value + 1.0), (c, None))[1], None, None, 3
    ),
    "while_loop": lambda s: es.transform.while_loop(
        lambda i: i < 3, lambda i: (setattr(s, "value", s.value * 2.0), i + 1)[1], 0
    ),
    "while_loop, no iteration": lambda s: es.transform.while_loop(
        lambda i: i < 0, lambda i: (setattr(s, "value", s.value * 2.0), i + 1)[1], 0
    ),
    "cond, the branch that writes not taken": lambda s: es.transform.cond(
        False, lambda: setattr(s, "value", s.value + 1.0), lambda: None
    ),
    "map with batch_size": lambda s: es.transform.map(
        lambda x: setattr(s, "value", 2.0), jnp.ones(5), batch_size=2
    ),
}


@pytest.mark.parametrize("case", sorted(_WEAK_CASES))
@pytest.mark.parametrize("jitted", [False, True])
def test_a_weakly_typed_state_stays_weak_through_loops_and_conditionals(case, jitted):
    # As `jax.lax` keeps a weak carry: a state made from a Python float keeps
    # promoting as one (bfloat16 * it stays bfloat16).
    s = es.State(1.0, name="s")
    run = _WEAK_CASES[case]
    if jitted:
        es.transform.jit(lambda: run(s))()
    else:
        run(s)
    assert s.value.weak_type and _bf16_times(s) == jnp.bfloat16
    strong = es.State(jnp.float32(1.0), name="strong")  # strong stays strong
    run(strong)
    assert not strong.value.weak_type and _bf16_times(strong) == jnp.float32


def test_a_weakly_typed_state_written_strongly_in_a_loop_ends_strong():
    s = es.State(1.0, name="s")
    es.transform.for_loop(
        lambda x: setattr(s, "value", s.value + x), jnp.ones(3, jnp.float32)
    )
    assert s.value == 4.0 and not s.value.weak_type


def test_for_loop_outputs_promote_with_a_weak_state_as_under_disable_jit():
    s = es.State(1.0, name="s")

    def body(x):
        s.value = s.value + 1.0
        with jax.numpy_dtype_promotion("standard"):
            return x * s.value

    xs = jnp.ones(3, jnp.bfloat16)
    assert es.transform.for_loop(body, xs).dtype == jnp.bfloat16
    with jax.disable_jit():
        assert es.transform.for_loop(body, xs).dtype == jnp.bfloat16


def test_for_loop_stacks_outputs_and_writes_states():
    h = es.ShortTermState(jnp.array(0.0))

    def step(x, y):
        h.value = 0.5 * h.value + x * y
        return h.value

    hs = es.transform.for_loop(step, jnp.ones(3), jnp.full(3, 2.0))
    assert tree_allclose(hs, jnp.array([2.0, 3.0, 3.5])) and h.value == 3.5


def test_progress_bar_prints_from_inside_the_compiled_loop():
    out = io.StringIO()
    bar = es.transform.ProgressBar(freq=2, desc="loop", file=out)
    es.transform.jit(lambda xs: es.transform.for_loop(lambda x: x, xs, pbar=bar))(
        jnp.arange(6.0)
    )
    jax.effects_barrier()
    text = out.getvalue()
    assert "loop: 2/6" in text and "loop: 6/6" in text and "loop: 1/6" not in text


@pytest.mark.parametrize("disable_jit", (False, True))
def test_progress_bar_counts_forwards_in_a_reversed_scan(disable_jit):
    out = io.StringIO()
    bar = es.transform.ProgressBar(freq=5, desc="loop", file=out)
    with jax.disable_jit(disable_jit):
        es.transform.scan(
            lambda c, x: (c + x, x), 0.0, jnp.arange(10.0), reverse=True, pbar=bar
        )
    jax.effects_barrier()
    assert (
        out.getvalue()
        == f"loop: 5/10 [{'#' * 15}{'-' * 15}]\rloop: 10/10 [{'#' * 30}]\n"
    )


def test_progress_bar_refuses_a_bad_frequency():
    with pytest.raises(ValueError, match="positive"):
        es.transform.ProgressBar(freq=0)


def test_while_loop_matches_lax():
    steps = es.State(jnp.array(0))
    limit = es.State(jnp.array(100.0))

    def body(x):
        steps.value = steps.value + 1
        return x * 2

    out = es.transform.while_loop(lambda x: x < limit.value, body, 1.0)
    ref = jax.lax.while_loop(lambda x: x < 100.0, lambda x: x * 2, 1.0)
    assert out == ref and steps.value == 7 and limit.value == 100.0


def test_while_loop_condition_may_not_write():
    s = es.State(jnp.array(0), name="s")

    def cond(x):
        s.value = s.value + 1
        return x < 3

    with pytest.raises(ValueError, match="`cond_fun` of `while_loop` writes State 's'"):
        es.transform.while_loop(cond, lambda x: x + 1, 0)
    assert s.value == 0


def test_bounded_while_loop_is_reverse_differentiable():
    w = es.ParamState(jnp.array(1.5))

    def f(x):
        return es.transform.bounded_while_loop(
            lambda v: v < 10.0, lambda v: v * w.value, x, 16
        )

    grads = es.transform.grad(f, grad_states=[w], argnums=0)(1.0)
    # 1.5**6 = 11.39 > 10: six steps, so f = x * w**6.
    (gw, gx) = grads
    assert f(1.0) == pytest.approx(1.5**6)
    assert gw[w] == pytest.approx(6 * 1.5**5) and gx == pytest.approx(1.5**6)


def test_bounded_while_loop_stops_at_max_steps():
    calls = es.State(jnp.array(0))

    def body(v):
        calls.value = calls.value + 1
        return v + 1

    assert es.transform.bounded_while_loop(lambda v: v < 100, body, 0, 5) == 5
    assert calls.value == 5


_PROMOTION_CASES = {
    "strong body": (lambda v: v * jnp.float32(2), 1.0),
    "weak body": (lambda v: v * 2, 1.0),
    "int to float": (lambda v: v * 2.5, 1),
    "bfloat16 body": (lambda v: (v * 2).astype(jnp.bfloat16), 1.0),
    "tuple": (lambda v: (v[0] * jnp.float32(2), v[1] + 1), (1.0, jnp.int32(0))),
}


@pytest.mark.parametrize("case", sorted(_PROMOTION_CASES))
@pytest.mark.parametrize("max_steps", (0, 8))
def test_bounded_while_loop_result_has_the_types_of_lax_while_loop(case, max_steps):
    body, init = _PROMOTION_CASES[case]

    def cond(v):
        return jax.tree.leaves(v)[0] < 10

    got = es.transform.bounded_while_loop(cond, body, init, max_steps)
    expected = jax.lax.while_loop(cond, body, init)
    assert jax.tree.map(jax.typeof, got) == jax.tree.map(jax.typeof, expected)
    if max_steps:
        assert tree_allclose(got, expected)


def test_states_cannot_be_created_in_a_loop_body():
    def step(c, x):
        es.State(jnp.zeros(()), name="new")
        return c, x

    with pytest.raises(
        ValueError, match=r"body of `scan` creates states \(State 'new'\)"
    ):
        es.transform.scan(step, 0, jnp.arange(3))


def test_body_must_return_a_pair():
    with pytest.raises(TypeError, match="must return a pair"):
        es.transform.scan(lambda c, x: c, 0, jnp.arange(3))


@pytest.mark.parametrize("disable_jit", (False, True))
def test_body_may_return_a_list_pair_like_lax(disable_jit):
    total = es.State(jnp.array(0.0))

    def step(c, x):
        total.value = total.value + x
        return [c + x, x * 2]

    with jax.disable_jit(disable_jit):
        got = es.transform.scan(step, 0.0, jnp.arange(3.0))
    expected = jax.lax.scan(lambda c, x: [c + x, x * 2], 0.0, jnp.arange(3.0))
    assert tree_allclose(tuple(got), tuple(expected))
    assert total.value == 3.0


class _Counter(eqx.Module):
    n: int
    x: jax.Array


_STATIC_CHANGING_LOOPS = {
    "scan": lambda body, c: es.transform.scan(
        lambda c, _: (body(c), None), c, length=2
    ),
    "checkpointed_scan": lambda body, c: es.transform.checkpointed_scan(
        lambda c, _: (body(c), None), c, length=2
    ),
    "while_loop": lambda body, c: es.transform.while_loop(lambda c: c.x < 2, body, c),
    "bounded_while_loop": lambda body, c: es.transform.bounded_while_loop(
        lambda c: c.x < 2, body, c, 2
    ),
}


@pytest.mark.parametrize("loop", sorted(_STATIC_CHANGING_LOOPS))
def test_a_loop_body_changing_a_python_number_in_a_module_carry_says_what_to_do(loop):
    def body(c):
        return _Counter(c.n + 1, c.x + 1)

    with pytest.raises(TypeError) as error:
        _STATIC_CHANGING_LOOPS[loop](body, _Counter(0, jnp.array(0.0)))
    message = str(error.value)
    assert ".n` is a Python number in a field of an `eqx.Module`" in message
    assert f"`{loop}` changed it from 0 to 1" in message
    assert "`jnp.asarray(0)`" in message
    assert "_Static" not in message


def test_a_carry_of_another_type_is_named_at_its_place_in_the_users_carry():
    s = es.State(jnp.array(0), name="s")

    def step(c, x):
        s.value = s.value + 1
        return (c[0], c[1].astype(jnp.float32)), None  # int32 made float32

    with pytest.raises(
        TypeError,
        match=r"The body of `scan` takes `carry\[1\]` as i32\[\] but returns it as "
        r"f32\[\].*`\.astype\(jnp\.int32\)`",
    ):
        es.transform.scan(step, (0.0, jnp.int32(1)), length=2)
    with pytest.raises(TypeError, match=r"takes `val` as f32\[2\] but returns it as"):
        es.transform.while_loop(lambda v: v[0] < 3, lambda v: v[:1] + 1, jnp.zeros(2))
    with pytest.raises(TypeError, match=r"structure PyTreeDef\(\*\) but returns"):
        es.transform.scan(lambda c, x: ((c,), None), 0.0, length=2)
    assert s.value == 0
    # A weakly typed carry may come back in the dtype it promotes to, as in JAX.
    add = lambda c, x: (c + x, None)  # noqa: E731
    xs = jnp.ones(3, jnp.float16)
    final, _ = es.transform.scan(add, 0.0, xs)
    assert tree_bitwise_equal(final, jax.lax.scan(add, 0.0, xs)[0])


def test_a_write_with_extra_leading_axes_in_a_loop_hints_at_reducing_them():
    total = es.State(jnp.array(0.0), name="total")

    def step(c, x):
        total.value = total.value + x  # `x` has shape (2,): a forgotten `.sum()`
        return c, None

    with pytest.raises(es.StateValueError) as error:
        es.transform.scan(step, None, jnp.ones((3, 2)))
    message = str(error.value)
    assert "State 'total'" in message
    assert "extra leading axes (2,): reduce or index them away" in message
    assert "if they are batch axes" in message


def test_failure_in_a_loop_keeps_values():
    s = es.State(jnp.array(0))

    def step(c, x):
        s.value = s.value + 1
        return c, jnp.zeros(2) @ jnp.zeros(3)

    with pytest.raises(TypeError):
        es.transform.scan(step, 0, jnp.arange(3))
    assert s.value == 0


def test_scan_runs_its_body_eagerly_under_disable_jit_like_lax(capsys):
    total = es.State(jnp.array(0.0), name="total")

    def step(carry, x):
        print("x =", float(x))  # needs a concrete value
        total.value = total.value + x
        return carry + x, total.value

    def pure_step(carry_and_total, x):
        carry, t = carry_and_total
        return (carry + x, t + x), t + x

    xs = jnp.arange(3.0)
    with jax.disable_jit():
        final, ys = es.transform.scan(step, 0.0, xs, reverse=True)
        (final2, t2), ys2 = jax.lax.scan(pure_step, (0.0, 0.0), xs, reverse=True)
    assert capsys.readouterr().out == "x = 2.0\nx = 1.0\nx = 0.0\n"
    assert tree_allclose((final, ys), (final2, ys2)) and total.value == t2


def test_for_loop_and_progress_bar_run_eagerly_under_disable_jit():
    h = es.ShortTermState(jnp.array(0.0), name="h")
    out = io.StringIO()

    def step(x):
        h.value = 0.5 * h.value + float(x)
        return h.value

    with jax.disable_jit():
        hs = es.transform.for_loop(
            step, jnp.ones(4), pbar=es.transform.ProgressBar(freq=2, file=out)
        )
    assert (hs == jnp.array([1.0, 1.5, 1.75, 1.875])).all() and h.value == 1.875
    assert "4/4" in out.getvalue()


def test_while_loops_run_eagerly_under_disable_jit():
    steps = es.State(jnp.array(0), name="steps")

    def body(x):
        steps.value = steps.value + 1
        return x + float(x)  # needs a concrete value

    with jax.disable_jit():
        assert es.transform.while_loop(lambda x: x < 10, body, 1.0) == 16.0
        assert es.transform.bounded_while_loop(lambda x: x < 10, body, 1.0, 2) == 4.0
        assert es.transform.bounded_while_loop(lambda x: x < 10, body, 1.0, 0) == 1.0
    assert steps.value == 6


@pytest.mark.parametrize("max_steps", (0, 3))
@pytest.mark.parametrize("init", (1.0, 5.0))
def test_bounded_while_loop_returns_arrays_under_disable_jit(max_steps, init):
    def cond(v):
        return v < 3

    def body(v):
        return 4.0

    with jax.disable_jit():
        got = es.transform.bounded_while_loop(cond, body, init, max_steps)
        expected = es.transform.while_loop(cond, body, init) if max_steps else init
    assert isinstance(got, jax.Array)
    assert jax.typeof(got) == jax.typeof(expected) and got == expected


@pytest.mark.parametrize(
    "loop",
    (
        es.transform.while_loop,
        lambda cond, body, init: es.transform.bounded_while_loop(cond, body, init, 5),
    ),
    ids=("while_loop", "bounded_while_loop"),
)
def test_while_loops_give_their_functions_arrays_under_disable_jit(loop):
    # As `jax.lax.while_loop` does, and as they are given under `jit`: a body that
    # uses array methods runs the same either way.
    seen = []

    def cond(v):
        seen.append(type(v))
        return v < 3

    def body(v):
        seen.append(type(v))
        return 1 if v == 0 else (v + 1).astype(jnp.int32)

    with jax.disable_jit():
        got = loop(cond, body, 0)
    assert got == 3 and isinstance(got, jax.Array)
    assert len(seen) >= 7 and all(issubclass(t, jax.Array) for t in seen)


def test_while_loop_under_disable_jit_falls_back_when_a_transform_needs_it():
    # As `jax.lax.while_loop`: inside `jax.vmap` the condition has no Python value.
    def count_to(limit):
        return es.transform.while_loop(lambda x: x < limit, lambda x: x + 1.0, 0.0)

    with jax.disable_jit():
        out = jax.vmap(count_to)(jnp.array([1.0, 3.0]))
        ref = jax.vmap(
            lambda n: jax.lax.while_loop(lambda x: x < n, lambda x: x + 1.0, 0.0)
        )(jnp.array([1.0, 3.0]))
    assert (out == ref).all()


def test_an_eager_loop_that_fails_leaves_the_states_as_they_were():
    total = es.State(jnp.array(0.0), name="total")

    def step(carry, x):
        total.value = total.value + 1
        if float(x) == 2.0:
            raise RuntimeError("third step")
        return carry, x

    with jax.disable_jit(), pytest.raises(RuntimeError, match="third step"):
        es.transform.scan(step, 0, jnp.arange(4.0))
    assert total.value == 0.0


def test_an_eager_loop_body_may_not_create_states():
    with jax.disable_jit(), pytest.raises(ValueError, match="body of `scan` creates"):
        es.transform.scan(lambda c, x: (es.State(x).name and c, x), 0, jnp.ones(2))


@pytest.mark.parametrize("disable_jit", (False, True))
def test_bounded_while_loop_condition_may_not_write(disable_jit):
    w = es.State(jnp.array(0), name="w")

    def cond(x):
        w.value = w.value + 1
        return x < 3

    with jax.disable_jit(disable_jit):
        with pytest.raises(ValueError, match="`cond_fun` of `bounded_while_loop`"):
            es.transform.bounded_while_loop(cond, lambda x: x + 1, 0, 5)
    assert w.value == 0


@pytest.mark.parametrize("disable_jit", (False, True))
def test_while_loop_condition_may_read_states(disable_jit):
    limit = es.State(jnp.array(3), name="limit")
    with jax.disable_jit(disable_jit):
        got = es.transform.while_loop(lambda x: x < limit.value, lambda x: x + 1, 0)
        bounded = es.transform.bounded_while_loop(
            lambda x: x < limit.value, lambda x: x + 1, 0, 10
        )
    assert got == 3 and bounded == 3


@pytest.mark.parametrize("max_steps", (2.5, "3", None))
def test_bounded_while_loop_needs_an_integer_max_steps(max_steps):
    with pytest.raises(TypeError, match="`max_steps` must be a non-negative integer"):
        unchecked(es.transform.bounded_while_loop)(
            lambda v: v < 3, lambda v: v + 1, 0, max_steps
        )


def test_for_loop_needs_operands():
    with pytest.raises(ValueError, match="`for_loop` needs operands"):
        es.transform.for_loop(lambda: 1)


@pytest.mark.parametrize(
    "xs, match",
    (
        ({"a": jnp.float32(1.0)}, r"`xs\['a'\]` is a scalar"),
        ((jnp.ones(2), jnp.ones(3)), r"`xs\[0\]` has 2, `xs\[1\]` has 3"),
    ),
)
def test_scan_names_the_leaf_without_the_loop_axis(xs, match):
    with pytest.raises(ValueError, match=match):
        es.transform.scan(lambda c, x: (c, x), 0, xs)
    with pytest.raises(ValueError, match=match.replace("`xs", r"`operands\[0\]")):
        es.transform.for_loop(lambda x: x, xs)


def test_scan_length_must_agree_with_xs():
    with pytest.raises(ValueError, match="`xs` has 2, `length` has 3"):
        es.transform.scan(lambda c, x: (c, x), 0, jnp.ones(2), length=3)


def test_scan_refuses_a_progress_bar_that_is_not_one():
    with pytest.raises(TypeError, match="`pbar` must be an"):
        unchecked(es.transform.scan)(
            lambda c, x: (c, x), 0, jnp.ones(3), pbar="invalid"
        )


@pytest.mark.parametrize("transform", ["grad", "jacrev", "vjp", "jit(grad)"])
def test_reverse_mode_through_while_loop_points_to_bounded_while_loop(transform):
    w = es.ParamState(jnp.array(2.0), name="w")

    def f(x):
        return es.transform.while_loop(lambda v: v < 10, lambda v: v * w.value, x)

    T = es.transform
    calls = {
        "grad": lambda: T.grad(f, grad_states=w)(1.0),
        "jacrev": lambda: T.jacrev(f, grad_states=w)(1.0),
        "vjp": lambda: T.vjp(f, 1.0, grad_states=w)[1](1.0),
        "jit(grad)": lambda: T.jit(T.grad(f, grad_states=w))(1.0),
    }
    with pytest.raises(
        ValueError,
        match=r"(?s)Reverse-mode differentiation does not work.*"
        r"`eqstate.transform.bounded_while_loop\(cond_fun, body_fun, init, max_steps\)`",
    ):
        calls[transform]()
    assert w.value == 2.0
