"""map: `jax.lax.map` for functions that use states, sequential or in vmapped
chunks."""

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import jax.tree_util as jtu

from .. import _jax_compat as compat
from .._arguments import integer
from .._pretty_print import state_label
from .._state import draws_atomically, RandomState, split_and_advance, State
from ._common import (
    hide_static,
    merge_leading_axes,
    show_static,
    strong,
    WeakCarry,
)
from ._discovery import Discovery
from ._equinox_errors import with_equinox_errors
from ._loops import loop_length, scan_states, slice_of
from ._trace import sub_jaxprs, Trace
from ._vmap import key_after_lanes, written_alike, written_per_lane


_Y = TypeVar("_Y")


compat.hide_from_tracebacks(__file__)


_MAP = (
    "`map`",
    "xs",
    "`map` needs arrays to map over: `map(f, xs)` calls `f(x)` for each slice `x` of "
    "`xs` along its leading axis.",
)

_CARRIED_OVER = (
    "`map` with `batch_size` runs the elements of a chunk at once, so an element "
    "cannot see what the element before it wrote; but {label} may carry a value "
    "from one element to the next: the function uses its value from before the "
    "call to compute what it returns or writes, or eqstate cannot tell that it does "
    "not (the state passes through a nested loop, which eqstate assumes uses it). "
    "Map sequentially (`batch_size=None`), or use `eqstate.transform.for_loop`."
)


def _uses_old_value(entry: Trace, states: Sequence[State]) -> list[State]:
    """Those of `states` whose value before the call reaches an output of the
    function (its return value or a written value): data flow through its jaxpr."""
    jaxpr = entry.jaxpr.jaxpr
    used = _used_inputs(jaxpr, [True] * len(jaxpr.outvars))
    start = len(jaxpr.invars) - sum(d.num_leaves for d in entry.state_defs)
    found = []
    for state, treedef in zip(entry.states, entry.state_defs):
        stop = start + treedef.num_leaves
        if state in states and any(used[start:stop]):
            found.append(state)
        start = stop
    return found


# Primitives whose nested jaxprs take the equation's inputs after the first `offset`
# (always used) and give its outputs, one for one: a nested transform passes a state's
# value in even where its function only overwrites it.
_CALL_OFFSETS = {"jit": 0, "closed_call": 0, "remat2": 0, "cond": 1}


def _used_inputs(jaxpr: jex_core.Jaxpr, used_outputs: Sequence[bool]) -> list[bool]:
    """Which inputs of `jaxpr` reach the outputs marked in `used_outputs`."""
    live = {
        v
        for v, used in zip(jaxpr.outvars, used_outputs)
        if used and not isinstance(v, jex_core.Literal)
    }
    for eqn in reversed(jaxpr.eqns):
        wanted = [v in live for v in eqn.outvars]
        if any(wanted):
            live.update(
                v
                for v, used in zip(eqn.invars, _eqn_used_inputs(eqn, wanted))
                if used and not isinstance(v, jex_core.Literal)
            )
    return [v in live for v in jaxpr.invars]


def _eqn_used_inputs(eqn: jex_core.JaxprEqn, wanted: list[bool]) -> list[bool]:
    """Which inputs of `eqn` its `wanted` outputs use: looked up in the nested jaxprs
    of a known call or conditional; all of them for any other equation."""
    offset = _CALL_OFFSETS.get(eqn.primitive.name)
    subs = sub_jaxprs(eqn.params)
    n = len(eqn.invars) - (offset or 0)
    if (
        offset is None
        or not subs
        or any(len(s.invars) != n or len(s.outvars) != len(wanted) for s in subs)
    ):
        return [True] * len(eqn.invars)
    per_sub = [_used_inputs(s, wanted) for s in subs]
    return [True] * offset + [any(used) for used in zip(*per_sub)]


@draws_atomically
def _in_chunks(f: Callable, xs: tuple, n: int, size: int) -> Any:
    """`map` with `batch_size=size`: a scan over chunks of `size` elements, each
    vmapped, then the remaining elements, vmapped."""
    traced = Discovery(f, show_static(slice_of(xs)), name=getattr(f, "__name__", None))
    traced.refuse_new_states("`map`")
    values = dict(zip(traced.states, traced.values))
    # A key the function draws from is split per element; one it only overwrites is
    # like any other overwritten state.
    randoms = _uses_old_value(
        traced.trace,
        [
            s
            for s in traced.states
            if isinstance(s, RandomState) and jnp.ndim(values[s]) == 0
        ],
    )
    written = [s for s in traced.written if s not in randoms]
    carried_over = _uses_old_value(traced.trace, written)
    if carried_over:
        raise ValueError(_CARRIED_OVER.format(label=state_label(carried_over[0])))
    carried = [*written, *randoms]
    entry = [values[s] for s in carried]
    weak = WeakCarry(entry)
    chunk = _chunk_function(traced, values, written, randoms, weak)
    state_values, ys = with_equinox_errors(
        lambda entry, xs: _scan_chunks(chunk, entry, xs, n, size), strong(entry), xs
    )
    traced.commit(dict(zip(carried, weak.restored(state_values))))
    return show_static(ys)


def _chunk_function(
    traced: Discovery,
    values: dict[State, Any],
    written: Sequence[State],
    randoms: Sequence[State],
    weak: WeakCarry,
) -> Callable[[list, tuple, int], tuple[list, Any]]:
    """One chunk of `count` elements, vmapped: takes and returns the values of the
    carried states (`written`, then `randoms`; their weak types in `weak`), and
    returns the elements' outputs."""

    def chunk(carried_values: list, chunk_xs: tuple, count: int) -> tuple[list, Any]:
        current = dict(values)
        current.update(zip([*written, *randoms], weak.restored(carried_values)))
        # As in `vmap`: every element draws from its own key, and the key advances
        # once per chunk.
        advanced, keys = [], []
        for s in randoms:
            outer, lane_keys = split_and_advance(current[s], count)
            advanced.append(outer)
            keys.append(lane_keys)
        element = _element_function(traced, current, written, randoms)
        ys, new_values, alike, per_lane = jax.vmap(element, out_axes=(0, 0, None, 0))(
            keys, chunk_xs
        )
        # The value the chunk's last element wrote, as in a sequential map.
        last = [jtu.tree_map(lambda v: v[-1], v) for v in new_values]
        for i, value in enumerate(last):
            weak.written(i, value)
        # A key every element wrote alike (a reseed) is kept, as in `vmap`.
        advanced = [
            key_after_lanes(same, lanes, a, count)
            for a, same, lanes in zip(advanced, alike, per_lane)
        ]
        return strong([*last, *advanced]), ys

    return chunk


def _element_function(
    traced: Discovery,
    current: dict[State, Any],
    written: Sequence[State],
    randoms: Sequence[State],
) -> Callable[[list, tuple], tuple[Any, list, list, list]]:
    """One element of a chunk: `traced` evaluated with its own random keys, returning
    its output, what it wrote to `written`, and the keys it wrote to `randoms`: alike
    in every element by construction, and those that may differ (see
    `key_after_lanes`)."""

    def element(element_keys: list, x: tuple) -> tuple[Any, list, list, list]:
        here = dict(current)
        here.update(zip(randoms, element_keys))
        out, updates, _ = traced.evaluate(
            [here[s] for s in traced.states], show_static(x)
        )
        alike = [written_alike(updates.get(s)) for s in randoms]
        per_lane = [written_per_lane(updates.get(s)) for s in randoms]
        return hide_static(out), [updates[s] for s in written], alike, per_lane

    return element


def _scan_chunks(
    chunk: Callable, state_values: list, xs: tuple, n: int, size: int
) -> tuple[list, Any]:
    """`chunk` scanned over the `n // size` whole chunks of `xs`, then run on the
    `n % size` remaining elements: the final state values and the stacked outputs."""
    main, rest = divmod(n, size)
    parts = []
    if main:
        batched = jtu.tree_map(
            lambda a: a[: main * size].reshape(main, size, *a.shape[1:]), xs
        )
        state_values, ys = jax.lax.scan(
            lambda c, x: chunk(c, x, size), state_values, batched
        )
        parts.append(merge_leading_axes(ys))
    if rest:
        tail = jtu.tree_map(lambda a: a[main * size :], xs)
        state_values, ys = chunk(state_values, tail, rest)
        parts.append(ys)
    if len(parts) == 1:
        return state_values, parts[0]
    return state_values, jtu.tree_map(lambda a, b: jnp.concatenate([a, b]), *parts)


def map(f: Callable[..., _Y], *xs: Any, batch_size: int | None = None) -> _Y:
    """Like `jax.lax.map`, for a function that reads and writes states: calls
    `f(*x)` for each slice `x` of `xs` along their leading axis, and stacks the
    outputs.

    Without `batch_size` the elements are mapped one after the other, as in
    [`eqstate.transform.for_loop`][]: each element sees what the one before it
    wrote, and the states end with the last element's writes.

    With `batch_size`, chunks of that many elements run at once under `jax.vmap`, one
    chunk after the other, and the remaining elements in a last, smaller chunk (as
    `jax.lax.map` does): more parallel than the sequential map, with less memory than
    one `vmap` over everything. The elements of a chunk cannot see each other's
    writes, so a state whose old value the function uses (a counter, a recurrent
    state) raises `ValueError`; a state the function only overwrites ends with the
    last element's write, as in the sequential map. Random states drawn from are
    split per element (every element draws different numbers), and advance once per
    chunk. As in [`eqstate.transform.vmap`][], that holds for a key the function only
    reads (using `rng.value` itself, not drawing through `eqstate.random`): each
    element gets its own key and `rng` advances, where the sequential map gives every
    element the same key and leaves `rng` as it was. A random state the function
    only overwrites (a reseed) is like any other overwritten state. One drawn from
    and then reseeded with a value that differs across elements (`rng.seed(x)`)
    advances once per chunk too: the last element's reseed is dropped, as in
    [`eqstate.transform.vmap`][].

    States cannot be created inside `f`.

    **Arguments:**

    - `f`: called with one slice of each of `xs`. It may read and write states.
    - `*xs`: arrays (or PyTrees of arrays) with a common leading axis; at least one.
        Handles in them (a stacked model's states) are static: every element sees
        the same ones.
    - `batch_size`: the number of elements per vmapped chunk, a positive integer;
        `None` to map sequentially. (Keyword only argument.)

    **Returns:**

    The outputs of `f`, stacked along a new leading axis.

    !!! Example

        ```python
        import eqstate as es
        import jax
        import jax.numpy as jnp

        w = es.ParamState(jnp.array([1.0, 2.0]))
        last = es.State(jnp.zeros(2))

        def f(x):
            last.value = w.value * x
            return jnp.sum(last.value)

        xs = jnp.arange(5.0)
        ys = es.transform.map(f, xs, batch_size=2)
        assert (ys == jax.lax.map(lambda x: 3.0 * x, xs, batch_size=2)).all()
        assert (last.value == jnp.array([4.0, 8.0])).all()
        ```
    """
    if batch_size is None:

        def body(carry, x):
            return carry, f(*x)

        _, ys = scan_states(body, None, xs, None, False, 1, None, _MAP)
        return ys
    size = integer(batch_size, "batch_size", at_least=1, none=True)
    # Leaves JAX does not take (the handles of a model in `xs`) ride in the tree
    # structure: every element sees the same ones.
    xs = hide_static(xs)
    n = loop_length(xs, None, _MAP)
    if n == 0:
        return map(f, *xs)  # No chunk: the sequential map gives the stacked shapes.
    return _in_chunks(f, xs, n, size)
