import importlib
import threading
import types
import warnings

import jax
import jax.numpy as jnp
import pytest
from eqstate import _jax_compat as compat
from jax.sharding import PartitionSpec as P

from .helpers import leak_a_tracer, traces_per_key


def test_top_level_is_detected_outside_and_inside_transforms():
    assert compat.is_top_level()
    inside = []
    jax.jit(lambda x: inside.append(compat.is_top_level()) or x)(1.0)
    jax.vmap(lambda x: inside.append(compat.is_top_level()) or x)(jnp.ones(2))
    assert inside == [False, False]


def test_top_level_is_per_thread_and_restored_after_a_failed_transform():
    seen = []

    def in_a_thread(x):
        worker = threading.Thread(target=lambda: seen.append(compat.is_top_level()))
        worker.start()
        worker.join()
        seen.append(compat.is_top_level())
        return x

    jax.jit(in_a_thread)(1.0)
    assert seen == [True, False]  # another thread is not inside this one's trace

    def fails(x):
        raise RuntimeError("inside")

    with pytest.raises(RuntimeError):
        jax.grad(fails)(1.0)
    assert compat.is_top_level()


def test_current_trace_differs_inside_a_transform_and_is_stable_within_it():
    outside = compat.current_trace()
    seen = []

    def f(x):
        seen.append(compat.current_trace())
        seen.append(compat.current_trace())
        return x

    jax.jit(f)(1.0)
    assert seen[0] is seen[1] and seen[0] is not outside


def test_from_jax_takes_the_name_from_the_first_module_that_has_it():
    newest = types.SimpleNamespace()
    older = types.SimpleNamespace(f="older")
    private = types.SimpleNamespace(f="private")
    assert compat._from_jax("f", (newest, older, private)) == "older"
    assert compat._from_jax("f", (None, newest, private)) == "private"
    assert compat._from_jax("f", (newest,)) is None


def _in_trace_records_into_the_given_trace():
    def f(x):
        outer = compat.current_trace()

        def inner(y):
            with compat.in_trace(outer):
                assert compat.current_trace() is outer
                z = x * 2
            assert z._trace is outer
            return y + z

        return jax.vmap(inner)(jnp.ones(3))

    assert (jax.jit(f)(1.0) == 3).all()


def test_in_trace_records_into_the_given_trace():
    _in_trace_records_into_the_given_trace()


# Both homes of `set_current_trace` eqstate uses, wherever the installed JAX has them:
# `jax.extend.core` from JAX 0.10 on, `jax._src.core` on every supported release.
@pytest.mark.parametrize("home", ["jax.extend.core", "jax._src.core"])
def test_in_trace_works_with_set_current_trace_from_each_home(home, monkeypatch):
    found = getattr(importlib.import_module(home), "set_current_trace", None)
    if found is None:
        pytest.skip(f"this JAX has no {home}.set_current_trace")
    monkeypatch.setattr(compat, "_set_current_trace", found)
    _in_trace_records_into_the_given_trace()


def test_the_public_fallbacks_agree_with_the_private_trace_context():
    assert compat._current_trace_public() is compat.current_trace()
    assert compat._is_top_level_public()
    seen = []

    def f(x):
        seen.append(compat._current_trace_public() is compat.current_trace())
        seen.append(compat._is_top_level_public())
        return x

    jax.jit(f)(1.0)
    jax.vmap(f)(jnp.ones(2))
    assert seen == [True, False, True, False]


# The tests of the single-pass hook ask for it: `EQSTATE_TEST_TWO_PASS=1` turns it off.
@compat.use_single_pass(True)
def test_new_input_adds_a_jaxpr_input_mid_trace():
    def f(x):
        trace = compat.current_trace()
        assert compat.can_add_inputs(trace)
        y = compat.new_input(trace, jax.ShapeDtypeStruct((2,), jnp.float32))
        return x + y

    jaxpr = jax.make_jaxpr(f)(jnp.ones(2))
    assert len(jaxpr.jaxpr.invars) == 2
    out = jax.extend.core.jaxpr_as_fun(jaxpr)(jnp.ones(2), jnp.full(2, 2.0))
    assert (out[0] == 3).all()


@compat.use_single_pass(True)
def test_single_pass_can_be_switched_off_for_a_block():
    assert compat.single_pass_enabled()
    with compat.use_single_pass(False):
        assert not compat.single_pass_enabled()
        trace_checks = []
        jax.make_jaxpr(
            lambda x: (
                trace_checks.append(compat.can_add_inputs(compat.current_trace())) or x
            )
        )(1.0)
        assert trace_checks == [False]
    assert compat.single_pass_enabled()


def test_is_batched_here_tells_mapped_from_broadcast_values():
    seen = []

    def f(x, y):
        seen.append((compat.is_batched_here(x), compat.is_batched_here(y)))
        return x + y

    jax.vmap(f, in_axes=(0, None))(jnp.ones(3), jnp.ones(()))
    assert seen == [(True, False)]


def test_is_batched_here_looks_at_the_innermost_vmap_only():
    seen = []

    def inner(x, y):
        seen.append((compat.is_batched_here(x), compat.is_batched_here(y)))
        return x + y

    jax.vmap(lambda x: jax.vmap(inner, in_axes=(None, 0))(x, jnp.ones(2)))(jnp.ones(3))
    assert seen == [(False, True)]


def test_evaluates_at_once_tells_eager_transforms_from_staging_ones():
    seen = {}

    def probe(tag):
        def f(x):
            seen[tag] = compat.evaluates_at_once()
            return x

        return f

    jax.vmap(probe("vmap"))(jnp.ones(2))
    jax.grad(lambda x: probe("grad")(x).sum())(jnp.ones(2))
    jax.jvp(probe("jvp"), (jnp.ones(2),), (jnp.ones(2),))
    jax.jit(probe("jit"))(jnp.ones(2))
    jax.vmap(jax.jit(probe("vmap-jit")))(jnp.ones(2))
    jax.jit(jax.vmap(probe("jit-vmap")))(jnp.ones(2))
    jax.lax.scan(lambda c, x: (c, probe("scan")(x)), 0.0, jnp.ones(2))
    assert seen == {
        "vmap": True,
        "grad": True,
        "jvp": True,
        "jit": False,
        "vmap-jit": False,
        "jit-vmap": False,
        "scan": False,
    }
    assert compat.evaluates_at_once()  # at top level


def test_differentiation_inside_finds_the_innermost_raw_differentiation():
    seen = {}

    def probe(tag, outer=None):
        def f(x):
            seen[tag] = compat.differentiation_inside(outer) is not None
            return jnp.sum(x)

        return f

    jax.grad(probe("grad"))(jnp.ones(2))
    jax.vjp(probe("vjp"), jnp.ones(2))
    jax.jvp(probe("jvp"), (jnp.ones(2),), (jnp.ones(2),))
    jax.grad(lambda x: jax.vmap(probe("grad-vmap"))(x).sum())(jnp.ones((2, 2)))
    jax.vmap(probe("vmap"))(jnp.ones((2, 2)))
    jax.jit(probe("jit"))(jnp.ones(2))
    jax.grad(jax.jit(probe("grad-jit")))(jnp.ones(2))
    probe("top level")(jnp.ones(2))

    def inside(x):  # A differentiation inside a trace, seen from that trace.
        outer = compat.current_trace()
        probe("own trace", outer)(x)
        jax.grad(probe("nested", outer))(x)
        return x

    jax.make_jaxpr(inside)(jnp.ones(2))
    assert seen == {
        "grad": True,
        "vjp": True,
        "jvp": True,
        "grad-vmap": True,
        "vmap": False,
        "jit": False,
        "grad-jit": False,
        "top level": False,
        "own trace": False,
        "nested": True,
    }


def test_is_traced_by_follows_values_into_nested_transforms():
    seen = []
    constant = jnp.ones(2)

    def f(x):
        trace = compat.differentiation_inside(None)
        seen.append(
            (compat.is_traced_by(x, trace), compat.is_traced_by(constant, trace))
        )
        jax.vmap(lambda y: seen.append((compat.is_traced_by(y, trace),)) or y)(x)
        return jnp.sum(x)

    jax.grad(f)(jnp.ones(2))
    assert seen == [(True, False), (True,)]


def test_without_telling_differentiations_apart_a_parameter_read_does_not_warn(
    monkeypatch,
):
    import eqstate as es

    monkeypatch.setattr(compat, "_DIFFERENTIATING_TRACES", ())
    w = es.ParamState(jnp.ones(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (jax.grad(lambda x: jnp.sum(w.value * x))(jnp.ones(2)) == 1).all()


def test_is_dead_tracer_tells_leaked_tracers_from_live_ones():
    live = []

    def f(x):
        live.append(compat.is_dead_tracer(x))
        return x

    jax.jit(f)(jnp.ones(2))
    assert live == [False]
    assert compat.is_dead_tracer(leak_a_tracer((2,)))
    assert not compat.is_dead_tracer(jnp.ones(2))


def test_nan_checks_enabled_follows_the_context_managers():
    assert not compat.nan_checks_enabled()
    with jax.debug_nans(True):
        assert compat.nan_checks_enabled()
    with jax.debug_infs(True):
        assert compat.nan_checks_enabled()
    assert not compat.nan_checks_enabled()


@pytest.mark.parametrize("check_vma", (True, False))
def test_vary_types_a_value_as_varying_inside_shard_map(check_vma):
    mesh = jax.make_mesh(
        (len(jax.devices()),), ("x",), axis_types=(jax.sharding.AxisType.Auto,)
    )
    seen = []

    def f(a):
        seen.append(compat.varying_axes(compat.vary(a, ("x",))))
        seen.append(compat.vary(a, ()) is a)
        return a

    jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=check_vma)(
        jnp.ones(2)
    )
    assert seen == [frozenset({"x"}) if check_vma else frozenset(), True]


def test_a_collectives_effect_cannot_fail_at_run_time_but_a_callbacks_can():
    mesh = jax.make_mesh(
        (len(jax.devices()),), ("x",), axis_types=(jax.sharding.AxisType.Auto,)
    )

    def effects(f, *args):
        return [
            e for eqn in _all_eqns(jax.make_jaxpr(f)(*args).jaxpr) for e in eqn.effects
        ]

    summed = jax.shard_map(
        lambda a: jax.lax.psum(a + jax.lax.axis_index("x").astype(a.dtype), "x"),
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P(),
    )
    collective = effects(summed, jnp.ones(len(jax.devices())))
    assert collective and not any(map(compat.can_fail_at_run_time, collective))
    callback = effects(lambda a: jax.debug.callback(print, a), 1.0)
    assert callback and all(map(compat.can_fail_at_run_time, callback))


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from _all_eqns(inner)


def test_flat_trees_in_a_scan_compare_by_value():
    def grouping(jaxpr):
        params = jaxpr.eqns[0].params.values()
        return [p for p in params if isinstance(p, compat.FLAT_TREES)]

    def traced():
        body = lambda c, x: ((c[0] + x, c[1]), x)  # noqa: E731
        return jax.make_jaxpr(lambda xs: jax.lax.scan(body, (0.0, 1.0), xs))(
            jnp.ones(3)
        ).jaxpr

    first, second = grouping(traced()), grouping(traced())
    assert len(first) == (2 if compat.FLAT_TREES else 0)
    assert first == second and [hash(g) for g in first] == [hash(g) for g in second]


def test_trace_eras_key_jax_caches_of_traces_apart():
    assert compat.KEEPS_TRACES_APART
    runs = []

    @jax.jit
    def traced(x):
        runs.append(None)
        return x + 1

    def call_in_era() -> None:
        jax.make_jaxpr(lambda x: traced(x))(1.0)

    previous = compat.enter_trace_era()
    try:
        call_in_era()
        call_in_era()  # the same era: JAX's cache
        assert len(runs) == 1
        compat.new_trace_era()
        call_in_era()  # a new era: traced again
        assert len(runs) == 2
    finally:
        compat.leave_trace_era(previous)
    jax.make_jaxpr(lambda x: traced(x))(1.0)  # outside every era: apart too
    assert len(runs) == 3
    compat.new_trace_era()  # outside every frame: the top level keeps its context
    jax.make_jaxpr(lambda x: traced(x))(1.0)
    assert len(runs) == 3


def test_trace_context_follows_configuration_and_mapped_axes_but_not_eras():
    outside = compat.trace_context()
    assert hash(outside) == hash(compat.trace_context())
    assert compat.trace_context() == outside
    with jax.enable_x64(True):
        assert compat.trace_context() != outside
    with jax.numpy_rank_promotion("warn"):  # the tests run with "raise"
        assert compat.trace_context() != outside
    assert compat.trace_context() == outside
    seen = []

    def f(x):
        seen.append(compat.trace_context())
        return x

    for n in (2, 3, 2):
        jax.vmap(f, axis_name="i")(jnp.ones(n))
    assert seen[0] == seen[2] != seen[1]
    assert outside not in seen
    # As inside the axes, from outside them (as `jax.make_jaxpr(axis_env=...)`).
    assert compat.trace_context([("i", 2)]) == seen[0] != seen[1]
    assert compat.trace_context([("i", 3)]) == seen[1]
    previous = compat.enter_trace_era()
    try:
        compat.new_trace_era()
        assert compat.trace_context() == outside
        assert isinstance(compat._TRACE_CONTEXT.value, int)  # left as it was
    finally:
        compat.leave_trace_era(previous)


def test_without_a_trace_context_no_trace_is_reused_and_results_stay_right(
    monkeypatch,
):
    import eqstate as es

    assert compat._never_equal() != compat._never_equal([("i", 2)])
    monkeypatch.setattr(compat, "trace_context", compat._never_equal)
    runs, total = [], es.State(jnp.zeros(2), name="total")

    @es.transform.jit
    def add(x):
        runs.append(None)
        total.value = total.value + x
        return total.value.sum()

    for _ in range(3):
        add(jnp.ones(2))
    assert (total.value == 3).all()
    assert len(runs) > traces_per_key()  # a later call traced again
    scaled = es.transform.jit(lambda x: x * total.value / jax.lax.axis_size("i"))
    for n in (2, 4):
        got = es.transform.vmap(scaled, axis_name="i")(jnp.ones((n, 2)))
        assert got == pytest.approx(jnp.full((n, 2), 3 / n))


def test_trace_eras_are_apart_between_threads():
    eras = []

    def enter_and_leave():
        previous = compat.enter_trace_era()
        eras.append(compat._TRACE_CONTEXT.value)
        compat.leave_trace_era(previous)

    workers = [threading.Thread(target=enter_and_leave) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    enter_and_leave()
    assert len(set(eras)) == 3


def test_stages_inside_tells_staging_transforms_between_two_traces():
    seen = []

    def inside(x):
        outer = compat.current_trace()
        jax.vmap(lambda y: seen.append(compat.stages_inside(outer)) or y)(x)
        jax.jit(lambda y: seen.append(compat.stages_inside(outer)) or y)(x)
        seen.append(compat.stages_inside(outer))
        return x

    jax.make_jaxpr(inside)(jnp.ones(2))
    assert seen == [False, True, False]


def test_without_trace_eras_a_read_from_a_nested_staging_transform_raises(
    monkeypatch,
):
    import eqstate as es

    monkeypatch.setattr(compat, "KEEPS_TRACES_APART", False)
    w = es.State(jnp.array(2.0), name="w")
    with pytest.raises(es.TraceContextError, match="Cannot read State 'w'"):
        es.transform.jit(lambda x: jax.jit(lambda y: y * w.value)(x))(1.0)
    assert es.transform.jit(lambda x: jax.vmap(lambda y: y * w.value)(x))(
        jnp.ones(2)
    ).tolist() == [2.0, 2.0]


def test_distributed_client_is_none_until_jax_distributed_is_initialised():
    # `tests/test_multi_process_checkpoints.py` uses it in processes that did.
    assert compat.distributed_client() is None


def test_weakly_typed_keeps_value_dtype_and_device():
    x = jnp.arange(3.0)
    weak = compat.weakly_typed(x)
    assert weak.weak_type and weak.dtype == x.dtype and weak.sharding == x.sharding
    assert (weak == x).all()


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_key_buffer_is_the_data_of_a_key(impl):
    key = jax.random.split(jax.random.key(3, impl=impl), 4)
    data = compat.key_buffer(key)
    assert data.is_ready()
    assert (data == jax.random.key_data(key)).all()
