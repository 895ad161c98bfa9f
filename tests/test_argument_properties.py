"""A law for models passed as arguments: however a model is built, edited in place
between calls, or swapped for another, `jit(f)(model, x)` gives what `f(model, x)`
gives eagerly, in its output and in the value of every state.

A jitted function reuses the split of an argument that is the very object of its
previous call, after checking that the lists and dicts inside it still hold what they
held; the random edits here are what that check must catch. One jitted function and
one pool of states serve every example, so structures recur across examples and the
function's caches fill and evict as in a long run.
"""

import functools
from typing import Any

import eqstate as es
import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, note, settings

from .helpers import run_in_threads, tree_allclose


class Node(eqx.Module):
    """A module around any content: its Python numbers are static fields."""

    content: Any


POOL_SIZE = 4
# One pool for the law, and one for each thread of the threaded law.
POOLS = [
    [es.ShortTermState(jnp.zeros(2), name=f"p{p}s{i}") for i in range(POOL_SIZE)]
    for p in range(3)
]


def f(model, x):
    """Reads and writes every state in `model`, and sums every other leaf."""
    # `is True` tells a static flag (a Python bool in a Module) from a traced one.
    acc = sum(
        10.0 if leaf is True else jnp.sum(jnp.asarray(leaf))
        for leaf in jax.tree_util.tree_leaves(x)
    )
    for leaf in jax.tree_util.tree_leaves(model):
        if isinstance(leaf, es.State):
            value = leaf.value
            leaf.value = value * 0.5 + acc
            acc = acc + jnp.sum(value)
        elif isinstance(leaf, str):
            acc = acc + len(leaf)
        else:
            acc = acc + jnp.sum(jnp.asarray(leaf, jnp.float32)) * 0.25
    return acc


JITTED = es.transform.jit(f)

leaves = st.one_of(
    st.tuples(st.just("array"), st.integers(-3, 3), st.sampled_from([(), (2,)])),
    st.tuples(st.just("state"), st.integers(0, POOL_SIZE - 1)),
    st.tuples(st.just("number"), st.sampled_from([0.5, 2.0, 3])),
    st.tuples(st.just("string"), st.sampled_from(["a", "bcd"])),
    st.just(("none",)),
)
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.tuples(st.just("list"), st.lists(children, max_size=3)),
        st.tuples(st.just("tuple"), st.lists(children, max_size=3)),
        st.tuples(
            st.just("dict"),
            st.dictionaries(st.sampled_from("abc"), children, max_size=3),
        ),
        st.tuples(st.just("module"), children),
    ),
    max_leaves=6,
)
# A model: a module around a list, so that it always has a list to edit.
models = st.lists(trees, max_size=4).map(
    lambda children: ("module", ("list", children))
)
X_KINDS = ["array", "tuple", "numpy", "float", "module", "module with a flag"]


def build_x(kind: str, x: float) -> Any:
    array = jnp.full(2, x)
    return {
        "array": array,
        "tuple": (array, array + 1),
        "numpy": np.full(2, x, np.float32),
        "float": x,
        "module": Node(array),
        "module with a flag": Node((array, 2.0, True)),
    }[kind]


edits = st.one_of(
    st.just(("repeat",)),  # the same call again
    st.tuples(st.just("set item"), st.integers(0, 9), st.integers(0, 9), leaves),
    st.tuples(st.just("append"), st.integers(0, 9), leaves),
    st.tuples(st.just("pop"), st.integers(0, 9)),
    st.tuples(st.just("set key"), st.integers(0, 9), st.sampled_from("abd"), leaves),
    st.tuples(st.just("new model"), models),
    st.just(("first model",)),
    # The other argument, usually a bare array, becomes something else.
    st.tuples(st.just("new x"), st.sampled_from(X_KINDS)),
)


def build(spec, pool: list) -> Any:
    kind = spec[0]
    if kind == "array":
        return jnp.full(spec[2], float(spec[1]))
    if kind == "state":
        return pool[spec[1]]
    if kind in ("number", "string"):
        return spec[1]
    if kind == "none":
        return None
    if kind == "list":
        return [build(c, pool) for c in spec[1]]
    if kind == "tuple":
        return tuple(build(c, pool) for c in spec[1])
    if kind == "dict":
        return {k: build(c, pool) for k, c in spec[1].items()}
    return Node(build(spec[1], pool))


def containers(tree) -> list:
    """The lists and dicts inside `tree` (the model itself if it is one)."""
    found, pending = [], [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, list):
            found.append(node)
            pending.extend(node)
        elif isinstance(node, dict):
            found.append(node)
            pending.extend(node.values())
        elif isinstance(node, tuple):
            pending.extend(node)
        elif isinstance(node, Node):
            pending.append(node.content)
    return found


def edit(model, step, pool: list) -> None:
    """Applies an in-place edit to a list or dict of `model`, if it has one (and
    nothing for a repeat)."""
    found = containers(model)
    lists = [c for c in found if isinstance(c, list)]
    filled = [c for c in lists if c]
    dicts = [c for c in found if isinstance(c, dict)]
    kind = step[0]
    if kind == "set item" and filled:
        target = filled[step[1] % len(filled)]
        target[step[2] % len(target)] = build(step[3], pool)
    elif kind == "append" and lists:
        lists[step[1] % len(lists)].append(build(step[2], pool))
    elif kind == "pop" and filled:
        filled[step[1] % len(filled)].pop()
    elif kind == "set key" and dicts:
        dicts[step[1] % len(dicts)][step[2]] = build(step[3], pool)


def check_call(model, x, by_keyword: bool, pool: list, log=note) -> None:
    before = es.values_of(pool)
    out = JITTED(model=model, x=x) if by_keyword else JITTED(model, x)
    after = [np.asarray(s.value) for s in pool]
    es.assign(before)
    expected = f(model, x)
    log(f"model {model}: jitted {out}, eager {expected}")
    assert tree_allclose(out, expected, rtol=1e-5)
    assert tree_allclose(after, [np.asarray(s.value) for s in pool], rtol=1e-5)


def run_sequence(first, steps, x: float, pool: list, log=note) -> None:
    """Calls after building the first model and after each step; `log` takes the
    notes to show if the law fails."""
    es.assign(es.StateDict({s: jnp.zeros(2) for s in pool}))
    first_model = model = build(first, pool)
    x_value, x = x, jnp.full(2, x)
    check_call(model, x, False, pool, log)
    for step, by_keyword in steps:
        log(f"edit: {step}")
        if step[0] == "new model":
            model = build(step[1], pool)
        elif step[0] == "first model":
            model = first_model
        elif step[0] == "new x":
            x = build_x(step[1], x_value)
        else:
            edit(model, step, pool)
        check_call(model, x, by_keyword, pool, log)


sequences = st.tuples(
    models,
    st.lists(st.tuples(edits, st.booleans()), max_size=8),
    st.sampled_from([0.0, 1.0, -2.0]),
)


@settings(max_examples=max(20, settings().max_examples // 2))
@given(sequences)
def test_jit_of_a_model_argument_equals_the_eager_call_across_edits(sequence):
    run_sequence(*sequence, POOLS[0])


@settings(max_examples=max(10, settings().max_examples // 8))
@given(sequences, sequences)
def test_the_law_holds_with_two_threads_calling_one_jitted_function(first, second):
    """Each thread edits and calls models of its own states, at the same time."""

    def run(sequence, pool):
        log: list[str] = []  # hypothesis takes notes only from the test's thread
        try:
            for _ in range(2):
                run_sequence(*sequence, pool, log.append)
        except BaseException as e:
            e.add_note("\n".join(log))
            raise

    failures = run_in_threads(
        functools.partial(run, first, POOLS[1]),
        functools.partial(run, second, POOLS[2]),
    )
    if failures:
        raise failures[0]
