import functools as ft
import re
from typing import Any

import eqstate as es
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest

from .helpers import compilations, raises_at_run_time, traces_per_key, tree_allclose


pytestmark = pytest.mark.usefixtures("tracing_mode")


@pytest.fixture
def rnn(getkey):
    w = es.ParamState(jr.normal(getkey(), (3, 3)) * 0.5, name="w")
    h = es.ShortTermState(jnp.zeros(3), name="h")
    steps = es.ShortTermState(jnp.array(0), name="steps")

    def step(x):
        h.value = jnp.tanh(w.value @ h.value + x)
        steps.value = steps.value + 1
        return h.value.sum()

    def pure(w, h, steps, x):
        h = jnp.tanh(w @ h + x)
        return h.sum(), h, steps + 1

    return step, pure, w, h, steps


def test_jit_matches_plain_jit_of_the_pure_program(rnn, getkey):
    step, pure, w, h, steps = rnn
    jitted = es.transform.jit(step)
    pure_jit = jax.jit(pure)
    ref_h, ref_steps = h.value, steps.value
    for _ in range(4):
        x = jr.normal(getkey(), (3,))
        out = jitted(x)
        ref_out, ref_h, ref_steps = pure_jit(w.value, ref_h, ref_steps, x)
        assert tree_allclose(out, ref_out)
    assert tree_allclose(h.value, ref_h) and steps.value == ref_steps == 4


def test_jit_traces_once_and_steady_calls_take_the_plan_path(rnn, tracing_mode):
    step, _, *_ = rnn
    traces = []

    def counted(x):
        traces.append(1)
        return step(x)

    jitted = es.transform.jit(counted)
    jitted(jnp.ones(3))
    first = jitted.get_cache_stats()
    for _ in range(5):
        jitted(jnp.ones(3))
    # Each call reused the trace, and is counted as a hit.
    stats = jitted.get_cache_stats()
    assert stats["hits"] == first["hits"] + 5
    assert [stats[k] for k in ("misses", "traces")] == [first["misses"], 1]
    assert len(traces) == traces_per_key()


def test_cache_statistics_count_every_call_that_reused_a_trace():
    count = es.State(jnp.array(0), name="count")

    @es.transform.jit
    def step(x):
        count.value = count.value + 1
        return x * 2

    for _ in range(200):
        step(1.0)
    assert step.get_cache_stats()["hits"] == 199
    assert step.get_cache_stats()["misses"] == 1  # reading counts nothing
    step.clear_cache()
    step(1.0)
    step(1.0)
    assert step.get_cache_stats()["hits"] == 1 and count.value == 202


def test_read_only_states_are_not_outputs(rnn):
    step, _, w, h, steps = rnn
    jitted = es.transform.jit(step)
    jitted(jnp.ones(3))
    sf = jitted.stateful_function
    assert sf.get_read_states() == (w,)
    assert set(sf.get_write_states()) == {h, steps}
    assert len(sf.get_jaxpr().jaxpr.outvars) == 3  # out, h, steps


def test_static_arguments(rnn):
    step, *_ = rnn
    calls = []

    def f(x, n):
        calls.append(n)
        return x * n

    jitted = es.transform.jit(f, static_argnums=1)
    assert jitted(2.0, 3) == 6.0 and jitted(2.0, 4) == 8.0 and jitted(2.0, 3) == 6.0
    assert sorted(set(calls)) == [3, 4]
    named = es.transform.jit(f, static_argnames="n")
    assert named(2.0, n=5) == 10.0


def test_decorator_form_and_methods():
    class Counter(eqx.Module):
        n: es.State

        def __init__(self):
            self.n = es.State(jnp.array(0))

        @es.transform.jit
        def tick(self, k):
            self.n.value = self.n.value + k
            return self.n.value

    @es.transform.jit(static_argnums=0)
    def times(k, x):
        return k * x

    assert times(3, 2.0) == 6.0
    c = Counter()
    # `self` holds a handle: a static leaf, whose state is read and written.
    assert c.tick(2) == 2 and c.tick(3) == 5
    assert c.n.value == 5
    other = Counter()
    assert other.tick(1) == 1 and c.n.value == 5  # another module: its own state


def test_lower_and_eval_shape(rnn):
    step, _, w, h, steps = rnn
    jitted = es.transform.jit(step)
    lowered = jitted.lower(jnp.ones(3))
    assert "tanh" in lowered.as_text()
    shape = jitted.eval_shape(jax.ShapeDtypeStruct((3,), jnp.float32))
    assert shape.shape == () and steps.value == 0


def test_a_state_whose_shape_changed_retraces_under_jit():
    w = es.State(jnp.ones(3), name="w")
    jitted = es.transform.jit(lambda: w.value.sum())
    assert jitted() == 3
    with es.scope(es.StateDict({w: jnp.ones(5)})):
        assert jitted() == 5
    assert jitted() == 3


def test_jit_of_a_constructor_gives_fresh_states_each_call(getkey):
    @es.transform.jit
    def make(key):
        return es.ParamState(jr.normal(key, (2,)), name="p")

    a, b = make(getkey()), make(getkey())
    assert a is not b and a.name == "p"
    assert not jnp.allclose(a.value, b.value)


def test_jit_under_an_outer_trace_and_in_a_scope(rnn):
    step, _, w, h, steps = rnn
    jitted = es.transform.jit(step)
    outer = es.transform.StatefulFunction(lambda x: jitted(x) + jitted(x))
    outer(jnp.ones(3))
    assert steps.value == 2
    sd = es.world().filter(w, h, steps)
    with es.scope(sd) as sc:
        jitted(jnp.ones(3))
    assert sc.states is not None and sc.states[steps] == 3 and steps.value == 2


def test_switching_between_argument_shapes_with_different_states():
    a = es.State(jnp.zeros(()), name="a")
    b = es.State(jnp.zeros(()), name="b")

    def f(x):
        target = a if x.shape[0] == 1 else b
        target.value = target.value + x.sum()
        return x

    jitted = es.transform.jit(f)
    for _ in range(3):
        jitted(jnp.ones(1))
        jitted(jnp.ones(2))
    assert a.value == 3 and b.value == 6


def test_failing_jit_keeps_every_value(rnn):
    step, _, w, h, steps = rnn

    def bad(x):
        step(x)
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        es.transform.jit(bad)(jnp.ones(3))
    assert steps.value == 0 and (h.value == 0).all()


@pytest.mark.parametrize("how", ["argnames", "argnums"])
def test_a_static_flag_that_selects_the_written_states_runs_the_branch_it_names(how):
    # The train/eval pattern: only training writes the statistics.
    count = es.State(jnp.array(0), name="count")
    traces = []

    def step(x, train):
        traces.append(train)
        if train:
            count.value = count.value + 1
        return x

    if how == "argnames":
        jitted = es.transform.jit(step, static_argnames="train")
        call = lambda train: jitted(jnp.ones(2), train=train)  # noqa: E731
    else:
        jitted = es.transform.jit(step, static_argnums=1)
        call = lambda train: jitted(jnp.ones(2), train)  # noqa: E731
    call(True)
    call(False)
    assert int(count.value) == 1
    traced = len(traces)
    for _ in range(5):
        call(True)
        call(False)
    assert int(count.value) == 6
    # Each flag keeps its own plan: alternating runs neither branch in Python again.
    assert len(traces) == traced


def test_a_static_argument_that_selects_the_read_states_traces_once_per_value():
    a, b = es.State(jnp.ones(3)), es.State(2 * jnp.ones(3))
    traces = []

    @es.transform.jit(static_argnums=1)
    def h(x, use_a):
        traces.append(use_a)
        return x * (a.value if use_a else b.value)

    x = jnp.ones(3)
    assert (h(x, True) == 1).all() and (h(x, False) == 2).all()
    traced = len(traces)
    for _ in range(5):
        assert (h(x, True) == 1).all() and (h(x, False) == 2).all()
    assert len(traces) == traced


@pytest.mark.parametrize("donate_states", (False, True))
@pytest.mark.parametrize("by", ("position", "name"))
def test_a_string_static_argument_takes_the_compiled_plan(by, donate_states):
    # `mode="train"`: a static value that is not a number. It takes the plan (with
    # donation too) and compiles one program per value.
    a = es.State(jnp.array(0.0), name="a")

    @es.transform.jit(static_argnums=1, donate_states=donate_states)
    def step(x, mode):
        a.value = a.value + x * (2.0 if mode == "train" else 1.0)
        return x * 2

    call = {
        "position": lambda mode: step(1.0, mode),
        "name": lambda mode: step(1.0, mode=mode),
    }[by]
    assert compilations(lambda: call("train")) == 1
    assert compilations(lambda: call("eval")) == 1
    for _ in range(2):
        assert compilations(lambda: call("train")) == 0
        assert compilations(lambda: call("eval")) == 0
    assert float(a.value) == 3 * (2.0 + 1.0)
    assert step.get_cache_stats()["traces"] == 2


@pytest.mark.parametrize("how", ["by name", "by position", "both"])
def test_each_static_value_compiles_one_program(how):
    # A call with static arguments runs a function with them bound: one program per
    # static value (and per spelling of the call, as in `jax.jit`), never a second
    # one for a value that has run before, however the values alternate.
    count = es.State(jnp.array(0), name="count")

    @es.transform.jit(static_argnames=("train", "scale"))
    def step(x, train, scale=1.0):
        if train:
            count.value = count.value + 1
        return x * scale

    x = jnp.ones(2)
    calls = {
        "by name": lambda t, s: step(x, train=t, scale=s),
        "by position": lambda t, s: step(x, t, s),
        "both": lambda t, s: step(x, t, scale=s),
    }[how]
    values = [(True, 1.0), (False, 1.0), (True, -2.0), (True, 1)]
    first = [compilations(lambda t=t, s=s: calls(t, s)) for t, s in values]
    assert first == [1, 1, 1, 1]
    for _ in range(3):
        for t, s in values:
            assert compilations(lambda t=t, s=s: calls(t, s)) == 0
    for t, s in values:
        out = calls(t, s)
        assert (out == s).all() and out.dtype == jnp.float32, (t, s, out)
    assert int(count.value) == 3 * 5  # Three training calls per round, five rounds.


@pytest.mark.parametrize(
    "transform",
    [
        es.transform.jit,
        lambda f: es.transform.grad(f, grad_states=es.ParamState),
        es.transform.checkpoint,
        lambda f: es.transform.StatefulFunction(ft.partial(f, scale=2.0)),
    ],
    ids=["jit", "grad", "checkpoint", "partial"],
)
def test_jax_errors_about_tracers_name_the_users_function(transform):
    # As JAX's message for `jax.jit` names the function it traced, not eqstate's
    # wrapper of it.
    w = es.ParamState(jnp.array(2.0), name="w")

    def branching_loss(x, scale=1.0):
        return w.value * x * scale if x > 0 else -w.value * x

    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        transform(branching_loss)(jnp.array(0.3))
    assert re.search(r"function branching_loss at .*test_jit\.py:\d+", str(info.value))


def test_a_key_error_of_the_function_while_jax_retraces_runs_it_once():
    runs = []

    @es.transform.jit(static_argnums=1)
    def f(x, name):
        runs.append(name)
        return x * {"a": 1.0}[name]

    f(jnp.ones(2), "a")
    runs.clear()
    with pytest.raises(KeyError, match="b"):
        f(jnp.ones(2), "b")
    assert runs == ["b"]


def test_user_errors_while_jax_retraces_are_not_swallowed(rnn):
    def f(x):
        if x.shape[0] == 4:
            raise RuntimeError("only three")
        return x

    jitted = es.transform.jit(f)
    jitted(jnp.ones(3))
    with pytest.raises(RuntimeError, match="only three"):
        jitted(jnp.ones(4))


def test_jit_inside_raw_jit_at_world_level_is_refused(rnn):
    step, *_ = rnn
    jitted = es.transform.jit(step)
    with pytest.raises(es.TraceContextError, match="Cannot read"):
        jax.jit(jitted)(jnp.ones(3))


def test_clear_cache(rnn):
    step, *_ = rnn
    traces = []
    jitted = es.transform.jit(lambda x: traces.append(1) or step(x))
    jitted(jnp.ones(3))
    n = len(traces)
    jitted.clear_cache()
    jitted(jnp.ones(3))
    assert len(traces) == 2 * n


@pytest.mark.upstream_leak("eqx.error_if keeps its caller's frames alive")
@raises_at_run_time
def test_a_runtime_error_runs_the_computation_once():
    runs = []

    def f(x):
        jax.debug.callback(lambda: runs.append(1))
        return eqx.error_if(x, x > 1, "too big")

    jitted = es.transform.jit(f)
    jitted(0.5)
    jax.effects_barrier()
    runs.clear()
    with pytest.raises(eqx.EquinoxRuntimeError, match="too big"):
        jitted(2.0)
    jax.effects_barrier()
    assert len(runs) == 1


def test_jit_options_apply_to_functions_that_create_states():
    bogus = {"xla_no_such_option": True}
    make = es.transform.jit(lambda x: es.ParamState(x * 2), compiler_options=bogus)
    with pytest.raises(Exception, match="xla_no_such_option"):
        make(1.0)


def test_position_options_with_a_function_that_creates_states_are_refused():
    make = es.transform.jit(lambda x: es.ParamState(x * 2), donate_states=True)
    with pytest.raises(
        NotImplementedError, match=r"donate_states=\.\.\..* creates no states"
    ):
        make(1.0)


@pytest.mark.parametrize(
    "options",
    (
        {"donate_argnums": 5},
        {"donate_argnums": (0, -3)},
        {"static_argnums": 4},
        {"static_argnames": "y"},
        {"static_argnums": 0, "donate_argnums": 0},
    ),
    ids=str,
)
def test_jit_refuses_options_beyond_the_signature_as_jax_jit(options):
    def f(x):
        return x

    with pytest.raises(ValueError) as from_jax:
        jax.jit(f, **options)
    with pytest.raises(ValueError, match=re.escape(str(from_jax.value))):
        es.transform.jit(f, **options)


def test_jit_refuses_a_generator_function_as_jax_jit():
    def numbers(x):
        yield x

    with pytest.raises(TypeError, match="got a generator function"):
        es.transform.jit(numbers)
    with pytest.raises(TypeError, match="got a generator function"):
        jax.jit(numbers)


def test_make_jaxpr_names_its_function_as_jax_does():
    def step(x):
        return x

    assert es.transform.make_jaxpr(step).__name__ == jax.make_jaxpr(step).__name__
    assert es.transform.make_jaxpr(step).__name__ == "make_jaxpr(step)"


def test_the_stateful_function_of_a_jit_takes_its_options():
    # `jit`'s options hold for its `stateful_function` too: one set of plans and one
    # flat `jax.jit` per trace, whichever is called first.
    jitted = es.transform.jit(lambda x: es.State(x).value * 2, donate_states=True)
    sf = jitted.stateful_function
    with pytest.raises(NotImplementedError, match="creates no states"):
        sf.jaxpr_call(es.StateDict(), jnp.ones(2))
    with pytest.raises(NotImplementedError, match="creates no states"):
        jitted(jnp.ones(2))

    count = es.ShortTermState(jnp.array(0))

    def step(x):
        count.value = count.value + 1
        return x * 2

    plain = es.transform.jit(step)
    plain(1.0)
    plain.stateful_function(2.0)  # through the same plan: no other trace
    assert count.value == 2
    assert plain.get_cache_stats()["traces"] == 1


class _Scale(eqx.Module):
    value: Any


def _unwrapped(scale):
    return scale.value if isinstance(scale, _Scale) else scale


def _jit_with_a_static_scale(f, how):
    """`jit(f)` of `f(x, scale)`, and a call passing `scale` static as `how` says: by
    position (counted from the start or the end), by name, or as a module field."""
    if how in ("static_argnums", "negative static_argnums"):
        jitted = es.transform.jit(
            f, static_argnums=1 if how == "static_argnums" else -1
        )
        return jitted, lambda x, s: jitted(x, s)
    if how == "static_argnames":
        jitted = es.transform.jit(f, static_argnames="scale")
        return jitted, lambda x, s: jitted(x, scale=s)
    jitted = es.transform.jit(f)
    return jitted, lambda x, s: jitted(x, _Scale(s))


@pytest.mark.parametrize("how", ["static_argnums", "static_argnames", "module field"])
def test_equal_static_values_of_other_types_trace_apart(how):
    # `1 == 1.0 == True`, but they trace to other dtypes (and `is True` tells them
    # apart): as `jax.jit` does, a static value's type is part of the cache key.
    bias = es.ParamState(jnp.zeros(3, jnp.int32))

    def f(x, scale):
        scale = _unwrapped(scale)
        flag = 10 if scale is True else 0
        return x + bias.value + flag, jnp.asarray(scale)  # int32, float32 or bool

    _, call = _jit_with_a_static_scale(f, how)
    x = jnp.arange(3)
    for scale in (1, 1.0, True, 1):
        (got, got_scale), (want, want_scale) = call(x, scale), f(x, scale)
        assert got_scale.dtype == want_scale.dtype and got_scale == want_scale, scale
        assert (got == want).all(), (scale, got, want)


@pytest.mark.parametrize(
    "how",
    ["static_argnums", "negative static_argnums", "static_argnames", "module field"],
)
def test_static_zeros_of_either_sign_trace_apart(how):
    # `0.0 == -0.0`, but `1 / x` tells them apart: a trace made for one must not
    # serve the other (`jax.jit` itself keys them as one).
    offset = es.ParamState(jnp.zeros(()))

    def f(x, scale):
        return x / _unwrapped(scale) + offset.value

    jitted, call = _jit_with_a_static_scale(f, how)
    x = jnp.ones(())
    for scale in (0.0, -0.0, 0.0, -0.0):
        assert call(x, scale) == f(x, scale), scale
    assert jitted.get_cache_stats()["traces"] == 2


def test_a_stateful_function_traces_static_zeros_of_either_sign_apart():
    offset = es.ParamState(jnp.zeros(()))
    sf = es.transform.StatefulFunction(
        lambda x, scale: x / scale + offset.value, static_argnums=1
    )
    for scale in (0.0, -0.0):
        assert sf(jnp.ones(()), scale) == jnp.ones(()) / scale


def test_a_jitted_function_under_vmaps_of_other_sizes_sees_each_axis_size():
    # The size of a named axis is fixed when the function is traced, as in `jax.jit`:
    # a trace made under a `vmap` of 2 must not serve one of 4 (a last short batch).
    calls = es.ShortTermState(jnp.array(0), name="calls")

    @es.transform.jit
    def centred(x):
        calls.value = calls.value + 1
        return x - jax.lax.pmean(x, "batch")

    for n in (2, 4, 2, 3):
        x = jnp.arange(float(n))
        got = es.transform.vmap(centred, axis_name="batch")(x)
        assert got == pytest.approx(x - x.mean()), (n, got)
    assert calls.value == 4

    # Read only, under a raw `vmap`.
    scale = es.ParamState(jnp.float32(1.0), name="scale")
    per_lane = es.transform.jit(lambda x: scale.value * x / jax.lax.axis_size("i"))
    for n in (2, 4):
        got = jax.vmap(per_lane, axis_name="i")(jnp.ones(n))
        assert got == pytest.approx(jnp.full(n, 1 / n)), (n, got)


def test_a_jitted_function_follows_jax_configuration_changed_between_calls():
    # `jax.jit` keys its traces by the configuration they depend on; so does eqstate.
    total = es.ShortTermState(jnp.float32(0), name="total")

    def add(x):
        total.value = total.value + jnp.sum(x)
        return jnp.arange(2.0) + x.astype(float)  # float64 with 64-bit types on

    jitted = es.transform.jit(add)
    function = es.transform.StatefulFunction(add)

    def jaxpr(x):
        return str(function.make_jaxpr(x).get_jaxpr(function.get_arg_cache_key(x)))

    x = jnp.ones((2,), jnp.float32)
    assert jitted(x).dtype == jnp.float32
    assert "f64" not in jaxpr(x)
    with jax.enable_x64(True):
        assert jitted(x).dtype == jax.jit(lambda x: x.astype(float))(x).dtype
        assert jitted(x).dtype == jnp.float64
        assert "f64" in jaxpr(x)
    assert jitted(x).dtype == jnp.float32
    assert "f64" not in jaxpr(x)
    assert total.value == 8.0
    column, half = jnp.ones((3, 1)), jnp.ones(2, jnp.bfloat16)
    with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
        jitted(column)  # (3, 1) broadcast against (2,)
        jitted(half)  # bfloat16 promoted with the float32 total
    # The tests run with rank promotion "raise" and dtype promotion "strict".
    with pytest.raises(ValueError, match="could not be broadcast"):
        jitted(column)
    with pytest.raises(ValueError, match="promotion"):  # TypePromotionError
        jitted(half)


def test_a_state_dict_returned_by_a_jitted_build_is_keyed_by_the_returned_handles():
    def make():
        model = {"w": es.ParamState(jnp.ones(2))}
        return model, es.values_of(model)

    model, values = es.transform.jit(make)()
    assert values.states == (model["w"],)
    es.assign(values)  # writes the returned handle, which has a value


def test_keyword_arguments_named_like_the_jitted_body_s_own_are_passed_through():
    s = es.State(jnp.zeros(2))

    def f(x, read=1.0, written=2.0):
        s.value = s.value + x * read
        return x * written

    g = es.transform.jit(f)
    for _ in range(2):
        assert (g(jnp.ones(2), read=3.0, written=4.0) == 4).all()
    assert (s.value == 6).all()


def test_a_jitted_function_called_inside_a_trace_keeps_none_of_its_tracers():
    # The argument splitter remembers the last call's arguments for the next one, at
    # top level only: inside a trace they are tracers, which must die with it.
    w = es.ParamState(jnp.ones(3), name="w")
    inner = es.transform.jit(lambda x: jnp.sum(w.value * x))
    with jax.checking_leaks():
        grads = es.transform.grad(inner, grad_states=[w])(jnp.full(3, 2.0))
        sums = es.transform.vmap(inner)(jnp.ones((2, 3)))
    assert (grads[w] == 2).all() and (sums == 3).all()
