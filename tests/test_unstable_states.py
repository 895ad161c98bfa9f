"""The guard behind `UnstableStatesError`: a function whose states do not stay put
between its trace and its call is refused with a clear error, never run against the
wrong values and never retried forever.

Neither cause can be produced through the public API today (world states keep their
shapes, and the transforms reuse their discovery trace inside the JAX transform), so
these tests drive the two internal units that hold the guard."""

import itertools

import eqstate as es
import jax.numpy as jnp
import pytest
from eqstate import _context
from eqstate.transform import _function_traces
from eqstate.transform._discovery import Discovery, traces_for


def _reads_what_a_flag_says():
    """A function that reads states `a` and `b`, or only `a` once `flag["a only"]` is
    set: its states depend on something other than its arguments."""
    a = es.State(jnp.zeros(3), name="a")
    b = es.State(jnp.ones(3), name="b")
    flag = {"a only": False}

    def f(x):
        if flag["a only"]:
            return a.value + x
        return a.value + b.value + x

    return f, flag, a, b


def test_a_function_touching_other_states_inside_the_transform_is_refused():
    f, flag, a, b = _reads_what_a_flag_says()
    discovery = Discovery(f, (jnp.ones(3),))
    assert discovery.states == (a, b)
    flag["a only"] = True
    # Arguments of another shape need a trace of their own inside the transform.
    with pytest.raises(es.UnstableStatesError, match="touched different states"):
        discovery.evaluate(discovery.values, (jnp.ones(()),))


def test_the_discovery_trace_serves_a_call_with_the_same_arguments():
    f, flag, a, b = _reads_what_a_flag_says()
    discovery = Discovery(f, (jnp.ones(3),))
    flag["a only"] = True  # not traced again: the discovery trace serves
    values = [2 * jnp.ones(3), 3 * jnp.ones(3)]
    out, updates, new = discovery.evaluate(values, (jnp.ones(3),))
    assert jnp.array_equal(out, 6 * jnp.ones(3))
    assert updates == {} and new == []


def test_states_that_keep_changing_shape_stop_after_bounded_retries():
    """Another thread writing values of a new shape before every call: each retry
    traces again, and after `_RETRIES` the call gives up with an error naming the
    function, instead of running a trace against values it was not made for."""
    state = es.State(jnp.zeros(1), name="s")

    def step(x):
        return state.value.sum() + x

    traces = traces_for(step)
    call = traces.parse((jnp.ones(()),), {})
    sizes = itertools.count(2)
    frame = _context.DictFrame([(state, jnp.zeros(1))])

    def values_of(trace):
        # The value seen at the call always has a shape the trace has not seen.
        return [jnp.zeros(next(sizes))]

    with pytest.raises(es.UnstableStatesError, match=r"step.*changed shape 8 times"):
        traces.call_against(call, frame, values_of)
    assert traces.stats.misses == _function_traces._RETRIES


def test_a_state_that_changes_shape_once_is_traced_again_and_called():
    state = es.State(jnp.zeros(1), name="s")

    def step(x):
        return state.value.sum() + x

    traces = traces_for(step)
    call = traces.parse((jnp.ones(()),), {})
    current = [jnp.zeros(1)]
    writes = iter([2 * jnp.ones(4)])

    def values_of(trace):
        # Another thread writes a value of a new shape once, between the first trace
        # and the read that follows it.
        current[0] = next(writes, current[0])
        return list(current)

    def frame():
        return _context.DictFrame([(state, current[0])])

    trace, out, _, _ = traces.call_against(call, frame, values_of)
    assert trace.state_signatures[0][0] == (4,)
    assert jnp.array_equal(out[0], jnp.asarray(9.0))
    assert traces.stats.misses == 2
