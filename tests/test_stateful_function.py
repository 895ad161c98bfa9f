import contextvars
import threading

import eqstate as es
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from eqstate.transform import StatefulFunction

from .helpers import traces_per_key, tree_allclose


pytestmark = pytest.mark.usefixtures("tracing_mode")


@pytest.fixture
def model():
    w = es.ParamState(jnp.arange(3.0), name="w")
    b = es.ParamState(jnp.array(1.0), name="b")
    count = es.ShortTermState(jnp.array(0), name="count")

    def f(x):
        count.value = count.value + 1
        return w.value @ x.astype(w.value.dtype) + b.value

    return f, w, b, count


def _pure(w, b, count, x):
    return w @ x + b, count + 1


# ----------------------------------------------------------------- what it reports


def test_reports_states_in_first_access_order(model):
    f, w, b, count = model
    sf = StatefulFunction(f).make_jaxpr(jnp.ones(3))
    assert sf.get_states() == (count, w, b)
    assert sf.get_read_states() == (w, b)
    assert sf.get_write_states() == (count,)
    assert sf.get_new_states() == ()
    assert sf.states == sf.get_states()


def test_states_before_the_first_trace_raise():
    with pytest.raises(es.UnknownCacheKeyError):
        StatefulFunction(lambda: None).states


def test_out_treedef_describes_what_jaxpr_call_returns():
    s = es.State(jnp.zeros(2), name="s")

    def f(x):
        s.value = s.value + x
        made = es.State(x * 2, name="made")
        return "label", x.sum(), made

    sf = StatefulFunction(f).make_jaxpr(jnp.ones(2))
    # `(out, state_vals)`: the three leaves of `out` (the string and the new
    # state's handle included), then `s`. The jaxpr outputs the sum, `s`, and the
    # new state's value.
    assert sf.get_out_treedef().num_leaves == 3 + 1
    assert len(sf.get_jaxpr().jaxpr.outvars) == 1 + 1 + 1


def test_read_before_write_counts_as_written_and_write_only_is_an_input():
    a = es.State(jnp.zeros(2), name="a")
    c = es.State(jnp.zeros(2), name="c")

    def f():
        a.value = a.value + 1
        c.value = jnp.ones(2)

    sf = StatefulFunction(f).make_jaxpr()
    assert sf.get_write_states() == (a, c) and sf.get_read_states() == ()
    assert len(sf.get_jaxpr().jaxpr.invars) == 2


def test_jaxpr_layout_is_args_then_states_and_out_then_states(model):
    f, w, b, count = model
    jaxpr = StatefulFunction(f).make_jaxpr(jnp.ones(3)).get_jaxpr()
    assert [v.aval.shape for v in jaxpr.jaxpr.invars] == [(3,), (), (3,), ()]
    x = jnp.array([1.0, 2.0, 3.0])
    out = jax.extend.core.jaxpr_as_fun(jaxpr)(x, count.value, w.value, b.value)
    expected_out, expected_count = _pure(w.value, b.value, count.value, x)
    assert tree_allclose(out, [expected_out, expected_count, w.value, b.value])


@pytest.mark.parametrize(
    "returns, expected",
    [
        ("write", ["count"]),
        ("read", ["w", "b"]),
        (("read", "write"), ["count", "w", "b"]),
    ],
)
def test_state_returns_selects_the_returned_states(model, returns, expected):
    f, *_ = model
    sf = StatefulFunction(f, state_returns=returns).make_jaxpr(jnp.ones(3))
    _, state_shapes = sf.get_out_shapes()
    assert len(sf.get_jaxpr().jaxpr.outvars) == 1 + len(expected)
    assert len(state_shapes) == len(expected)


@pytest.mark.parametrize("cache_type", [None, "jit"])
def test_a_call_that_would_drop_writes_raises_and_changes_nothing(model, cache_type):
    f, w, b, count = model
    sf = StatefulFunction(f, state_returns="read", cache_type=cache_type)
    x = jnp.ones(3)
    values = es.values_of((count, w, b))
    calls = [
        lambda: sf(x),
        lambda: sf.jaxpr_call(values, x),
        lambda: sf.jaxpr_call([count.value, w.value, b.value], x),
        lambda: sf.debug_call(values, x),
        lambda: sf.debug_call([count.value, w.value, b.value], x),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"f writes ShortTermState 'count'.*read"):
            call()
    assert count.value == 0
    # The pure form it describes returns the read states only.
    assert sf.get_write_states() == (count,)
    assert len(sf.get_jaxpr().jaxpr.outvars) == 1 + 2


def test_state_returns_read_calls_a_function_that_only_reads(model):
    _, w, b, _ = model
    sf = StatefulFunction(lambda x: w.value @ x + b.value, state_returns="read")
    x = jnp.ones(3)
    assert sf(x) == 4.0
    new, out = sf.jaxpr_call(es.values_of((w, b)), x)
    assert out == 4.0 and (new[w] == w.value).all()
    runs = []
    sf = StatefulFunction(
        lambda x: (runs.append(1), w.value @ x)[1], state_returns="read"
    )
    sf.make_jaxpr(x)
    runs.clear()
    _, out = sf.debug_call(es.values_of(w), x)
    assert out == 3.0 and len(runs) == 1  # checked for writes without a second run


def test_out_shapes_and_treedef():
    s = es.State(jnp.zeros((2, 3)))

    def f(x):
        s.value = s.value + x[None]
        return {"y": x.sum(), "n": "static"}

    sf = StatefulFunction(f).make_jaxpr(jnp.ones(3))
    out, states = sf.get_out_shapes()
    assert out["y"].shape == () and out["n"] == "static"
    assert states[0].shape == (2, 3)
    assert sf.get_out_treedef() == jax.tree_util.tree_structure((out, states))


def test_make_jaxpr_function_returns_jaxpr_and_states(model):
    f, w, b, count = model
    jaxpr, states = es.transform.make_jaxpr(f)(jnp.ones(3))
    assert states == (count, w, b)
    assert len(jaxpr.jaxpr.invars) == 4


def test_to_state_manager_holds_current_values(model):
    f, w, b, count = model
    sf = StatefulFunction(f).make_jaxpr(jnp.ones(3))
    count.value = jnp.array(7)
    sd = sf.to_state_manager()
    assert sd.states == (count, w, b) and sd[count] == 7


def test_compile_and_get_states_by_static_args():
    a = es.State(jnp.zeros(()))
    c = es.State(jnp.zeros(()))
    sf = StatefulFunction(
        lambda x, use_a: a.value if use_a else c.value, static_argnums=1
    )
    assert sf.compile_and_get_states_by_static_args(1.0, True) == (a,)
    assert sf.compile_and_get_states_by_static_args(1.0, False) == (c,)


# -------------------------------------------------------------------------- calls


@pytest.mark.parametrize("cache_type", [None, "jit"])
def test_call_matches_the_pure_program_and_writes_back(model, cache_type):
    f, w, b, count = model
    sf = StatefulFunction(f, cache_type=cache_type)
    x = jnp.array([1.0, -1.0, 2.0])
    for _ in range(3):
        out = sf(x)
        expected, _ = _pure(w.value, b.value, count.value, x)
        assert tree_allclose(out, expected)
    assert count.value == 3
    assert sf.jaxpr_call_auto(x) == out and count.value == 4


def test_jaxpr_call_with_a_state_dict_touches_no_context(model):
    f, w, b, count = model
    sf = StatefulFunction(f)
    extra = es.State(jnp.zeros(5))
    sd = es.world().filter(w, b, count, extra)
    new_sd, out = sf.jaxpr_call(sd, jnp.ones(3))
    assert new_sd.states == sd.states
    assert new_sd[count] == 1 and count.value == 0
    assert new_sd[extra] is sd[extra]
    assert out == 4.0


def test_jaxpr_call_with_a_state_dict_is_strict_while_tracing(model):
    f, w, b, count = model
    sf = StatefulFunction(f)
    with pytest.raises(es.StateNotFoundError, match="ParamState 'w' is not in"):
        sf.jaxpr_call(es.world().filter(count, b), jnp.ones(3))
    sf.make_jaxpr(jnp.ones(3))
    with pytest.raises(
        es.StateNotFoundError, match=r"ParamState 'w'.* not in the StateDict"
    ):
        sf.jaxpr_call(es.world().filter(count, b), jnp.ones(3))


def test_jaxpr_call_with_a_sequence_returns_an_aligned_tuple(model):
    f, w, b, count = model
    sf = StatefulFunction(f).make_jaxpr(jnp.ones(3))
    values = (jnp.array(5), w.value, b.value)
    new, out = sf.jaxpr_call(values, jnp.ones(3))
    assert isinstance(new, tuple) and new[0] == 6
    assert new[1] is values[1] and new[2] is values[2]
    assert count.value == 0


def test_a_sequence_is_aligned_with_get_states_when_another_trace_fits_it():
    # Two traces of one key: with `w` of 4 entries, the function touches `b` before
    # `a`; with 3, `a` before `b`. Values follow `get_states()`, whichever fits.
    w = es.State(jnp.zeros(3), name="w")
    a = es.State(jnp.array(10.0), name="a")
    b = es.State(jnp.array(20.0), name="b")

    def f():
        if w.value.shape[0] == 3:
            a.value = a.value + 1
            return b.value
        b.value = b.value + 1
        return a.value

    sf = es.transform.StatefulFunction(f)
    with es.scope(es.StateDict({w: jnp.zeros(4), a: 10.0, b: 20.0})):
        sf()
    sf()
    assert sf.get_states() == (w, a, b)
    (w4, a_after, b_after), out = sf.jaxpr_call([jnp.zeros(4), 1.0, 2.0])
    assert w4.shape == (4,) and (float(a_after), float(b_after), float(out)) == (
        1.0,
        3.0,
        1.0,
    )
    assert sf.get_states() == (w, b, a)  # the trace just used
    (_, b_after, a_after), out = sf.jaxpr_call([jnp.zeros(3), 1.0, 2.0])
    assert (float(b_after), float(a_after), float(out)) == (1.0, 3.0, 1.0)


def test_jaxpr_call_with_a_sequence_traces_on_a_miss(model):
    f, w, b, count = model
    new, out = StatefulFunction(f).jaxpr_call(
        (count.value, w.value, b.value), jnp.ones(3)
    )
    assert new[0] == 1 and out == 4


def test_jaxpr_call_with_a_sequence_of_other_shapes_on_a_miss_says_to_pass_a_dict():
    # On a miss the function is traced with the states' current values, to learn
    # their order; values of other shapes than those need a StateDict.
    a = es.State(jnp.zeros(2), name="a")
    sf = StatefulFunction(lambda x: a.value + x)
    with pytest.raises(TypeError) as info:
        sf.jaxpr_call([jnp.ones(3)], jnp.ones(3))
    assert "pass a StateDict" in "\n".join(getattr(info.value, "__notes__", []))
    _, out = sf.jaxpr_call(es.StateDict({a: jnp.ones(3)}), jnp.ones(3))
    assert (out == 2.0).all() and a.value.shape == (2,)


def test_a_state_dict_of_other_shapes_that_fails_the_function_names_those_states():
    # Values of other shapes trace the function again, as `jax.jit` would; the
    # function's own shape error said nothing of which state's value changed.
    s = es.State(jnp.zeros(2), name="s")
    w = es.ParamState(jnp.ones((3, 2)), name="w")

    def f(x):
        s.value = s.value + x @ w.value
        return s.value.sum()

    sf = StatefulFunction(f)
    sf.jaxpr_call(es.values_of([s, w]), jnp.ones(3))
    with pytest.raises(TypeError) as info:
        sf.jaxpr_call(es.StateDict({s: s.value, w: jnp.ones((4, 2))}), jnp.ones(3))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "ParamState 'w' gets f32[4,2], where the trace had f32[3,2]" in notes
    assert "State 's'" not in notes
    # An error with the values the trace saw has no such note.
    with pytest.raises(TypeError) as info:
        sf.jaxpr_call(es.values_of([s, w]), jnp.ones(4))
    assert "traced f again" not in "\n".join(getattr(info.value, "__notes__", []))


@pytest.mark.parametrize("traced_weak", [True, False])
def test_jaxpr_call_with_a_sequence_accepts_another_weak_type_as_a_state_dict(
    traced_weak,
):
    b = es.State(jnp.asarray(3.0, dtype=None if traced_weak else jnp.float32))

    def f(x):
        b.value = b.value * x
        return b.value + 1

    sf = StatefulFunction(f).make_jaxpr(2.0)
    other = jnp.float32(5.0) if traced_weak else jnp.asarray(5.0)
    assert other.weak_type != traced_weak
    new, out = sf.jaxpr_call([other], 2.0)
    new_dict, out_dict = sf.jaxpr_call(es.StateDict({b: other}), 2.0)
    assert tree_allclose((new[0], out), (new_dict[b], out_dict))
    assert new[0].weak_type == new_dict[b].weak_type == other.weak_type


def test_a_sequence_of_another_weak_type_fitting_an_older_trace_is_traced_again():
    # The newest trace of the key has `a` of 4 entries; the weakly typed values fit
    # the older one of 2 but for their weak types, as the docstring allows.
    a = es.State(jnp.ones(2), name="a")
    b = es.State(jnp.ones(3), name="b")

    def f():
        b.value = b.value * 2
        return a.value.sum() * 10 + b.value.sum()

    sf = StatefulFunction(f).make_jaxpr()
    sf.jaxpr_call(es.StateDict({a: jnp.ones(4), b: jnp.ones(3)}))
    assert sf.get_states() == (b, a)
    weak = [jnp.full(3, 7.0), jnp.full(2, 5.0)]
    assert weak[0].weak_type
    (b_after, a_after), out = sf.jaxpr_call(weak)
    assert out == 142.0 and (b_after == 14.0).all() and (a_after == 5.0).all()
    assert b_after.weak_type  # written from the weak value, as a write would


def test_jaxpr_call_inside_jit_matches_the_pure_program(model):
    f, w, b, count = model
    sf = StatefulFunction(f)
    step = jax.jit(lambda sd, x: sf.jaxpr_call(sd, x))
    sd = es.world().filter(w, b, count)
    for _ in range(3):
        sd, out = step(sd, jnp.ones(3))
    assert sd[count] == 3 and out == 4 and count.value == 0


# ----------------------------------------------------------------------- new states


def test_new_states_get_fresh_handles_on_every_call():
    def make(scale):
        return {"w": es.ParamState(jnp.ones(2) * scale, name="w"), "n": 3}

    sf = StatefulFunction(make)
    a, b = sf(2.0), sf(3.0)
    assert a["w"] is not b["w"] and a["n"] == 3
    assert isinstance(a["w"], es.ParamState) and a["w"].name == "w"
    assert (a["w"].value == 2).all() and (b["w"].value == 3).all()
    (template,) = sf.get_new_states()
    assert template is not a["w"] and template is not b["w"]


def test_new_states_are_added_to_the_returned_state_dict():
    sf = StatefulFunction(lambda: es.ShortTermState(jnp.zeros(3)))
    sd, handle = sf.jaxpr_call(es.StateDict())
    assert sd.states == (handle,) and (sd[handle] == 0).all()
    with pytest.raises(es.StateNotFoundError):
        handle.value


def test_a_handle_escaping_through_a_side_effect_is_invalid_afterwards():
    escaped = []

    def f():
        escaped.append(es.State(jnp.zeros(2), name="escapee"))
        return 1.0

    StatefulFunction(f)()
    with pytest.raises(
        es.TraceContextError, match="State 'escapee' was created inside"
    ):
        escaped[0].value


def test_new_states_created_in_a_nested_call_reach_the_outer_caller():
    inner = StatefulFunction(lambda x: es.State(x * 2, name="inner"))

    def outer(x):
        s = inner(x)
        s.value = s.value + 1
        return s

    s1 = StatefulFunction(outer)(jnp.ones(2))
    assert (s1.value == 3).all()


def test_sequence_jaxpr_call_refuses_functions_that_create_states():
    sf = StatefulFunction(lambda: es.State(jnp.zeros(2), name="new"))
    with pytest.raises(ValueError, match=r"creates states \(State 'new'\)"):
        sf.jaxpr_call(())


# -------------------------------------------------------------------------- nesting


def test_nested_stateful_functions_report_and_thread_states(model):
    f, w, b, count = model
    inner = StatefulFunction(f)
    extra = es.State(jnp.array(10.0), name="extra")

    def outer(x):
        return inner(x) + extra.value

    sf = StatefulFunction(outer).make_jaxpr(jnp.ones(3))
    assert sf.get_states() == (count, w, b, extra)
    assert sf.get_write_states() == (count,)
    assert sf(jnp.ones(3)) == 14.0 and count.value == 1


@pytest.mark.parametrize("cache_type", [None, "jit"])
def test_nested_in_jax_jit_vmap_and_grad_through_run(model, cache_type):
    f, w, b, count = model
    sf = StatefulFunction(f, cache_type=cache_type)
    params, rest = es.world().filter(w, b, count).split(es.ParamState)

    def loss(params, rest, x):
        sd, out = es.run(sf, params | rest, x)
        return out**2, sd

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (value, new_sd), grads = step(params, rest, jnp.ones(3))
    assert new_sd[count] == 1 and value == 16.0
    sd = params | rest
    assert tree_allclose(grads[w], 2 * 4.0 * jnp.ones(3))
    outs = jax.vmap(lambda x: es.run(sf, sd, x)[1])(jnp.ones((4, 3)))
    assert outs.shape == (4,)
    assert count.value == 0


def test_raw_vmap_write_inside_a_trace_is_refused_and_values_kept():
    s = es.State(jnp.zeros(()), name="s")

    def f(xs):
        def body(x):
            s.value = x
            return x

        return jax.vmap(body)(xs)

    with pytest.raises(es.TraceContextError, match="Cannot write State 's'"):
        StatefulFunction(f)(jnp.ones(3))
    assert s.value == 0


def test_raw_vmap_read_inside_a_trace_is_a_closure():
    s = es.State(jnp.array(3.0))
    sf = StatefulFunction(lambda xs: jax.vmap(lambda x: x * s.value)(xs))
    assert (sf(jnp.ones(2)) == 3).all()
    assert sf.get_states() == (s,)


_W = es.State(jnp.array(0.0), name="w")


@jax.jit
def _scaled_by_w(x):  # module level: JAX keeps its trace for later calls
    return x * _W.value


def _add_w(c, _):
    return c + _W.value, None


@jax.jit
def _scaled_by_world_w(x):
    return x * es.world()[_W]


_CACHED_RAW = {
    "jax.jit": lambda x: _scaled_by_w(x),
    "world()": lambda x: _scaled_by_world_w(x),
    "eqx.filter_jit": lambda x: eqx.filter_jit(_scaled_by_w.__wrapped__)(x),
    "lax.scan": lambda x: jax.lax.scan(_add_w, x * 0, None, length=1)[0] * x,
    "jax.checkpoint": lambda x: jax.checkpoint(_scaled_by_w.__wrapped__)(x),
}


@pytest.mark.upstream_leak(
    "JAX's cache keeps the trace of a module-level function, with the tracer it read "
    "(never reused: see `compat.new_trace_era`), until the entry is evicted"
)
@pytest.mark.parametrize("raw", list(_CACHED_RAW))
def test_a_cached_raw_transform_in_a_trace_reads_the_value_of_that_trace(raw):
    # JAX keeps the trace of a module-level function by its identity: one made in an
    # earlier trace (holding its value, or its dead tracer) must not be reused.
    call = _CACHED_RAW[raw]

    def written(value):
        def f(x):
            _W.value = value  # a constant in the trace
            return call(x)

        return f

    assert es.transform.jit(written(4.0))(1.0) == 4.0
    assert es.transform.jit(written(6.0))(1.0) == 6.0
    read = es.transform.jit(lambda x: call(x) + 0.0)  # the world's value, traced
    _W.value = jnp.array(2.0)
    assert read(1.0) == 2.0
    _W.value = jnp.array(3.0)
    assert read(1.0) == 3.0
    assert es.transform.jit(lambda x: call(x) * 1.0)(1.0) == 3.0  # a new trace
    assert es.run(lambda: es.transform.jit(call)(1.0), es.StateDict({_W: 5.0}))[1] == 5
    assert jax.vmap(lambda x: es.run(call, es.StateDict({_W: 7.0}), x)[1])(
        jnp.ones(2)
    ).tolist() == [7.0, 7.0]
    with pytest.raises(es.TraceContextError, match="Cannot read"):
        call(1.0)  # at top level it would be baked in


@pytest.mark.upstream_leak("as above: JAX's cache keeps the tracer a trace read")
def test_a_cached_raw_transform_is_not_shared_between_threads_tracing_at_once():
    # Thread `a` traces the helper first, with its own tracer; thread `b`, whose
    # trace began before, must not reuse that trace.
    b_entered, a_done = threading.Event(), threading.Event()
    out = {}

    def in_a(x):
        b_entered.wait(timeout=60)
        return _scaled_by_w(x)

    def in_b(x):
        b_entered.set()
        a_done.wait(timeout=60)
        return _scaled_by_w(x) + 0.0

    def run(name, fn):
        try:
            out[name] = float(es.transform.jit(fn)(1.0))
        except Exception as error:
            out[name] = error
        finally:
            if name == "a":
                a_done.set()

    _W.value = jnp.array(2.0)
    threads = [
        threading.Thread(target=run, args=("b", in_b)),
        threading.Thread(target=run, args=("a", in_a)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert out == {"a": 2.0, "b": 2.0}


def test_a_cached_raw_transform_reading_no_state_is_traced_once():
    runs = []

    @jax.jit
    def double(x):
        runs.append(None)
        return x * 2

    s = es.State(jnp.array(1.0))
    for scale in (1.0, 2.0, 3.0):
        step = es.transform.jit(lambda x, scale=scale: double(x) * s.value * scale)
        assert step(1.0) == 2 * scale
    assert len(runs) == 1


def test_axis_env_lets_collectives_trace():
    s = es.State(jnp.ones(()))
    sf = StatefulFunction(lambda x: jax.lax.psum(x * s.value, "i"), axis_env=[("i", 4)])
    jaxpr = sf.make_jaxpr(1.0).get_jaxpr()
    assert "psum" in str(jaxpr)
    value = s.value
    out = jax.vmap(lambda x: sf.jaxpr_call([value], x)[1], axis_name="i")(jnp.ones(4))
    assert (out == 4).all()


def _sized_by_axis(s: es.State):
    def f(x):
        s.value = s.value + 1
        return x * jax.lax.axis_size("i") + jax.lax.psum(x, "i")

    return f


@pytest.mark.parametrize("size", [4, 8])
def test_axis_env_yields_to_an_axis_of_that_name_around_the_call(size):
    # Traced under the declared size inside a `vmap` of another, `axis_size` baked
    # in 4 where the call ran over 8 lanes.
    s = es.State(jnp.zeros(()))
    sf = StatefulFunction(_sized_by_axis(s), axis_env=[("i", 4)])
    assert "psum" in str(sf.make_jaxpr(1.0).get_jaxpr())  # traces outside any vmap
    expected = jnp.full(size, 2.0 * size)

    def lane(x):
        return sf.jaxpr_call(es.values_of(sf.get_states()), x)[1]

    assert (jax.vmap(lane, axis_name="i")(jnp.ones(size)) == expected).all()
    out = es.transform.vmap(sf, axis_name="i")(jnp.ones(size))
    assert (out == expected).all()
    assert s.value == 1


def test_abstracted_axes_are_refused_clearly():
    with pytest.raises(NotImplementedError, match="abstracted_axes"):
        StatefulFunction(lambda x: x, abstracted_axes=({0: "n"},))


# ------------------------------------------------------------------------ the cache


def test_traces_once_per_cache_key(model, tracing_mode):
    f, *_ = model
    calls = []

    def counted(x):
        calls.append(1)
        return f(x)

    sf = StatefulFunction(counted)
    for _ in range(3):
        sf(jnp.ones(3))
    assert len(calls) == traces_per_key()
    sf(jnp.ones(4)[:3] * 2)
    sf(jnp.ones(3, jnp.int32))
    assert len(calls) == 2 * traces_per_key()


def test_cache_key_covers_static_args_shapes_dtypes_weak_types_and_structure():
    sf = StatefulFunction(lambda x, n: x, static_argnums=1)
    k = sf.get_arg_cache_key
    assert k(jnp.ones(3), 1) == k(jnp.zeros(3), 1)
    assert k(jnp.ones(3), 1) != k(jnp.ones(3), 2)
    assert k(jnp.ones(3), 1) != k(jnp.ones(4), 1)
    assert k(jnp.ones(3), 1) != k(jnp.ones(3, jnp.int32), 1)
    assert k(1.0, 1) != k(jnp.asarray(1.0, jnp.float32), 1)
    assert k((jnp.ones(3),), 1) != k([jnp.ones(3)], 1)


def test_static_argnames_and_name_positions():
    seen = []

    def f(x, mode="a"):
        seen.append(mode)
        return x * (2 if mode == "a" else 3)

    sf = StatefulFunction(f, static_argnames="mode")
    assert sf(1.0, mode="b") == 3 and sf(1.0, "b") == 3 and sf(1.0) == 2
    assert sf.get_arg_cache_key(1.0, mode="b") != sf.get_arg_cache_key(1.0, mode="a")


@pytest.mark.parametrize(
    "static",
    [
        {"static_argnums": (1, -1)},
        {"static_argnums": -1, "static_argnames": "n"},
    ],
    ids=["argnums 1 and -1", "argnums -1 and argnames n"],
)
@pytest.mark.parametrize(
    "transform", [StatefulFunction, es.transform.jit], ids=["sf", "jit"]
)
def test_one_static_argument_named_twice_matches_jax_jit(transform, static):
    def f(x, n, m=0.0):
        return x * n + m

    expected = f(2.0, 3)  # what jax.jit gives too (jax 0.8 gives 9.0: see ArgParser)
    g = transform(f, **static)
    assert g(2.0, 3) == expected and g(2.0, 3) == expected


def test_a_state_written_from_a_numpy_argument_holds_a_copy():
    # Some JAX releases share a NumPy array's buffer in `jnp.asarray` when it happens
    # to be aligned: many arrays, so that some are.
    for size in range(1, 40):
        n = es.State(jnp.zeros(size), name="n")
        write = StatefulFunction(lambda x, n=n: setattr(n, "value", x))
        arrays = [np.ones(size, np.float32) for _ in range(4)]
        created = es.State(arrays[0])
        sd = es.StateDict({created: arrays[1]})
        n.value = arrays[2]
        eager = n.value
        write(arrays[3])
        for arr in arrays:
            arr[0] = 99.0
        for value in (created.value, sd[created], eager, n.value):
            assert isinstance(value, jax.Array)
            assert (value == 1.0).all()


def test_eager_calls_give_jax_arrays_like_jax_jit():
    s = es.State(jnp.ones(()), name="s")
    t = es.State(jnp.zeros(()), name="t")

    def f(x):
        s.value = jnp.zeros(())
        t.value = x
        return jnp.float32(3.0), x, 1.0

    def pure(x):
        return jnp.float32(3.0), x, 1.0

    out = StatefulFunction(f)(2.0)
    expected = jax.jit(pure)(2.0)
    for leaf, want in zip([*out, s.value, t.value], [*expected, 0.0, 2.0]):
        assert isinstance(leaf, jax.Array) and leaf == want
    assert [x.weak_type for x in out] == [x.weak_type for x in expected]
    s.value = s.value.at[()].set(5.0)  # the jax.Array API works
    assert s.value == 5.0


def test_non_array_leaves_are_static():
    sf = StatefulFunction(lambda x, act: x * (2 if act == "double" else 1))
    assert sf(jnp.ones(2), "double")[0] == 2 and sf(jnp.ones(2), "same")[0] == 1


def test_an_unknown_key_error_lists_the_known_keys_readably():
    # The keys hold JAX's whole configuration: printed as they are, hundreds of
    # characters of flags hid the arguments' shapes.
    s = es.State(jnp.zeros(2), name="s")
    sf = StatefulFunction(lambda x, flag: s.value + x, static_argnums=1)
    sf.make_jaxpr(jnp.ones(2), True).make_jaxpr(1.5, False)
    with pytest.raises(es.UnknownCacheKeyError) as info:
        sf.get_jaxpr(("not", "a", "key"))
    message = str(info.value)
    assert "traced leaves (f32[2]) in PyTreeDef" in message
    assert "(f32[] (weak))" in message and "static 1=False" in message
    assert len(message) < 600


def test_cache_key_default_is_the_most_recent_and_unknown_keys_raise():
    sf = StatefulFunction(lambda x: x + 1)
    with pytest.raises(KeyError, match="has not been traced yet"):
        sf.get_jaxpr()
    sf.make_jaxpr(jnp.ones(2)).make_jaxpr(jnp.ones(3))
    assert sf.get_jaxpr().jaxpr.invars[0].aval.shape == (3,)
    key = sf.get_arg_cache_key(jnp.ones(2))
    assert sf.get_jaxpr(key).jaxpr.invars[0].aval.shape == (2,)
    with pytest.raises(es.UnknownCacheKeyError, match="no trace for the cache key"):
        sf.get_jaxpr(("not", "a", "key"))
    with pytest.raises(KeyError, match=r"2 trace\(s\)"):
        sf.get_states("x")


def test_a_trace_made_inside_a_transform_and_not_kept_is_described_not_replaced():
    # A custom derivative rule inside `jax.jit` keeps the trace out of the cache: the
    # `get_*` methods must describe it, not an older trace of other state shapes.
    w = es.ParamState(jnp.ones(3), name="w")
    sf = StatefulFunction(lambda x: jax.nn.relu(w.value * x))
    sf.make_jaxpr(1.0)  # kept: w of shape (3,)
    seen = {}

    @jax.jit
    def outer(x):
        with es.scope(es.StateDict({w: jnp.ones(5)})):
            sf.make_jaxpr(x)
        seen["states"] = sf.get_states()
        seen["shapes"] = sf.get_out_shapes()
        with pytest.raises(
            es.UnknownCacheKeyError, match=r"not kept.*its jaxpr is not"
        ):
            sf.get_jaxpr()
        return x

    outer(1.0)
    assert seen["states"] == (w,)
    assert seen["shapes"][0].shape == (5,) and seen["shapes"][1][0].shape == (5,)
    sf.make_jaxpr(1.0)  # the kept trace again
    assert sf.get_jaxpr().jaxpr.invars[1].aval.shape == (3,)


def test_make_jaxpr_inside_jit_returns_a_trace_that_is_not_kept():
    w = es.ParamState(jnp.ones(3), name="w")
    seen = {}

    @jax.jit
    def outer(x):
        jaxpr, states, out = es.transform.make_jaxpr(
            lambda x: jax.nn.relu(w.value * x), return_shape=True
        )(x)
        seen["states"], seen["shape"] = states, out.shape
        seen["invars"] = [v.aval.shape for v in jaxpr.jaxpr.invars]
        return x

    outer(jnp.ones(3))
    assert seen == {"states": (w,), "shape": (3,), "invars": [(3,), (3,)]}


def test_clear_cache_forces_a_new_trace():
    calls = []
    sf = StatefulFunction(lambda x: calls.append(1) or x)
    sf(1.0)
    n = len(calls)
    sf.clear_cache()
    with pytest.raises(KeyError):
        sf.get_jaxpr()
    sf(1.0)
    assert len(calls) == 2 * n


@pytest.mark.parametrize("cache_type", [None, "jit"])
def test_a_state_whose_shape_changed_retraces(cache_type):
    w = es.State(jnp.ones(3), name="w")
    sf = StatefulFunction(lambda: w.value.sum(), cache_type=cache_type)
    assert sf() == 3
    with es.scope(es.StateDict({w: jnp.ones(5)})):
        assert sf() == 5
    sd, out = sf.jaxpr_call(es.StateDict({w: jnp.ones(7)}))
    assert out == 7
    assert sf() == 3


@pytest.mark.parametrize("cache_type", [None, "jit"])
def test_concurrent_first_calls_compile_once_and_agree(cache_type, tracing_mode):
    w = es.ParamState(jnp.arange(4.0))
    traces = []
    barrier = threading.Barrier(8)

    def f(x):
        traces.append(1)
        return w.value * x

    sf = StatefulFunction(f, cache_type=cache_type)
    results = [None] * 8

    def work(i):
        barrier.wait()
        results[i] = sf(jnp.ones(4))

    # Each thread runs in a copy of this context, so that it uses this tracing mode.
    threads = [
        threading.Thread(target=contextvars.copy_context().run, args=(work, i))
        for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(traces) == traces_per_key()
    assert all(tree_allclose(r, jnp.arange(4.0)) for r in results)


# ------------------------------------------------------------------------ bad input


def test_a_state_passed_as_an_argument_is_read_and_written_as_if_closed_over(model):
    f, w, b, count = model

    def scaled(s, x):
        s.value = s.value * 2
        return s.value * x

    sf = StatefulFunction(scaled)
    assert (sf(w, 1.0) == 2 * jnp.arange(3.0)).all()
    assert (w.value == 2 * jnp.arange(3.0)).all()
    assert sf.get_read_states() == () and sf.get_write_states() == (w,)
    # A handle is a static leaf, hashed by identity: another handle, another trace.
    assert sf.get_arg_cache_key(w, 1.0) != sf.get_arg_cache_key(b, 1.0)
    assert sf.get_arg_cache_key(w, 1.0) == sf.get_arg_cache_key(w, 2.0)


def test_a_module_holding_states_passed_as_an_argument(tracing_mode):
    class M(eqx.Module):
        w: es.ParamState
        scale: float

        def __call__(self, x):
            return self.w.value * x * self.scale

    m1 = M(es.ParamState(jnp.ones(2), name="w"), 2.0)
    m2 = M(es.ParamState(jnp.full(2, 3.0), name="w"), 2.0)
    traces = []
    sf = StatefulFunction(lambda m, x: traces.append(1) or m(x))
    assert (sf(m1, 1.0) == 2).all() and (sf(m2, 1.0) == 6).all()
    assert (sf(m1, 5.0) == 10).all()
    # One trace per model (their handles differ); the fallback traces twice.
    assert len(traces) == 2 * traces_per_key()
    assert sf.get_states() == (m1.w,)


def test_a_pre_existing_state_returned_comes_back_as_the_same_handle(model):
    f, w, b, count = model

    def g(x):
        f(x)
        return {"w": w, "out": w.value * 2}

    out = StatefulFunction(g)(jnp.ones(3))
    assert out["w"] is w and count.value == 1
    assert (out["out"] == 2 * jnp.arange(3.0)).all()


def test_unhashable_static_argument_names_the_argument():
    sf = StatefulFunction(lambda x, n: x, static_argnums=1)
    with pytest.raises(TypeError, match="unhashable static argument 1: \\[1\\]"):
        sf(1.0, [1])


def test_static_argnums_out_of_range():
    with pytest.raises(
        ValueError, match=r"`static_argnums` holds 3, but .* takes 1 positional"
    ):
        StatefulFunction(lambda x: x, static_argnums=3)


def test_static_argnames_naming_no_parameter_is_refused_unless_kwargs_take_it():
    def f(x, *rest, scale=1.0):
        return x * scale

    with pytest.raises(
        ValueError,
        match=r"`static_argnames` holds 'sclae', but f has no parameter of that name "
        r"\(its parameters: x, scale\)",
    ):
        StatefulFunction(f, static_argnames=("scale", "sclae"))
    with pytest.raises(ValueError, match="holds 'rest'"):
        StatefulFunction(f, static_argnames="rest")
    sf = StatefulFunction(lambda x, **options: x * options["k"], static_argnames="k")
    assert sf(jnp.ones(2), k=3)[0] == 3  # `k` reaches `**options`, static


@pytest.mark.parametrize(
    "transform", [StatefulFunction, es.transform.jit], ids=["sf", "jit"]
)
def test_static_argnums_by_keyword_or_default_like_jax_jit(transform):
    seen = []

    def f(x, n=2):
        seen.append(n)
        return jnp.zeros(n) + x

    g = transform(f, static_argnums=1)
    expected = jax.jit(f, static_argnums=1)
    for _ in range(2):
        assert tree_allclose(g(1.0, n=3), expected(1.0, n=3))
        assert tree_allclose(g(1.0), expected(1.0))
        assert tree_allclose(g(1.0, 4), expected(1.0, 4))
    assert all(type(n) is int for n in seen)  # static: never traced


def test_static_argnums_beyond_the_arguments_of_a_star_args_call_are_ignored():
    def f(*args):
        return sum(args)

    sf = StatefulFunction(f, static_argnums=3)  # any number fits `*args`
    assert sf(1.0, 2.0) == 3.0 and sf(1.0, 2.0, 3.0, 4) == 10.0


def test_a_write_changing_shape_or_dtype_inside_a_trace_raises_and_keeps_values(model):
    f, w, b, count = model

    def bad(x):
        f(x)
        w.value = jnp.zeros(4)

    with pytest.raises(ValueError, match=r"shape \(4,\) .* to ParamState 'w'"):
        StatefulFunction(bad)(jnp.ones(3))

    def bad_dtype(x):
        f(x)
        count.value = jnp.zeros((), jnp.float32)

    with pytest.raises(ValueError, match="dtype float32 to ShortTermState 'count'"):
        StatefulFunction(bad_dtype)(jnp.ones(3))
    assert count.value == 0 and (w.value == jnp.arange(3.0)).all()


def test_reading_a_state_no_context_knows():
    _, states = es.make_with_states(lambda: es.State(jnp.zeros(2), name="orphan"))()
    (orphan,) = states
    with pytest.raises(es.StateNotFoundError, match="State 'orphan' has no value"):
        StatefulFunction(lambda: orphan.value)()


def test_an_exception_mid_trace_keeps_every_value_and_allows_a_new_call(model):
    f, w, b, count = model
    fail = [True]

    def g(x):
        out = f(x)
        w.value = w.value * 10
        if fail[0]:
            raise RuntimeError("mid-trace failure")
        return out

    sf = StatefulFunction(g)
    with pytest.raises(RuntimeError, match="mid-trace failure"):
        sf(jnp.ones(3))
    assert count.value == 0 and (w.value == jnp.arange(3.0)).all()
    fail[0] = False
    sf(jnp.ones(3))
    assert count.value == 1 and (w.value == 10 * jnp.arange(3.0)).all()


def test_jaxpr_call_with_the_wrong_number_of_values(model):
    f, w, b, count = model
    sf = StatefulFunction(f).make_jaxpr(jnp.ones(3))
    with pytest.raises(
        ValueError, match=r"touches 3 state\(s\), but `jaxpr_call` got 2"
    ):
        sf.jaxpr_call((count.value, w.value), jnp.ones(3))


def test_jaxpr_call_with_a_none_value(model):
    f, w, b, count = model
    sf = StatefulFunction(f).make_jaxpr(jnp.ones(3))
    with pytest.raises(
        es.StateValueError, match=r"position 1 .* ParamState 'w'.* is None"
    ):
        sf.jaxpr_call((count.value, None, b.value), jnp.ones(3))


def test_jaxpr_call_with_a_wrongly_shaped_value(model):
    f, w, b, count = model
    sf = StatefulFunction(f).make_jaxpr(jnp.ones(3))
    with pytest.raises(
        es.StateValueError,
        match=r"ParamState 'w'.* is f32\[4\], .* traced with f32\[3\]",
    ):
        sf.jaxpr_call((count.value, jnp.ones(4), b.value), jnp.ones(3))


def test_jaxpr_call_with_a_plain_dict_is_refused(model):
    f, w, b, count = model
    with pytest.raises(TypeError, match="StateDict"):
        StatefulFunction(f).jaxpr_call({w: w.value}, jnp.ones(3))


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="cache_type"):
        StatefulFunction(lambda: 0, cache_type="aot")
    with pytest.raises(ValueError, match="state_returns"):
        StatefulFunction(lambda: 0, state_returns=("all",))


def test_name_appears_in_messages():
    sf = StatefulFunction(lambda x, n: x, static_argnums=1, name="my_step")
    assert repr(sf) == "StatefulFunction(my_step)"
    with pytest.raises(TypeError, match="my_step got an unhashable"):
        sf(1.0, {})
