"""One trace of a function that uses states: how it is made, what it records, and how
a call evaluates it."""

import dataclasses
import functools
import inspect
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.core import Tracer

from .. import _context, _jax_compat as compat
from .._clone import copy_provenance
from .._context import expire
from .._custom_types import PyTree, PyTreeDef
from .._errors import note_frozen_module
from .._state import fresh_copy, is_state, made_as_copy, State
from .._state_dict import rekeyed
from ._call_args import CallArgs
from ._leaves import (
    aval_signature,
    dynamic_mask,
    flatten_each,
    is_single_leaf,
    signature,
    struct,
    unflatten_each,
)


compat.hide_from_tracebacks(__file__)


_PYTHON_SCALARS = (bool, int, float, complex)


class NewStateRef:
    """Stands for a new state's handle in the output tree of a trace."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"<new state {self.index}>"


class StaleTrace(Exception):
    """A trace met state values of another structure, shape or dtype than it was made
    for (another thread changed them): the caller traces again."""


@dataclasses.dataclass(frozen=True, eq=False, slots=True)
class Trace:
    """One trace of a function that uses states: its jaxpr and the states it uses.

    The jaxpr's inputs are the argument leaves, then the leaves of `states` (first-
    access order). Its outputs are the output leaves, the leaves of `returned_states`,
    then the leaves of `new_states`. A call only needs the outputs listed in `needed`:
    `out`, the `updated_states` (written and returned) and the new states. Built only
    by `trace_function`.
    """

    jaxpr: jex_core.ClosedJaxpr
    states: tuple[State, ...]
    state_defs: tuple[PyTreeDef, ...]
    state_signatures: tuple[tuple, ...]
    single_leaf_states: bool
    read_states: tuple[State, ...]
    write_states: tuple[State, ...]
    read_written_states: tuple[State, ...]
    returned_states: tuple[State, ...]
    returned_defs: tuple[PyTreeDef, ...]
    updated_states: tuple[State, ...]
    updated_defs: tuple[PyTreeDef, ...]
    new_states: tuple[State, ...]
    new_defs: tuple[PyTreeDef, ...]
    out_def: PyTreeDef
    out_template: tuple
    out_index: tuple[int, ...]
    n_out: int
    simple_out: bool
    needed: tuple[int, ...]
    # The positions in `needed` of outputs that op-by-op evaluation hands back as it
    # got them (see `_given_outputs`).
    given: tuple[int, ...]
    # Whether the trace may be kept: it closes over no tracer of an enclosing trace.
    cacheable: bool
    # Whether the jaxpr calls a `jax.custom_jvp` or `jax.custom_vjp` function, and
    # how many reads of states by custom rules there had been when it was made (see
    # `_context.rule_reads`).
    has_custom_rules: bool
    rule_reads_before: int
    # The states an inner `vmap` maps per lane around custom rules, which those rules
    # cannot read when this trace is differentiated (see `_context.mapped_in_rules`).
    rule_mapped: frozenset[State]
    # `flat_jit`'s function, made on first use.
    flat_jitted: dict = dataclasses.field(default_factory=dict)

    def state_leaves(self, values: Sequence[Any]) -> list[Any]:
        return list(values) if self.single_leaf_states else flatten_each(values)

    def stale_state(self, values: Sequence[Any]) -> State | None:
        """The first state whose value no longer has the structure, shapes, dtypes or
        weak types it had when traced, or `None`."""
        if self.single_leaf_states:
            for state, x, sig in zip(self.states, values, self.state_signatures):
                if not is_single_leaf(jtu.tree_structure(x)) or signature(x) != sig:
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
        the needed outputs."""
        evaluate = jex_core.jaxpr_as_fun(self.jaxpr)
        leaves = (*arg_leaves, *self.state_leaves(values))
        if self.has_custom_rules:
            # JAX runs a custom rule's Python when it differentiates this evaluation:
            # the states the rule reads must be the ones the trace was given.
            with _context.rules_see(self.read_only(values), self.rule_mapped):
                flat = evaluate(*leaves)
        else:
            flat = evaluate(*leaves)
        needed = [flat[i] for i in self.needed]
        for k in self.given:
            x = needed[k]
            if not isinstance(x, jax.Array):
                needed[k] = jnp.array(x)  # a copy, as in `_write_checks.to_value`
        return needed

    def read_only(self, values: Sequence[Any]) -> dict[State, Any]:
        """The values of the states the trace reads and does not write, by state."""
        updated = set(self.updated_states)
        return {s: v for s, v in zip(self.states, values) if s not in updated}

    def split_outputs(self, needed: Sequence[Any]) -> tuple[list, list, list]:
        """Splits the needed outputs into `out` leaves, updated values and new
        values."""
        n_out = self.n_out
        n_updated = sum(d.num_leaves for d in self.updated_defs)
        out = list(needed[:n_out])
        updated_leaves = needed[n_out : n_out + n_updated]
        if self.single_leaf_states:
            updated = list(updated_leaves)
        else:
            updated = unflatten_each(self.updated_defs, updated_leaves)
        return out, updated, unflatten_each(self.new_defs, needed[n_out + n_updated :])

    def build_output(
        self,
        out_leaves: Sequence[Any],
        fresh: Sequence[Any],
        python_scalars: bool = False,
    ) -> Any:
        """The output tree, with `fresh` handles in place of the new states, and with
        `python_scalars` the Python scalars the function returned when traced in
        place of their arrays (as `jax.grad` returns an auxiliary output)."""
        if self.simple_out and not python_scalars:
            return jtu.tree_unflatten(self.out_def, out_leaves)
        full = list(self.out_template)
        for i, leaf in zip(self.out_index, out_leaves):
            if not (python_scalars and type(full[i]) in _PYTHON_SCALARS):
                full[i] = leaf
        for i, leaf in enumerate(full):
            if isinstance(leaf, NewStateRef):
                full[i] = fresh[leaf.index]
        return jtu.tree_unflatten(self.out_def, full)

    def under_fresh_handles(
        self,
        out_leaves: Sequence[Any],
        updated: list,
        new_values: list,
        python_scalars: bool = False,
    ) -> tuple[Any, list, list, list]:
        """`(out, updated, fresh, new_values)` of a call: fresh handles for the new
        states (the trace's own ones have no value outside it), in their place in
        the output and as the keys of the `StateDict`s held by the output and by the
        values (e.g. an optimiser's state built in the function)."""
        # A state the function created is created by this call, as it would be
        # eagerly; one it copied (a clone) keeps its place after its original.
        fresh = [fresh_copy(s, in_place=made_as_copy(s)) for s in self.new_states]
        for state, copy in zip(self.new_states, fresh):
            copy_provenance(state, copy)  # The records of the ensembles it is in.
        out = self.build_output(out_leaves, fresh, python_scalars)
        if fresh:
            handles = dict(zip(self.new_states, fresh))
            out, updated, new_values = rekeyed((out, updated, new_values), handles)
        return out, updated, fresh, new_values

    def leaf_signatures(self, state: State) -> list[tuple]:
        """The signatures of the leaves of `state`'s value, as traced."""
        i = self.states.index(state)
        start = sum(d.num_leaves for d in self.state_defs[:i])
        return list(
            self.state_signatures[start : start + self.state_defs[i].num_leaves]
        )


def flat_jit(trace: Trace, options: dict[str, Any] | None = None) -> Any:
    """`jax.jit` of the trace's pure form `(arg_leaves, values) -> needed outputs`
    (with `jax.jit` `options` that do not refer to argument positions: they are the
    same for every trace of a function), made once per trace. It raises `StaleTrace`
    if JAX traces it with state values that do not fit."""
    fn = trace.flat_jitted.get("jit")
    if fn is None:

        def flat_call(arg_leaves, values):
            if trace.stale_state(values) is not None:
                raise StaleTrace
            return trace.run(arg_leaves, values)

        fn = trace.flat_jitted["jit"] = jax.jit(flat_call, **(options or {}))
    return fn


def trace_function(
    fun: Callable,
    call: CallArgs,
    parent: _context.Frame,
    *,
    name: str,
    state_returns: tuple[str, ...],
    axis_env: Sequence[tuple[Hashable, int]] | None = None,
) -> Trace:
    """Traces `fun` on the call's arguments against `parent`: a state's value becomes
    a jaxpr input the first time it is read or written (fetched from `parent`), and
    states created inside are new states.

    Without single-pass tracing (see `_jax_compat`), a first pass discovers the
    states and a second traces with their values as inputs (repeated if a pass meets
    states the last one missed).
    """
    if compat.single_pass_enabled():
        result = _trace_once(fun, call, parent, None, name, state_returns, axis_env)
        assert isinstance(result, Trace)
        return result
    known: list[State] = []
    lane = _context.answering_nested(parent)
    while True:
        mark = None if lane is None else lane.nested_mark()
        result = _trace_once(fun, call, parent, known, name, state_returns, axis_env)
        if isinstance(result, Trace):
            return result
        if lane is not None:
            lane.rewind_nested(mark)
        known.extend(result)


_LEAVES = inspect.Signature(
    [inspect.Parameter("leaves", inspect.Parameter.VAR_POSITIONAL)]
)


def _unpartial(fun: Callable) -> Callable:
    while isinstance(fun, functools.partial):
        fun = fun.func
    return fun


def _trace_once(
    fun: Callable,
    call: CallArgs,
    parent: _context.Frame,
    known: list[State] | None,
    name: str,
    state_returns: tuple[str, ...],
    axis_env: Sequence[tuple[Hashable, int]] | None,
) -> Trace | list[State]:
    """One trace. With `known` (the two-pass fallback), their values are inputs, and
    the states met but not known are returned instead of a trace."""
    n_args = len(call.leaves)
    outer = [] if known is None else [parent.fetch(s) for s in known]
    outer_defs = [jtu.tree_structure(v) for v in outer]
    recorder = _Recorder(state_returns)

    def pure(*leaves):
        preloaded = None
        if known is not None:
            preloaded = dict(zip(known, unflatten_each(outer_defs, leaves[n_args:])))
        frame = recorder.frame = _context.TraceFrame(parent, preloaded)
        args, kwargs = call.rebuild(leaves[:n_args])
        token = _context.enter(frame)
        try:
            return recorder.outputs(frame, fun(*args, **kwargs))
        except BaseException as error:
            note_frozen_module(error)
            raise
        finally:
            _context.leave(token)
            # JAX checks for leaked tracers as soon as this trace ends.
            frame.release()

    # JAX's errors about tracers (`if x > 0:`) then name the user's function and
    # where it is, not this one; its arguments are still `leaves[i]`.
    pure.__wrapped__ = _unpartial(fun)  # type: ignore[attr-defined]
    pure.__signature__ = _LEAVES  # type: ignore[attr-defined]
    in_leaves = list(call.leaves)
    for value in outer:
        in_leaves.extend(struct(signature(x)) for x in jtu.tree_leaves(value))
    try:
        jaxpr = jax.make_jaxpr(pure, axis_env=axis_env)(*in_leaves)
    finally:
        if recorder.frame is not None:
            for state in recorder.frame.new_states:
                expire(state, name)
            recorder.frame.release()
    frame = recorder.frame
    assert frame is not None
    if known is not None and frame.missing:
        return list(dict.fromkeys(frame.missing))
    if known is None:
        states = tuple(frame.accessed)
        defs = tuple(recorder.state_defs[s] for s in states)
    else:
        states, defs = tuple(known), tuple(outer_defs)
    return recorder.build(jaxpr, states, defs)


class _Recorder:
    """Collects what one trace finds, and builds its `Trace`."""

    def __init__(self, state_returns: tuple[str, ...]):
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
                # Python scalars are traced, but kept for `build_output`.
                self.template.append(leaf if type(leaf) in _PYTHON_SCALARS else None)
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

    def build(
        self, jaxpr: jex_core.ClosedJaxpr, states: tuple, state_defs: tuple
    ) -> Trace:
        assert self.frame is not None
        n_state_leaves = sum(d.num_leaves for d in state_defs)
        invars = jaxpr.jaxpr.invars
        written = set(self.written)
        updated = tuple(s for s in self.returned if s in written)
        n_out = len(self.out_index)
        needed = tuple(self._needed_outputs(n_out, written))
        return Trace(
            jaxpr=jaxpr,
            states=states,
            state_defs=state_defs,
            state_signatures=tuple(
                aval_signature(v.aval) for v in invars[len(invars) - n_state_leaves :]
            ),
            single_leaf_states=all(is_single_leaf(d) for d in state_defs),
            read_states=self.read_only,
            write_states=self.written,
            read_written_states=self.read_written,
            returned_states=self.returned,
            returned_defs=self.returned_defs,
            updated_states=updated,
            updated_defs=tuple(
                d for s, d in zip(self.returned, self.returned_defs) if s in written
            ),
            new_states=tuple(self.frame.new_states),
            new_defs=self.new_defs,
            out_def=self.out_def,
            out_template=tuple(self.template),
            out_index=tuple(self.out_index),
            n_out=n_out,
            simple_out=n_out == len(self.template),
            needed=needed,
            given=_given_outputs(jaxpr, needed),
            cacheable=not any(isinstance(c, Tracer) for c in jaxpr.consts),
            has_custom_rules=_has_custom_rules(jaxpr.jaxpr),
            rule_reads_before=_context.rule_reads(),
            rule_mapped=frozenset(self.frame.rule_mapped),
        )

    def _needed_outputs(self, n_out: int, written: set[State]) -> list[int]:
        needed = list(range(n_out))
        start = n_out
        for state, treedef in zip(self.returned, self.returned_defs):
            if state in written:
                needed.extend(range(start, start + treedef.num_leaves))
            start += treedef.num_leaves
        new_leaves = sum(d.num_leaves for d in self.new_defs)
        needed.extend(range(start, start + new_leaves))
        return needed


def _given_outputs(jaxpr: jex_core.ClosedJaxpr, needed: tuple[int, ...]) -> tuple:
    """The positions in `needed` of the outputs that are inputs, constants or literals
    of `jaxpr`. Evaluated op by op, it returns those as it got them: a caller's NumPy
    array (aliasing its buffer), a Python scalar, or JAX's literal objects, none of them
    a `jax.Array`. Every other output comes from an operation, so is one."""
    inner = jaxpr.jaxpr
    given = {*inner.invars, *inner.constvars}
    outvars = inner.outvars
    return tuple(
        k
        for k, i in enumerate(needed)
        if isinstance(outvars[i], jex_core.Literal) or outvars[i] in given
    )


_CUSTOM_CALLS = frozenset(
    {"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"}
)


def _has_custom_rules(jaxpr: jex_core.Jaxpr) -> bool:
    """Whether `jaxpr`, or one nested in it, calls a function with custom
    differentiation rules."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _CUSTOM_CALLS:
            return True
        if any(_has_custom_rules(sub) for sub in sub_jaxprs(eqn.params)):
            return True
    return False


def sub_jaxprs(params: dict) -> list[jex_core.Jaxpr]:
    """The jaxprs nested in an equation's `params` (a loop's body, a call's jaxpr)."""
    found = []
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jex_core.ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, jex_core.Jaxpr):
                found.append(item)
    return found


def out_shapes(entry: Trace) -> tuple[PyTree, tuple]:
    """`StatefulFunction.get_out_shapes` of one trace."""
    avals = [v.aval for v in entry.jaxpr.jaxpr.outvars]
    structs = [struct(aval_signature(a)) for a in avals]
    out = entry.build_output(structs[: entry.n_out], entry.new_states)
    n_returned = sum(d.num_leaves for d in entry.returned_defs)
    returned = unflatten_each(
        entry.returned_defs, structs[entry.n_out : entry.n_out + n_returned]
    )
    return out, tuple(returned)
