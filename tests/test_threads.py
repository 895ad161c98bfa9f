"""One transformed function shared by threads whose states have different shapes, or
whose models call for different plans: each thread gets its own answer, and each
distinct shape is traced once."""

import concurrent.futures
import contextvars
import functools
import subprocess
import sys
import threading
import time
from collections import Counter

import eqstate as es
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .helpers import run_in_threads, traces_per_key, tree_bitwise_equal


N_THREADS = 8


def _run_in_threads(work, rounds: int) -> list[BaseException]:
    """Runs `work(n)` for n = 1..N_THREADS in threads started together, `rounds`
    times; returns the exceptions they raised."""
    errors: list[BaseException] = []
    for _ in range(rounds):
        works = [functools.partial(work, n) for n in range(1, N_THREADS + 1)]
        errors += run_in_threads(*works)
    return errors


def _is_right(n: int, mean: float, size: int) -> bool:
    # Another thread's answer is off by at least 1 in both.
    return abs(mean - n) < 1e-4 and size == n


def _make(kind: str, w: es.State, traces: Counter):
    def f():
        traces[w.value.shape] += 1
        return jnp.mean(w.value), w.value.shape[0]

    if kind == "jit":
        return es.transform.jit(f)
    if kind == "stateful_function":
        return es.transform.StatefulFunction(f)
    if kind == "stateful_function_jit":
        return es.transform.StatefulFunction(f, cache_type="jit")
    if kind == "grad":
        g = es.transform.grad(lambda: f()[0] * 1.0, grad_states=[w], return_value=True)
        return lambda: (g()[1], w.value.shape[0])
    assert kind == "scan"

    def scanned():
        (total, _), _ = es.transform.scan(
            lambda c, _: ((c[0] + f()[0], c[1]), None), (0.0, 0), None, length=2
        )
        return total / 2, w.value.shape[0]

    return scanned


@pytest.mark.parametrize(
    "kind", ["jit", "stateful_function", "stateful_function_jit", "grad", "scan"]
)
def test_threads_with_states_of_different_shapes_get_their_own_answers(kind):
    w = es.ParamState(jnp.zeros(1), name="w")
    traces: Counter = Counter()
    f = _make(kind, w, traces)
    wrong: list[tuple] = []

    def work(n):
        with es.scope(es.StateDict({w: jnp.full(n, float(n))})):
            for _ in range(10):
                mean, size = f()
                if not _is_right(n, float(mean), int(size)):
                    wrong.append((n, float(mean), int(size)))

    rounds = {"jit": 200, "grad": 5, "scan": 2}.get(kind, 20)
    assert _run_in_threads(work, rounds) == []
    assert wrong == []
    assert set(traces) == {(n,) for n in range(1, N_THREADS + 1)}
    # An eager `scan` or `grad` runs the function's Python on every call, as JAX's
    # eager transforms do.
    if kind not in ("scan", "grad"):
        # One trace per distinct shape.
        assert max(traces.values()) == traces_per_key()


def test_jaxpr_call_with_a_sequence_uses_the_trace_that_fits_the_values():
    w = es.ParamState(jnp.zeros(1), name="w")
    sf = es.transform.StatefulFunction(lambda: jnp.sum(w.value))
    wrong: list[int] = []

    def work(n):
        with es.scope(es.StateDict({w: jnp.full(n, 1.0)})):
            sf.make_jaxpr()
        for _ in range(10):
            _, out = sf.jaxpr_call([jnp.full(n, 1.0)])
            if float(out) != n:
                wrong.append(n)

    assert _run_in_threads(work, 20) == []
    assert wrong == []


def test_a_trace_never_runs_with_states_of_another_shape():
    w = es.ParamState(jnp.zeros(2), name="w")
    sf = es.transform.StatefulFunction(lambda: w.value.shape[0] * jnp.ones(()))
    assert sf() == 2
    with es.scope(es.StateDict({w: jnp.zeros(5)})):
        assert sf() == 5
    assert sf() == 2  # the first trace is still cached and still fits
    step = es.transform.jit(lambda: w.value.shape[0] * jnp.ones(()))
    assert step() == 2
    with es.scope(es.StateDict({w: jnp.zeros(7)})):
        assert step() == 7
    assert step() == 2


def test_world_states_written_by_threads_stay_consistent():
    total = es.State(jnp.array(0.0), name="total")
    add = es.transform.jit(lambda x: setattr(total, "value", total.value + x))
    lock = threading.Lock()

    def work(n):
        for _ in range(50):
            with (
                lock
            ):  # writers of one world state synchronise, as with any shared data
                add(1.0)

    assert _run_in_threads(work, 2) == []
    np.testing.assert_allclose(np.asarray(total.value), 2 * 50 * N_THREADS)


class _Holder(eqx.Module):
    content: list


def test_threads_passing_models_that_need_and_need_not_a_split_get_their_answers():
    """Two threads alternate between a model of arrays alone (its calls go to
    `jax.jit` as they are) and one holding a string (its calls are split). A call
    can find the other kind's plan current, and must recover from `jax.jit` refusing
    it, whatever plan the other thread has made current by then."""

    def f(model, x):
        leaves = jax.tree_util.tree_leaves(model)
        return x + sum(len(v) if isinstance(v, str) else v for v in leaves)

    jitted = es.transform.jit(f)
    models = [_Holder([jnp.ones(())]), _Holder(["ab"])]

    def run(first):
        x = jnp.zeros(())
        for i in range(300):
            model = models[(first + i) % 2]
            assert jitted(model, x) == f(model, x)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads take turns within calls
    try:
        failures = run_in_threads(functools.partial(run, 0), functools.partial(run, 1))
    finally:
        sys.setswitchinterval(switch)
    assert not failures, failures[0]


def test_threads_drawing_eagerly_from_the_default_key_get_different_numbers():
    # Vectors: 800 single float32 draws from different keys coincide now and then.
    es.random.seed(55)
    draws: list[tuple[float, ...]] = []

    def work():
        for _ in range(100):
            draws.append(tuple(es.random.uniform((4,)).tolist()))
            draws.append(
                tuple(es.random.uniform((4,), key=es.random.split_key()).tolist())
            )

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads take turns within draws
    try:
        assert run_in_threads(*[work] * 4) == []
    finally:
        sys.setswitchinterval(switch)
    assert len(set(draws)) == len(draws) == 800


_WORLD_WHILE_THE_DEFAULT_KEY_IS_MADE = """
import gc, threading, time
import eqstate as es
import jax
import jax.numpy as jnp

jnp.zeros(1).block_until_ready()
garbage = [es.State(jnp.zeros(1), name="garbage")]
garbage.append(garbage)  # only the cycle collector drops the state
del garbage
make_key, making = jax.random.key, threading.Event()

def slow_make(seed):  # as making the default key may: slow, and collecting garbage
    making.set()
    time.sleep(0.3)  # meanwhile the other thread asks for the world
    gc.collect()
    return make_key(seed)

jax.random.key = slow_make
first_draw = threading.Thread(target=lambda: es.random.DEFAULT.value, daemon=True)
first_draw.start()
making.wait()
world = es.world()
first_draw.join()
assert world[es.random.DEFAULT] is es.random.DEFAULT.value
"""


def test_the_world_taken_while_another_thread_makes_the_default_key_does_not_deadlock():
    subprocess.run(
        [sys.executable, "-c", _WORLD_WHILE_THE_DEFAULT_KEY_IS_MADE],
        check=True,
        timeout=60,
        capture_output=True,
    )


def test_threads_building_ensembles_with_vmap2_new_states_get_different_keys():
    def member():
        time.sleep(0.2)  # a slow trace, as a real constructor's
        return es.ParamState(es.random.normal((3,)), name="w")

    make = es.transform.vmap2_new_states(member, axis_size=2)
    built = [None, None]

    def build(i):
        w, states = make()
        built[i] = states[w]

    threads = [threading.Thread(target=build, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not (built[0] == built[1]).all()


def test_a_thread_pool_inside_a_scope_runs_in_the_world_unless_given_the_context():
    # As docs/concepts.md says: each pool thread has its own stack of contexts.
    n = es.State(jnp.array(0), name="n")

    def increment():
        n.value = n.value + 1

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        with es.scope(es.values_of(n)) as plain:
            pool.submit(increment).result()
        with es.scope(es.values_of(n)) as copied:
            pool.submit(contextvars.copy_context().run, increment).result()
    # The plain task wrote the world (0 -> 1), not the scope.
    assert plain.states[n] == 0 and n.value == 1 and copied.states[n] == 2


def _successors(key, n: int):
    """The `n` keys the default key hands out in turn from `key` (each call takes
    one and leaves `split(key)[0]`), stacked, and the key after them."""
    end, keys = jax.lax.scan(lambda k, _: (jax.random.split(k)[0], k), key, length=n)
    return keys, end


def _fast_switching(run):
    """`run()` with the threads taking turns within calls."""
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        return run()
    finally:
        sys.setswitchinterval(switch)


def test_threads_calling_a_jitted_sampler_at_once_each_get_their_own_key(getkey):
    es.random.set_key(getkey())
    sample = es.transform.jit(lambda: jax.random.key_data(es.random.split_key()))
    sample()
    start = es.random.get_key()
    drawn: list[tuple[int, ...]] = []

    def work():
        for _ in range(200):
            drawn.append(tuple(np.asarray(sample()).tolist()))

    assert _fast_switching(lambda: run_in_threads(*[work] * 4)) == []
    keys, end = _successors(start, 800)
    expected = jax.random.key_data(jax.vmap(lambda k: jax.random.split(k)[1])(keys))
    # Every key of the sequence was handed out once, and the default key advanced
    # once per call: no read of the key was lost.
    assert sorted(drawn) == sorted(map(tuple, np.asarray(expected).tolist()))
    assert tree_bitwise_equal(es.random.get_key(), end)


def test_threads_building_ensembles_at_once_get_different_ensembles(getkey):
    es.random.set_key(getkey())

    def member():
        time.sleep(0.2)  # a slow trace, as a real constructor's
        return es.ParamState(es.random.normal((3,)), name="w")

    build = es.transform.vmap_new_states(member, axis_size=2)
    start = es.random.get_key()
    built = []
    assert run_in_threads(*[lambda: built.append(build().value)] * 4) == []
    keys, end = _successors(start, 4)

    def ensemble(key):
        per_lane = jax.vmap(jax.random.split)(
            jax.random.split(jax.random.split(key)[1], 2)
        )
        return jax.vmap(lambda k: jax.random.normal(jax.random.split(k)[1], (3,)))(
            per_lane[:, 0]
        )

    expected = [np.asarray(ensemble(k)).tobytes() for k in keys]
    assert sorted(np.asarray(w).tobytes() for w in built) == sorted(expected)
    assert tree_bitwise_equal(es.random.get_key(), end)


def _draw_in(transform: str):
    """A call of `transform` that draws once from the default key, returning a float
    that depends on the key it drew from."""
    if transform == "grad":
        g = es.transform.grad(lambda x: x * es.random.normal(()))
        return lambda: float(g(1.0))
    if transform == "vmap":
        v = es.transform.vmap(lambda x: x + es.random.normal(()), axis_size=2)
        return lambda: float(v(jnp.zeros(2)).sum())
    if transform == "scan":
        return lambda: float(
            es.transform.scan(
                lambda c, _: (c + es.random.normal(()), None), 0.0, None, length=2
            )[0]
        )
    if transform == "scan_without_jit":

        def scanned():
            with jax.disable_jit():
                return float(
                    es.transform.scan(
                        lambda c, _: (c + es.random.normal(()), None),
                        0.0,
                        None,
                        length=2,
                    )[0]
                )

        return scanned
    if transform == "cond":
        return lambda: float(
            es.transform.cond(True, lambda: es.random.normal(()), lambda: 0.0)
        )
    if transform == "stateful_function":
        f = es.transform.StatefulFunction(lambda: es.random.normal(()))
        return lambda: float(f())
    assert transform == "checkpoint"
    c = es.transform.checkpoint(lambda: es.random.normal(()))
    return lambda: float(c())


@pytest.mark.parametrize(
    "transform",
    [
        "grad",
        "vmap",
        "scan",
        "scan_without_jit",
        "cond",
        "stateful_function",
        "checkpoint",
    ],
)
def test_threads_calling_a_transform_that_draws_each_get_their_own_key(
    getkey, transform
):
    es.random.set_key(getkey())
    call = _draw_in(transform)
    call()
    start = es.random.get_key()
    drawn: list[float] = []

    def work():
        for _ in range(25):
            drawn.append(call())

    assert _fast_switching(lambda: run_in_threads(*[work] * 4)) == []
    assert len(set(drawn)) == len(drawn) == 100
    draws_per_call = 2 if transform.startswith("scan") else 1
    end = _successors(start, 100 * draws_per_call)[1]
    assert tree_bitwise_equal(es.random.get_key(), end)
