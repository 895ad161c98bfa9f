"""Readable reports about a trace: the table of its states, the states whose values
no longer fit it, and checks of the values a caller passes for them."""

from collections.abc import Sequence
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np

from .. import _context
from .._custom_types import MISSING, PyTreeDef
from .._errors import NewStateError, StateValueError
from .._pretty_print import state_label, state_name, table, value_summary
from .._state import State
from ._leaves import signature, struct
from ._trace import Trace


def states_table(name: str, trace: Trace) -> str:
    """One row per state (per leaf, for a state holding a PyTree): kind, name, shape,
    dtype and access (`read`, `write`, `read+write`, `new`), under a title line."""
    written, read_written = set(trace.write_states), set(trace.read_written_states)
    rows = []
    for state, treedef in zip(trace.states, trace.state_defs):
        access = "read"
        if state in written:
            access = "read+write" if state in read_written else "write"
        rows += _rows(state, treedef, trace.leaf_signatures(state), access)
    outvars = trace.jaxpr.jaxpr.outvars
    new_avals = outvars[len(outvars) - sum(d.num_leaves for d in trace.new_defs) :]
    start = 0
    for state, treedef in zip(trace.new_states, trace.new_defs):
        sigs = [
            (v.aval.shape, v.aval.dtype, v.aval.weak_type)
            for v in new_avals[start : start + treedef.num_leaves]
        ]
        start += treedef.num_leaves
        rows += _rows(state, treedef, sigs, "new")
    title = (
        f"{name}: reads {len(trace.states) - len(written)}, writes "
        f"{len(written)}, creates {len(trace.new_states)} state(s)"
    )
    headers = ["kind", "name", "shape", "dtype", "access"]
    return f"{title}\n{table(headers, rows)}"


def _rows(
    state: State, treedef: PyTreeDef, sigs: Sequence[tuple], access: str
) -> list[list[str]]:
    placeholder = jtu.tree_unflatten(treedef, [0] * treedef.num_leaves)
    paths = [jtu.keystr(p) for p, _ in jtu.tree_flatten_with_path(placeholder)[0]]
    return [
        [type(state).__name__, state_name(state) + path, str(shape), str(dtype), access]
        for path, (shape, dtype, *_) in zip(paths, sigs)
    ]


def misfits(trace: Trace, frame: _context.Frame) -> list[str]:
    """A line for each state of `trace` whose value in `frame` is missing or no
    longer has the structure, shapes, dtypes and weak types it was traced with."""
    problems = []
    for state, treedef in zip(trace.states, trace.state_defs):
        sigs = trace.leaf_signatures(state)
        value = frame.peek(state)
        if value is MISSING:
            problems.append(f"{state_label(state)}: has no value here")
            continue
        leaves, actual = jtu.tree_flatten(value)
        if actual == treedef and [signature(x) for x in leaves] == sigs:
            continue
        traced = value_summary(jtu.tree_unflatten(treedef, [struct(x) for x in sigs]))
        now = value_summary(value)
        if traced == now:  # only a weak type differs
            traced += " (strongly typed)" if not sigs[0][2] else " (weakly typed)"
        problems.append(f"{state_label(state)}: traced with {traced}, now {now}")
    return problems


def refuse_new_states(trace: Trace, what: str, instead: str) -> None:
    """Raises `NewStateError` if `trace` creates states, which `what` cannot keep."""
    if trace.new_states:
        labels = ", ".join(state_label(s) for s in trace.new_states)
        raise NewStateError(f"{what} creates states ({labels}). {instead}")


def refuse_ints_too_large(values: Sequence[Any]) -> None:
    """Raises `StateValueError` for a Python int among `values` (state values passed
    as a sequence) that JAX's default integer type cannot hold: before the states
    are known, nothing gives it a wider dtype."""
    default = np.iinfo(jax.dtypes.canonicalize_dtype(int))
    for i, value in enumerate(values):
        for leaf in jtu.tree_leaves(value):
            if type(leaf) is int and not default.min <= leaf <= default.max:
                raise StateValueError(
                    f"The value at position {i} of `jaxpr_call`'s state values "
                    f"holds the Python int {leaf}, which JAX's default integer type, "
                    f"{default.dtype}, cannot hold. Pass it as an array of its "
                    "state's dtype (e.g. `np.asarray(value, np.uint32)`), or pass a "
                    "StateDict `{state: value}`, whose numbers take their states' "
                    "dtypes."
                )


def check_sequence(name: str, trace: Trace, values: Sequence[Any], method: str) -> bool:
    """Checks state values passed to `method` as a sequence aligned with
    `trace.states`. Returns whether they fit `trace` as they are; `False` if only weak
    types differ (a write may change them), so that the caller traces again with
    these values."""
    if len(values) != len(trace.states):
        raise ValueError(
            f"{name} touches {len(trace.states)} state(s), but `{method}` got "
            f"{len(values)} value(s). Pass one value per state of `get_states()`, in "
            "that order."
        )
    for i, (state, value) in enumerate(zip(trace.states, values)):
        if value is None:
            raise StateValueError(
                f"The value at position {i} of `{method}`'s state values, for "
                f"{state_label(state)}, is None. Pass its current value."
            )
    if trace.stale_state(list(values)) is None:
        return True
    for i, (state, value) in enumerate(zip(trace.states, values)):
        sigs = trace.leaf_signatures(state)
        treedef = trace.state_defs[i]
        if _differs_beyond_weak_types(value, treedef, sigs):
            expected = jtu.tree_unflatten(treedef, [struct(s) for s in sigs])
            raise StateValueError(
                f"The value at position {i} of `{method}`'s state values, for "
                f"{state_label(state)}, is {value_summary(value)}, but the function "
                f"was traced with {value_summary(expected)}. Pass a value of that "
                "structure, shape and dtype (its current value fits)."
            )
    return False


def fits_but_for_weak_types(trace: Trace, values: Sequence[Any]) -> bool:
    """Whether state values aligned with `trace.states` have the structures, shapes
    and dtypes `trace` was made with (their weak types may differ)."""
    return not any(
        _differs_beyond_weak_types(value, treedef, trace.leaf_signatures(state))
        for state, value, treedef in zip(trace.states, values, trace.state_defs)
    )


def _differs_beyond_weak_types(value: Any, treedef: PyTreeDef, sigs: list) -> bool:
    leaves, actual = jtu.tree_flatten(value)
    shapes_and_dtypes = [signature(x)[:2] for x in leaves]
    return actual != treedef or shapes_and_dtypes != [sig[:2] for sig in sigs]
