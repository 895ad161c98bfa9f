"""The bounded caches of a jitted function: the argument structures it has numbered,
its traces and its plans. Each keeps a few hundred; here they keep four, so that a
test fills them in a few calls, and what they forget stays right and is freed."""

import gc
import weakref

import eqstate as es
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from eqstate.transform import _dispatch, _function_traces, _split_args


_KEPT = 4


@pytest.fixture(autouse=True)
def _small_caches(monkeypatch):
    for module, name in [
        (_split_args, "KEYS_KEPT"),
        (_dispatch, "KEYS_KEPT"),
        (_function_traces, "CACHE_SIZE"),
    ]:
        monkeypatch.setattr(module, name, _KEPT)


def test_a_call_whose_split_forgets_its_own_part_is_still_right():
    # Numbering a new argument structure can forget the oldest, even one the same
    # call reuses.
    class Tagged(eqx.Module):
        w: es.ParamState

    model = Tagged(es.ParamState(jnp.ones(3)))

    def f(a, tag=None):
        return a.w.value.sum() + len(tag) if isinstance(a, Tagged) else a.sum()

    jitted = es.transform.jit(f)
    for i in range(12):
        assert jitted(model, "t" * i) == f(model, "t" * i)
        if i % 3 == 2:
            assert jitted(jnp.ones(2)) == 2.0  # an array-only plan becomes current


class _Model(eqx.Module):
    h: es.ShortTermState

    def __init__(self):
        self.h = es.ShortTermState(jax.device_put(np.zeros(4, np.float32)))


def test_a_jitted_function_keeps_a_bounded_number_of_dropped_models():
    f = es.transform.jit(lambda model, x: model.h.value.sum() + x)
    values = []
    for _ in range(30):
        model = _Model()
        values.append(weakref.ref(model.h.value))
        f(model, 1.0)
        del model
    gc.collect()
    # The function remembers the last few models (their argument structures,
    # traces and plans), never all thirty.
    assert sum(value() is not None for value in values) <= 2 * _KEPT
