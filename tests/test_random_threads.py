"""The law of the default key under threads: however threads interleave eager draws,
jitted draws, `vmap` lanes and `vmap_new_states` builds, no key is handed out twice.
The calls line up in one sequence in which each took the key the one before left, and
the default key ends where that sequence ends (no read of it is lost)."""

import functools

import eqstate as es
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from hypothesis import given, note, settings

from .helpers import run_in_threads, tree_bitwise_equal


def _drawn() -> jax.Array:
    return jr.key_data(es.random.split_key())


_jitted = es.transform.jit(_drawn)
_lanes = es.transform.vmap(lambda _: _drawn(), axis_size=2)
_build = es.transform.vmap_new_states(lambda: es.State(_drawn(), name="k"), axis_size=2)

# Each call, and what it returns: the data of the keys it drew, one row per draw.
CALLS = {
    "eager": lambda: _drawn()[None],
    "jit": lambda: _jitted()[None],
    "vmap": lambda: _lanes(jnp.zeros(2)),
    "build": lambda: _build().value,
}


# What each call returns, and the key it leaves, from the key it took (plain JAX).
@jax.jit
def _one_draw(key):
    successor, drawn = jr.split(key)
    return jr.key_data(drawn)[None], successor


@jax.jit
def _vmap_lanes(key):
    keys = jr.split(key, 3)  # the state keeps key 0, lane i gets key i + 1
    return jax.vmap(lambda k: jr.key_data(jr.split(k)[1]))(keys[1:]), keys[0]


@jax.jit
def _ensemble(key):
    outer, lanes = jr.split(key)
    defaults = jax.vmap(jr.split)(jr.split(lanes, 2))[:, 0]
    return jax.vmap(lambda k: jr.key_data(jr.split(k)[1]))(defaults), outer


EXPECTED = {
    "eager": _one_draw,
    "jit": _one_draw,
    "vmap": _vmap_lanes,
    "build": _ensemble,
}


def _in_one_sequence(start, results: list[tuple[str, bytes]]):
    """Lines up `results` (`(call, output)` pairs) in the one order in which each
    call took the key the one before left; returns the key the last one left.
    Fails if a call's output was made from a key no call of the sequence took (two
    calls took one key, or a call took a key that another left unwritten)."""
    pending = dict.fromkeys(results, 0)
    for result in results:
        pending[result] += 1
    key = start
    for _ in range(len(results)):
        for kind, expected in EXPECTED.items():
            out, successor = expected(key)
            found = (kind, np.asarray(out).tobytes())
            if pending.get(found):
                pending[found] -= 1
                key = successor
                break
        else:
            raise AssertionError(
                f"no remaining call took the key {jr.key_data(key)}: "
                f"{sum(pending.values())} of {len(results)} calls left"
            )
    return key


_THREADS = st.lists(
    st.lists(st.sampled_from(sorted(CALLS)), min_size=1, max_size=5),
    min_size=2,
    max_size=4,
)


@settings(max_examples=max(settings.default.max_examples // 8, 10))
@given(_THREADS, st.integers(0, 2**31 - 1))
def test_no_key_is_handed_out_twice_by_threads_mixing_draws_and_builds(calls, seed):
    note(f"calls per thread: {calls}")
    es.random.seed(seed)
    start = es.random.get_key()
    results: list[tuple[str, bytes]] = []

    def run(mine):
        for kind in mine:
            results.append((kind, np.asarray(CALLS[kind]()).tobytes()))

    assert run_in_threads(*(functools.partial(run, mine) for mine in calls)) == []
    end = _in_one_sequence(start, results)
    assert tree_bitwise_equal(es.random.get_key(), end)
