"""What one trace of a StatefulFunction produces, and how a call uses it."""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.extend.core as jex_core
import jax.tree_util as jtu
import numpy as np
from jax.core import Tracer

from .. import _context
from .._custom_types import PyTreeDef
from .._state import is_state, State


_SCALAR_TYPES = (bool, int, float, complex, np.generic)
# The concrete array class, for a fast path in `signature`. Found without making an
# array: that would start JAX's backend on import, and `jax.distributed.initialize()`
# must run before. (If it is not found, `signature` takes its general path.)
ArrayImpl = next(
    (c for c in jax.Array.__subclasses__() if c.__name__ == "ArrayImpl"), None
)


def is_dynamic(x: Any) -> bool:
    """Whether an argument or output leaf is traced: arrays, Python scalars, and
    `jax.ShapeDtypeStruct`s (which stand for arrays when only tracing)."""
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct, *_SCALAR_TYPES))


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def _is_module(x: Any) -> bool:
    return isinstance(x, eqx.Module)


def in_module(tree: Any) -> list[bool]:
    """Whether each leaf of `tree` (in `jax.tree_util` order) is inside an
    `eqx.Module`. It depends only on the tree's structure."""
    found = []
    for item in jtu.tree_leaves(tree, is_leaf=_is_module):
        if _is_module(item):
            found.extend(True for _ in jtu.tree_leaves(item))
        else:
            found.append(False)
    return found


def is_traced(x: Any, module_field: bool) -> bool:
    """Whether an argument or output leaf is traced. Arrays are; so are Python
    scalars, as in `jax.jit`, except the fields of an `eqx.Module` (a layer's
    `inference: bool`, a rate), which are static as in `eqx.filter_jit`. Everything
    else (state handles, strings, functions) is static."""
    return _is_array(x) if module_field else is_dynamic(x)


def dynamic_mask(tree: Any) -> list[bool]:
    """`is_traced` of each leaf of `tree`."""
    leaves = jtu.tree_leaves(tree)
    return [is_traced(x, m) for x, m in zip(leaves, in_module(tree))]


def signature(x: Any) -> tuple:
    """`(shape, dtype, weak_type)` of an array, tracer, scalar or ShapeDtypeStruct."""
    if type(x) is ArrayImpl:
        return (x.shape, x.dtype, x.weak_type)
    if isinstance(x, jax.ShapeDtypeStruct):
        return (x.shape, x.dtype, x.weak_type)
    aval = jax.typeof(x)
    return (aval.shape, aval.dtype, aval.weak_type)


def struct(sig: tuple) -> jax.ShapeDtypeStruct:
    shape, dtype, weak_type = sig
    return jax.ShapeDtypeStruct(shape, dtype, weak_type=weak_type)


def flatten_each(values: Sequence[Any]) -> list[Any]:
    return [leaf for v in values for leaf in jtu.tree_leaves(v)]


def unflatten_each(defs: Sequence[PyTreeDef], leaves: Sequence[Any]) -> list[Any]:
    values, start = [], 0
    for treedef in defs:
        stop = start + treedef.num_leaves
        values.append(jtu.tree_unflatten(treedef, leaves[start:stop]))
        start = stop
    return values


def _is_single_leaf(treedef: PyTreeDef) -> bool:
    return treedef.num_leaves == 1 and treedef.num_nodes == 1


class NewStateRef:
    """Stands for a new state's handle in the output tree of a compilation."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"<new state {self.index}>"


class CallArgs:
    """The arguments of one call: the cache key, the leaves that are traced, and what
    it takes to put the call back together."""

    __slots__ = (
        "_index",
        "_static",
        "_static_kw",
        "_template",
        "_treedef",
        "all_dynamic",
        "key",
        "leaves",
    )

    def __init__(self, key, leaves, treedef, template, index, static, static_kw):
        self.key = key
        self.leaves = leaves
        self.all_dynamic = len(leaves) == len(template)
        self._treedef = treedef
        self._template = template
        self._index = index
        self._static = static
        self._static_kw = static_kw

    def rebuild(self, leaves: Sequence[Any]) -> tuple[tuple, dict]:
        """`(args, kwargs)` with the traced leaves replaced by `leaves`."""
        full = list(self._template)
        for i, leaf in zip(self._index, leaves):
            full[i] = leaf
        dyn_args, kwargs = jtu.tree_unflatten(self._treedef, full)
        args = list(dyn_args)
        for i, value in self._static:
            args.insert(i, value)
        return tuple(args), {**kwargs, **dict(self._static_kw)}


class Compiled:
    """One trace of a StatefulFunction: its jaxpr and the states it uses.

    The jaxpr's inputs are the argument leaves, then the leaves of `states` (first-
    access order). Its outputs are the output leaves, the leaves of `returned_states`,
    then the leaves of `new_states`. A call only needs the outputs in `kept`: `out`,
    the `updated_states` (written and returned) and the new states.
    """

    __slots__ = (
        "cacheable",
        "jaxpr",
        "jitted",
        "kept",
        "n_out",
        "new_defs",
        "new_states",
        "out_def",
        "out_index",
        "out_template",
        "read_states",
        "read_written_states",
        "returned_defs",
        "returned_states",
        "simple_out",
        "single_leaf_states",
        "state_defs",
        "state_signatures",
        "states",
        "updated_defs",
        "updated_states",
        "write_states",
    )

    def state_leaves(self, values: Sequence[Any]) -> list[Any]:
        return list(values) if self.single_leaf_states else flatten_each(values)

    def stale_state(self, values: Sequence[Any]) -> State | None:
        """The first state whose value no longer has the structure, shapes, dtypes or
        weak types it had when traced, or `None`."""
        if self.single_leaf_states:
            for state, x, sig in zip(self.states, values, self.state_signatures):
                if not _is_single_leaf(jtu.tree_structure(x)) or signature(x) != sig:
                    return state
            return None
        start = 0
        for state, value, treedef in zip(self.states, values, self.state_defs):
            stop = start + treedef.num_leaves
            leaves, actual = jtu.tree_flatten(value)
            if actual != treedef or [signature(x) for x in leaves] != list(
                self.state_signatures[start:stop]
            ):
                return state
            start = stop
        return None

    def run(self, arg_leaves: Sequence[Any], values: Sequence[Any]) -> list[Any]:
        """Evaluates the jaxpr (op by op, or staged into the current trace) and returns
        the kept outputs."""
        flat = jex_core.jaxpr_as_fun(self.jaxpr)(
            *arg_leaves, *self.state_leaves(values)
        )
        return [flat[i] for i in self.kept]

    def split_outputs(self, kept: Sequence[Any]) -> tuple[list, list, list]:
        """Splits the kept outputs into `out` leaves, updated values and new values."""
        n_out = self.n_out
        n_updated = sum(d.num_leaves for d in self.updated_defs)
        out = list(kept[:n_out])
        updated_leaves = kept[n_out : n_out + n_updated]
        if self.single_leaf_states:
            updated = list(updated_leaves)
        else:
            updated = unflatten_each(self.updated_defs, updated_leaves)
        return out, updated, unflatten_each(self.new_defs, kept[n_out + n_updated :])

    def build_output(self, out_leaves: Sequence[Any], fresh: Sequence[Any]) -> Any:
        """The output tree, with `fresh` handles in place of the new states."""
        if self.simple_out:
            return jtu.tree_unflatten(self.out_def, out_leaves)
        full = list(self.out_template)
        for i, leaf in zip(self.out_index, out_leaves):
            full[i] = leaf
        for i, leaf in enumerate(full):
            if isinstance(leaf, NewStateRef):
                full[i] = fresh[leaf.index]
        return jtu.tree_unflatten(self.out_def, full)


class TraceRecord:
    """Collects what one trace of a StatefulFunction found."""

    def __init__(self, name: str, state_returns: tuple[str, ...]):
        self.name = name
        self.state_returns = state_returns
        self.frame: _context.TraceFrame | None = None

    def outputs(self, frame: _context.TraceFrame, out: Any) -> list:
        """The flat outputs of the pure form; records how to rebuild `out`."""
        new_index = {s: i for i, s in enumerate(frame.new_states)}
        leaves, self.out_def = jtu.tree_flatten(out)
        mask = dynamic_mask(out)
        self.template, self.out_index, dynamic = [], [], []
        for i, (leaf, traced) in enumerate(zip(leaves, mask)):
            if is_state(leaf) and leaf in new_index:
                self.template.append(NewStateRef(new_index[leaf]))
            elif traced:
                self.template.append(None)
                self.out_index.append(i)
                dynamic.append(leaf)
            else:
                self.template.append(leaf)
        accessed, written = frame.accessed, frame.written
        self.written = tuple(s for s in accessed if s in written)
        self.read_written = tuple(s for s in self.written if s in frame.reads)
        self.read_only = tuple(s for s in accessed if s not in written)
        self.returned = tuple(
            s
            for s in accessed
            if ("write" in self.state_returns and s in written)
            or ("read" in self.state_returns and s not in written)
        )
        current = {s: frame.current(s) for s in accessed}
        returned_values = [current[s] for s in self.returned]
        new_values = [frame.values[s] for s in frame.new_states]
        self.state_defs = {s: jtu.tree_structure(v) for s, v in current.items()}
        self.returned_defs = tuple(jtu.tree_structure(v) for v in returned_values)
        self.new_defs = tuple(jtu.tree_structure(v) for v in new_values)
        return dynamic + flatten_each(returned_values) + flatten_each(new_values)

    def compiled(
        self, jaxpr: jex_core.ClosedJaxpr, states: tuple, state_defs: tuple
    ) -> Compiled:
        assert self.frame is not None
        entry = Compiled()
        entry.jaxpr = jaxpr
        entry.states = states
        entry.state_defs = state_defs
        entry.single_leaf_states = all(_is_single_leaf(d) for d in state_defs)
        n_state_leaves = sum(d.num_leaves for d in state_defs)
        invars = jaxpr.jaxpr.invars
        entry.state_signatures = tuple(
            (v.aval.shape, v.aval.dtype, v.aval.weak_type)
            for v in invars[len(invars) - n_state_leaves :]
        )
        entry.read_states = self.read_only
        entry.write_states = self.written
        entry.read_written_states = self.read_written
        entry.returned_states = self.returned
        entry.returned_defs = self.returned_defs
        written = set(self.written)
        entry.updated_states = tuple(s for s in self.returned if s in written)
        entry.updated_defs = tuple(
            d for s, d in zip(self.returned, self.returned_defs) if s in written
        )
        entry.new_states = tuple(self.frame.new_states)
        entry.new_defs = self.new_defs
        entry.out_def = self.out_def
        entry.out_template = tuple(self.template)
        entry.out_index = tuple(self.out_index)
        entry.n_out = len(self.out_index)
        entry.simple_out = entry.n_out == len(self.template)
        entry.kept = _kept_outputs(entry)
        entry.cacheable = not any(isinstance(c, Tracer) for c in jaxpr.consts)
        entry.jitted = None
        return entry


def _kept_outputs(entry: Compiled) -> list[int]:
    kept = list(range(entry.n_out))
    start = entry.n_out
    updated = set(entry.updated_states)
    for state, treedef in zip(entry.returned_states, entry.returned_defs):
        if state in updated:
            kept.extend(range(start, start + treedef.num_leaves))
        start += treedef.num_leaves
    kept.extend(range(start, start + sum(d.num_leaves for d in entry.new_defs)))
    return kept


class StaleTrace(Exception):
    """Raised inside `jax.jit` when a state's shape changed since the trace."""


def jitted(entry: Compiled, options: dict[str, Any] | None = None) -> Any:
    """`jax.jit` of the entry's pure form (with `jax.jit` `options` that do not refer
    to argument positions), made once per entry and returning the kept outputs. It
    checks the state shapes whenever JAX traces it (`StaleTrace`)."""
    fn = entry.jitted
    if fn is None:

        def flat_call(arg_leaves, values):
            if entry.stale_state(values) is not None:
                raise StaleTrace
            return entry.run(arg_leaves, values)

        fn = entry.jitted = jax.jit(flat_call, **(options or {}))
    return fn
