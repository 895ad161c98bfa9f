"""StatefulFunction introspection (cache statistics, `validate_states`, `debug_call`)
and the shapes `eval_shape` and `make_jaxpr` report."""

import threading

import eqstate as es
import jax
import jax.numpy as jnp
import pytest

from .helpers import tree_allclose, unchecked


def test_cache_stats_count_hits_misses_and_traces():
    sf = es.transform.StatefulFunction(lambda x: x * 2)
    assert sf.get_cache_stats()["misses"] == 0
    sf(jnp.ones(3))
    sf(jnp.zeros(3))
    sf(jnp.ones(3))
    sf(jnp.ones(4))
    stats = sf.get_cache_stats()
    assert (stats["hits"], stats["misses"], stats["traces"]) == (2, 2, 2)
    assert (stats["keys"], stats["entries"], stats["evictions"]) == (2, 2, 0)
    assert stats["compilation_cache"] == {
        "size": 2,
        "maxsize": stats["maxsize"],
        "hits": 2,
        "misses": 2,
        "hit_rate": 50.0,
    }
    sf.clear_cache()
    assert sf.get_cache_stats()["hits"] == sf.get_cache_stats()["keys"] == 0


def test_cache_stats_count_evictions_of_the_oldest_keys():
    sf = es.transform.StatefulFunction(lambda x: x + 1)
    maxsize = sf.get_cache_stats()["maxsize"]
    for n in range(1, maxsize + 4):  # traced only: compiling them would take a minute
        sf.make_jaxpr(jax.ShapeDtypeStruct((n,), jnp.float32))
    stats = sf.get_cache_stats()
    assert (stats["keys"], stats["evictions"]) == (maxsize, 3)
    assert stats["traces"] == maxsize + 3
    with pytest.raises(KeyError):
        sf.get_jaxpr(sf.get_arg_cache_key(jnp.ones(3)))
    sf.get_jaxpr(sf.get_arg_cache_key(jnp.ones(4)))


def test_cache_stats_count_variants_for_states_of_other_shapes():
    h = es.ShortTermState(jnp.zeros(2), name="h")
    sf = es.transform.StatefulFunction(lambda: h.value + 1)
    sf()
    with es.scope(es.StateDict({h: jnp.zeros(5)})):
        sf()
    stats = sf.get_cache_stats()
    assert (stats["keys"], stats["entries"], stats["traces"]) == (1, 2, 2)


def test_cache_stats_of_a_jitted_function_count_its_traces():
    count = es.State(jnp.array(0))

    @es.transform.jit
    def step(x):
        count.value = count.value + 1
        return x

    step(jnp.ones(2))
    # One lookup, which found nothing (JAX's trace of the call then finds the
    # eqstate trace again, and is not counted as another lookup).
    assert (step.get_cache_stats()["hits"], step.get_cache_stats()["misses"]) == (0, 1)
    for _ in range(4):
        step(jnp.ones(2))
    step(jnp.ones(3))
    stats = step.get_cache_stats()
    assert stats["traces"] == stats["misses"] == 2 and count.value == 6
    assert stats["hits"] == 4  # the calls that reused the first trace


def test_cache_stats_of_a_stateful_function_compiled_by_jit_count_a_miss_once():
    sf = es.transform.StatefulFunction(lambda x: x * 2, cache_type="jit")
    sf(jnp.ones(2))
    stats = sf.get_cache_stats()
    assert (stats["hits"], stats["misses"], stats["traces"]) == (0, 1, 1)


def test_cache_stats_are_consistent_across_threads():
    sf = es.transform.StatefulFunction(lambda x: x * 2)

    def work():
        for n in range(1, 20):
            sf(jnp.ones(n % 4 + 1))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = sf.get_cache_stats()
    assert stats["hits"] + stats["misses"] == 4 * 19 and stats["traces"] == 4


def test_validate_states_names_each_state_that_changed():
    h = es.ShortTermState(jnp.zeros(3), name="h")
    w = es.ParamState({"a": jnp.zeros(2), "b": jnp.zeros(())}, name="w")
    n = es.State(jnp.array(0), name="n")
    sf = es.transform.StatefulFunction(lambda x: h.value + w.value["a"][0] + n.value)
    sf.make_jaxpr(1.0)
    assert sf.validate_states()
    changed = es.StateDict({h: jnp.zeros(5), w: {"a": jnp.zeros(4), "b": 0.0}, n: 0})
    with es.scope(changed):
        with pytest.raises(es.StateValueError) as info:
            sf.validate_states()
    message = str(info.value)
    assert "ShortTermState 'h': traced with f32[3], now f32[5]" in message
    assert "ParamState 'w': traced with {'a': f32[2], 'b': f32[]}, now" in message
    assert "State 'n'" not in message
    assert sf.validate_states(sf.get_arg_cache_key(1.0))


def test_validate_states_reports_a_state_missing_from_the_context():
    h = es.ShortTermState(jnp.zeros(3), name="h")
    sf = es.transform.StatefulFunction(lambda: h.value)
    sf.make_jaxpr()
    with es.scope(es.StateDict()):
        with pytest.raises(ValueError, match="ShortTermState 'h': has no value here"):
            sf.validate_states()


def test_validate_states_of_an_unknown_key_raises():
    sf = es.transform.StatefulFunction(lambda x: x)
    with pytest.raises(es.UnknownCacheKeyError, match="not been traced"):
        sf.validate_states()


def test_debug_call_runs_the_function_eagerly_and_matches_jaxpr_call(capsys):
    count = es.State(jnp.array(0), name="count")
    w = es.ParamState(jnp.array([1.0, 2.0]), name="w")

    def f(x):
        count.value = count.value + 1
        print("count", int(count.value), "x", float(x))  # needs concrete values
        return w.value * x

    sf = es.transform.StatefulFunction(f)
    sd = es.StateDict({count: jnp.array(4), w: jnp.array([3.0, 4.0])})
    new, out = sf.debug_call(sd, 2.0)
    assert capsys.readouterr().out == "count 5 x 2.0\n"
    assert new[count] == 5 and (out == jnp.array([6.0, 8.0])).all()
    assert count.value == 0  # nothing written


def test_debug_call_with_a_sequence_is_aligned_with_get_states():
    count = es.State(jnp.array(0), name="count")
    w = es.ParamState(jnp.array([1.0, 2.0]), name="w")

    def f(x):
        count.value = count.value + 1
        return w.value * x

    sf = es.transform.StatefulFunction(f)
    sf.make_jaxpr(2.0)
    values = [jnp.array(4), jnp.array([3.0, 4.0])]
    got = sf.debug_call(values, 2.0)
    expected = sf.jaxpr_call(values, 2.0)
    assert tree_allclose(got, expected) and sf.get_cache_stats()["traces"] == 1


def test_debug_call_runs_eqstate_loops_eagerly(capsys):
    total = es.State(jnp.array(0.0), name="total")

    def f(xs):
        def step(c, x):
            print(float(x))
            total.value = total.value + x
            return c, None

        es.transform.scan(step, None, xs)
        return total.value

    jitted = es.transform.jit(f)
    new, out = jitted.debug_call(es.StateDict({total: jnp.array(1.0)}), jnp.arange(3.0))
    assert capsys.readouterr().out == "0.0\n1.0\n2.0\n"
    assert out == 4.0 and new[total] == 4.0 and total.value == 0.0


def test_debug_call_refuses_bad_state_values():
    count = es.State(jnp.array(0), name="count")
    sf = es.transform.StatefulFunction(lambda: count.value + 1)
    with pytest.raises(ValueError, match="touches 1 state"):
        sf.debug_call([])
    with pytest.raises(TypeError, match="takes a StateDict or a sequence"):
        unchecked(sf.debug_call)({count: 1})
    with pytest.raises(es.StateNotFoundError, match="count"):
        sf.debug_call(es.StateDict())


def test_jitted_function_validates_its_states():
    h = es.ShortTermState(jnp.zeros(3), name="h")
    step = es.transform.jit(lambda: h.value * 2)
    step()
    assert step.validate_states()
    with es.scope(es.StateDict({h: jnp.zeros(4)})):
        with pytest.raises(
            ValueError, match=r"'h': traced with f32\[3\], now f32\[4\]"
        ):
            step.validate_states()


def test_eval_shape_returns_the_shapes_of_every_state():
    w = es.ParamState(jnp.ones((3, 4)), name="w")
    count = es.State(jnp.array(0), name="count")

    def f(x):
        count.value = count.value + 1
        return x @ w.value, es.ShortTermState(jnp.zeros(5, jnp.int8), name="new")

    shapes, (out, new) = es.transform.eval_shape(
        f, jnp.ones((2, 3)), return_state_shapes=True
    )
    assert list(shapes) == [count, w, new]
    assert shapes[w] == jax.ShapeDtypeStruct((3, 4), jnp.float32)
    assert (shapes[count].shape, shapes[count].dtype) == ((), jnp.int32)
    assert shapes[new] == jax.ShapeDtypeStruct((5,), jnp.int8)
    assert out.shape == (2, 4) and count.value == 0
    expected = jax.eval_shape(lambda x: x @ jnp.ones((3, 4)), jnp.ones((2, 3)))
    assert out == expected


def test_make_jaxpr_returns_the_output_shapes():
    w = es.ParamState(jnp.ones(3), name="w")

    def f(x):
        return {"y": w.value * x, "n": jnp.sum(x).astype(jnp.int32)}

    jaxpr, states, shapes = es.transform.make_jaxpr(f, return_shape=True)(jnp.ones(3))
    expected_jaxpr, expected = jax.make_jaxpr(
        lambda x, w: {"y": w * x, "n": jnp.sum(x).astype(jnp.int32)},
        return_shape=True,
    )(jnp.ones(3), w.value)
    assert states == (w,) and shapes == expected
    assert len(jaxpr.eqns) == len(expected_jaxpr.eqns)
