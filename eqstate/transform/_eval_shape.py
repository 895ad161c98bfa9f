"""eval_shape: the output's shapes without computing anything."""

from collections.abc import Callable
from typing import Any

import jax.tree_util as jtu

from .. import _jax_compat as compat
from .._context import expire
from .._errors import SHAPES_ONLY_STATE
from .._state_dict import state_dict_of, StateDict
from ._leaves import aval_signature, struct
from ._stateful_function import out_shapes, StatefulFunction, trace_of_call
from ._trace import Trace


compat.hide_from_tracebacks(__file__)


def _state_shapes(entry: Trace) -> StateDict:
    """The shapes and dtypes of every state a trace touches or creates, as
    they are after the call."""
    outvars = entry.jaxpr.jaxpr.outvars
    structs = [struct(aval_signature(v.aval)) for v in outvars]
    start = entry.n_out
    after = {}
    for state, treedef in (
        *zip(entry.returned_states, entry.returned_defs),
        *zip(entry.new_states, entry.new_defs),
    ):
        stop = start + treedef.num_leaves
        after[state] = jtu.tree_unflatten(treedef, structs[start:stop])
        start = stop
    shapes, start = {}, 0
    for state, treedef in zip(entry.states, entry.state_defs):
        stop = start + treedef.num_leaves
        before = [struct(sig) for sig in entry.state_signatures[start:stop]]
        shapes[state] = after.get(state, jtu.tree_unflatten(treedef, before))
        start = stop
    shapes.update((s, after[s]) for s in entry.new_states)
    return state_dict_of(shapes)


def eval_shape(
    fun: Callable[..., Any],
    *args: Any,
    return_state_shapes: bool = False,
    **kwargs: Any,
) -> Any:
    """Like `jax.eval_shape`, for a function that uses states: traces `fun` abstractly
    and returns its output's shapes and dtypes. No value is computed, and no state is
    read (beyond its shape and dtype) or written.

    **Arguments:**

    - `fun`: the function.
    - `*args`, `**kwargs`: its arguments: arrays, or `jax.ShapeDtypeStruct`s.
    - `return_state_shapes`: also return the shapes of the states `fun` reads,
        writes or creates. (Keyword only argument.)

    **Returns:**

    The output with every array replaced by a `jax.ShapeDtypeStruct` (handles of
    states `fun` would create stay in place). With `return_state_shapes`, the pair
    `(state_shapes, out)`: `state_shapes` is a [`eqstate.StateDict`][] mapping every
    state `fun` touches, then every state it creates (under the handles found in
    `out`), to `jax.ShapeDtypeStruct`s of its value after the call.

    !!! Example

        ```python
        import eqstate as es
        import jax
        import jax.numpy as jnp

        w = es.ParamState(jnp.ones((3, 4)))
        count = es.State(jnp.array(0))

        def f(x):
            count.value = count.value + 1
            return x @ w.value

        out = es.transform.eval_shape(f, jax.ShapeDtypeStruct((2, 3), jnp.float32))
        assert out.shape == (2, 4) and count.value == 0

        shapes, out = es.transform.eval_shape(f, jnp.ones((2, 3)), return_state_shapes=True)
        assert shapes[w].shape == (3, 4) and shapes[count].dtype == jnp.int32
        ```
    """
    sf = StatefulFunction(
        fun, state_returns="write", name=getattr(fun, "__name__", None)
    )
    entry = trace_of_call(sf, args, kwargs)
    for state in entry.new_states:  # A read says it has shapes only, not a value.
        expire(state, sf.name, SHAPES_ONLY_STATE)
    out, _ = out_shapes(entry)
    return (_state_shapes(entry), out) if return_state_shapes else out
