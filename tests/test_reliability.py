"""Threads, garbage and NaN checks."""

import gc
import resource
import subprocess
import sys
import threading
import weakref

import eqstate as es
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .helpers import traces_per_key


def test_threads_with_their_own_scopes_share_one_stateful_function():
    count = es.ShortTermState(jnp.array(0), name="count")
    total = es.State(jnp.array(0.0), name="total")
    traces = []

    def step(x):
        traces.append(1)
        count.value = count.value + 1
        total.value = total.value + x
        return count.value

    sf = es.transform.StatefulFunction(step, cache_type="jit")
    results: dict[int, es.StateDict] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def work(i):
        try:
            barrier.wait()
            with es.scope(
                es.StateDict({count: jnp.array(0), total: jnp.array(0.0)})
            ) as sc:
                for _ in range(1000):
                    sf(jnp.asarray(float(i)))
            assert sc.states is not None
            results[i] = sc.states
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for i in range(8):
        assert results[i][count] == 1000 and results[i][total] == 1000.0 * i
    # One key: compiled once across the 8 threads (in two passes on the fallback).
    assert len(traces) == traces_per_key()
    assert count.value == 0 and total.value == 0.0


class _Model(eqx.Module):
    w: es.ParamState
    b: es.ParamState
    h: es.ShortTermState

    def __init__(self):
        # Fresh buffers by transfer rather than by `jnp.zeros`, which compiles on every
        # call under `jax.checking_leaks()` (that turns JAX's caches off).
        self.w = es.ParamState(jax.device_put(np.zeros((4, 4), np.float32)))
        self.b = es.ParamState(jax.device_put(np.zeros(4, np.float32)))
        self.h = es.ShortTermState(jax.device_put(np.zeros(4, np.float32)))


def _rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _alive_values(models) -> int:
    """How many values of the states of `models` (each given once, and dropped)
    are still held: by the world for a live handle, or by a cache."""
    values = []
    for model in models:
        values += [weakref.ref(s.value) for s in (model.w, model.b, model.h)]
        del model
    gc.collect()
    return sum(value() is not None for value in values)


def test_building_and_dropping_many_models_leaves_world_and_memory_flat():
    gc.collect()
    for _ in range(500):  # warm up allocators and caches
        _Model()
    gc.collect()
    rss_before = _rss_kib()
    assert _alive_values(_Model() for _ in range(10_000)) == 0
    # 10,000 models hold 30,000 states (about 2.4 MB of values); if they leaked, the
    # peak resident set would grow by far more than this tolerance of 16 MiB.
    assert _rss_kib() - rss_before < 16 * 1024


def test_dropped_jitted_constructors_leave_the_world_flat():
    make = es.transform.jit(lambda: _Model())
    assert _alive_values(make() for _ in range(200)) == 0


def test_transforms_pass_under_debug_nans():
    w = es.ParamState(jnp.array([1.0, 2.0]))
    h = es.ShortTermState(jnp.zeros(2))

    def loss(x):
        h.value = jnp.tanh(h.value + w.value * x)
        return jnp.sum(h.value**2)

    with jax.debug_nans(True):
        grads = es.transform.jit(es.transform.grad(loss, grad_states=[w]))(1.0)
        es.transform.scan(lambda c, x: (c + loss(x), None), 0.0, jnp.ones(3))
    assert jnp.isfinite(grads[w]).all()


def test_a_nan_under_debug_nans_raises_and_keeps_every_value():
    s = es.State(jnp.array(1.0), name="s")

    @es.transform.jit
    def make_nan(x):
        s.value = jnp.log(x)
        return s.value

    with jax.debug_nans(True), pytest.raises(FloatingPointError):
        make_nan(-1.0)
    assert s.value == 1.0


def test_an_inf_under_debug_infs_raises_and_keeps_every_value():
    # The porting guide's replacement for brainstate's `debug_nan`, for Infs.
    s = es.State(jnp.ones(2), name="s")

    @es.transform.jit(donate_states=True)
    def divide(x):
        s.value = s.value / x
        return s.value

    with jax.debug_infs(True), pytest.raises(FloatingPointError, match="inf"):
        with pytest.warns(UserWarning, match=r"State 's'.*jax.debug_infs"):
            divide(jnp.zeros(2))
    assert (s.value == 1).all()


def test_a_call_that_xla_refuses_to_run_keeps_every_value():
    es.random.seed(3)
    key_before = jax.random.key_data(es.random.DEFAULT.value)

    @es.transform.jit
    def too_big():
        noise = es.random.normal(())  # advances the default key
        return jnp.zeros((10**6, 10**6)) + noise  # 4 TB: refused at dispatch

    with pytest.raises(Exception, match=r"(?i)memory|RESOURCE_EXHAUSTED"):
        too_big()
    assert (jax.random.key_data(es.random.DEFAULT.value) == key_before).all()


_CURRENT = {"x": jnp.ones(2), "double": False}


@pytest.mark.parametrize(
    "transform", ["grad", "value_and_grad", "jacrev", "vmap", "checkpoint"]
)
def test_an_eager_transform_sees_the_globals_of_each_call(transform):
    # As with `jax.grad` or `jax.vmap` called eagerly, the function's Python runs on
    # each call: arrays and flags it reads from globals are the current ones, not
    # the first call's constants. (A jitted function keeps them, as `jax.jit` does.)
    w = es.ParamState(jnp.array([1.0, 2.0]))

    def loss():
        y = w.value * _CURRENT["x"]
        return jnp.sum(2 * y if _CURRENT["double"] else y)

    if transform == "vmap":
        mapped = es.transform.vmap(lambda z: loss() * z)
        run = lambda: mapped(jnp.ones(3))[0]  # noqa: E731
    elif transform == "checkpoint":
        run = es.transform.checkpoint(loss)
    else:
        made = getattr(es.transform, transform)(loss, grad_states=[w])
        run = lambda: jax.tree_util.tree_leaves(made())  # noqa: E731

    try:
        for x, double in [
            (jnp.ones(2), False),
            (jnp.full(2, 3.0), False),
            (jnp.full(2, 3.0), True),
        ]:
            _CURRENT.update(x=x, double=double)
            scale = 2.0 if double else 1.0
            value = jnp.sum(w.value * x) * scale
            want = {
                "grad": [x * scale],
                "value_and_grad": [value, x * scale],
                "jacrev": [x * scale],
                "vmap": value,
                "checkpoint": value,
            }[transform]
            got = run()
            assert jax.tree_util.tree_all(
                jax.tree_util.tree_map(lambda a, b: bool(jnp.allclose(a, b)), got, want)
            ), (transform, x, double, got, want)
    finally:
        _CURRENT.update(x=jnp.ones(2), double=False)


_FIRST_DONATION_GUARDED = """
import jax, jax.random as jr
import eqstate as es

rng = es.RandomState(0, name="rng")
draw = es.transform.jit(lambda: jr.normal(rng.split_key()), donate_states=True)
with jax.transfer_guard("disallow"):
    draw()
    draw()
"""


def test_the_first_donated_call_of_a_program_may_run_under_a_transfer_guard():
    subprocess.run(
        [sys.executable, "-c", _FIRST_DONATION_GUARDED], check=True, timeout=120
    )
