"""How `jit` calls a function that uses states: through *plans*, one `jax.jit` dispatch
per call.

A plan is a `jax.jit` of the whole call for one set of states. A call reads the plan's
states, hands their values and the raw arguments to the jitted function (so JAX's C++
dispatch does the PyTree and cache-key work), and writes the results back. The Python
body of the jitted function runs only when JAX traces it (a first call, new shapes or
static arguments): it finds the function's trace (`FunctionTraces`), checks that it
touches the plan's states (else `_PlanMismatch`, and the call takes the unplanned path
once to pick another plan), and evaluates it.
"""

import functools as ft
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Any

import jax
import jax.numpy as jnp

from .. import _context, _jax_compat as compat
from .._context import current_frame as _current_frame, WORLD
from .._custom_types import MISSING
from .._errors import HandleGivenToJax
from .._jax_compat import is_top_level
from .._placement import private_copies
from .._pretty_print import state_label
from .._shapes import is_key
from .._state import State
from .._state_dict import sharding_rule
from .._write_checks import has_tracer
from ._call_args import CallArgs
from ._common import constrained_to
from ._equinox_errors import EQUINOX_ERRORS, raise_equinox_error
from ._function_traces import FunctionTraces
from ._leaves import ArrayImpl, in_module, jax_jit_sees_as_eqstate
from ._one_sharding import OneShardingJit
from ._rule_errors import raise_if_rule_closed_over_a_tracer, rule_closure_errors
from ._split_args import (
    ArgSplitter,
    KEYS_KEPT,
    OutputMismatch,
    Static,
    typed_static,
    unwrapped,
)
from ._trace import flat_jit, StaleTrace, sub_jaxprs, Trace
from ._view import Overlay


compat.hide_from_tracebacks(__file__)

_WORLD_VALUES = WORLD.by_id
_WORLD_LOCK = WORLD.lock
# The split (see `_split_args`) of a call that is not split.
_UNSPLIT: tuple[int, list] = (-1, [])


class _PlanMismatch(Exception):
    """The call needs other states than the plan's (raised while JAX traces)."""


# What a call through a plan raises when it must take the unplanned path instead: a
# mismatch, a state missing from the world (the unplanned path names it), an output
# that cannot be rebuilt from its key (`OutputMismatch`), or arguments that `jax.jit`
# refuses (see `JitDispatch._raise_if_planned`): a handle (`HandleGivenToJax`), or a
# Python `int` field of a Module, static for eqstate, too large for `jax.jit`'s int32
# (`OverflowError`).
_JIT_REFUSALS = (TypeError, ValueError, OverflowError, HandleGivenToJax)
_REFUSALS = (_PlanMismatch, KeyError, OutputMismatch, *_JIT_REFUSALS)


def _mark_from_trace(exc: BaseException) -> None:
    try:
        exc._eqstate_from_trace = True  # pyright: ignore[reportAttributeAccessIssue]
    except AttributeError:  # pragma: no cover - exotic exception types
        pass


class _Plan:
    __slots__ = (
        "bare_written",
        "bound",
        "donates",
        "get_read",
        "get_written",
        "in_constraints",
        "jitted",
        "out_constraints",
        "placed",
        "read_states",
        "simple_out",
        "single_leaf",
        "split",
        "states",
        "undonated",
        "updated_states",
        "written_keys",
    )

    jitted: Any
    # Functions with a call's static arguments bound (see `JitDispatch._bind`), by
    # `(number of positional arguments, number of keyword ones, static key)`;
    # `False` for calls that cannot take one.
    bound: dict[tuple, Any]
    # With `donate_states`: whether `jitted` donates, and the same function without
    # donation, for calls where donating could lose a value (see `function_for`).
    donates: bool
    undonated: Any
    # Shardings the jitted function imposes on state values: on the inputs (from
    # `state_shardings`) and on the new values of written states (`state_shardings`,
    # else the shardings of a written state's leaves when the plan was made, so that
    # a sharded state keeps its placement). Each is one sharding for the whole value
    # or a PyTree of them, one per leaf (`None`: unconstrained).
    in_constraints: dict[State, Any]
    out_constraints: dict[State, Any]
    # Whether the placement of every written state was known when the constraints
    # were set: a plan made inside a transform may see only tracers (see
    # `JitDispatch._constrain`).
    placed: bool

    def __init__(self, trace: Trace, split: bool, donates: bool):
        # Calls pass their arguments split (see `_split_args`): they hold leaves that
        # `jax.jit` does not take (handles, strings), or the output does.
        self.split = split
        self.simple_out = trace.simple_out
        self.states = trace.states
        self.updated_states = trace.updated_states
        updated = set(trace.updated_states)
        self.read_states = tuple(s for s in trace.states if s not in updated)
        self.single_leaf = trace.single_leaf_states
        # The plan holds the handles, so their ids stay valid world keys.
        self.written_keys = [id(s) for s in trace.updated_states]
        read_keys = [id(s) for s in self.read_states]
        self.donates = donates
        self.undonated = None
        self.bound = {}
        # The jitted function takes the states' values packed (see `_packed`), and
        # returns the written ones so; donated ones go in a list, whose references
        # `_held_elsewhere` counts. These read them from the world so.
        keys = self.written_keys
        self.get_written = _list_getter(keys) if donates else _packed_getter(keys)
        self.get_read = _packed_getter(read_keys) if read_keys else None
        # The key of the only written state, when its value travels bare.
        one = len(self.written_keys) == 1 and not donates
        self.bare_written = self.written_keys[0] if one else None

    def pack(self, written: list) -> Any:
        """The written states' values as the jitted function takes them."""
        return written if self.donates else _packed(written)

    def unpack(self, updated: Any) -> list:
        """The written states' new values from what the jitted function returns."""
        if self.donates:
            return updated
        return _unpacked(updated, len(self.updated_states))

    def read_from(self, frame: _context.Frame) -> Any:
        """The values of the read-only states in `frame`, packed."""
        return _packed(frame.read_many(self.read_states))

    def function_for(self, written: list) -> tuple[Any, list]:
        """The jitted function for a call whose written states hold `written`, and
        the values to give it: the donating function, unless donating could delete
        a value held elsewhere too (see `_held_elsewhere`), or JAX's NaN/Inf checks
        are on (they re-run a failing call with its inputs). Then, the function
        without donation; but with several processes, which must all run the same
        program whatever each holds, the donating one given private copies."""
        if not self.donates or not is_top_level():
            return self.jitted, written  # JAX ignores donation inside a trace.
        if compat.nan_checks_enabled():
            return self.undonated, written
        if _held_elsewhere(written, self.single_leaf):
            if jax.process_count() == 1:
                return self.undonated, written
            return self.jitted, private_copies(written)
        return self.jitted, written

    def evaluate(
        self,
        traces: FunctionTraces,
        written: Any,
        read: Any,
        args: tuple,
        kwargs: dict,
    ) -> tuple[Any, Any]:
        """The body of the plan's `jax.jit` (run when JAX traces it): finds the trace
        for the call and evaluates it. Takes and returns the written states' values
        packed (see `pack`). Raises `_PlanMismatch` if the call needs other states
        than the plan's."""
        read = _unpacked(read, len(self.read_states))
        values = self._in_trace_order(self.unpack(written), read)

        def values_of(trace: Trace) -> list | None:
            return values if trace.states == self.states else None

        frame = _context.current_frame()
        parent: Any = frame
        if self.in_constraints:
            # Moved to their `state_shardings`, the values may have other types than
            # in `frame` (explicit mesh axes): a new trace must see them so.
            moved = dict(zip(self.states, values))
            parent = lambda: Overlay(frame, moved)  # noqa: E731
        try:
            call = traces.parse(args, kwargs)
            # The call counted its lookup: in `_call_unplanned`, or not at all
            # (a planned call: steady-state calls are not counted).
            trace, _ = traces.lookup(call, parent, values_of, count_hit=False)
        except StaleTrace:
            # This call's states or their shapes fit no trace of the plan's states:
            # the unplanned path picks another plan.
            raise _PlanMismatch from None
        except Exception as exc:
            _mark_from_trace(exc)
            raise
        if not self.fits(trace):
            raise _PlanMismatch
        out, updated, _ = trace.split_outputs(trace.run(call.leaves, values))
        updated = [
            self._constrained_out(s, v) for s, v in zip(self.updated_states, updated)
        ]
        return trace.build_output(out, ()), self.pack(updated)

    def _constrained_out(self, state: State, value: Any) -> Any:
        """A written state's new value, constrained to its `state_shardings` or to
        the sharding it kept; unconstrained where it kept one of a higher rank than
        the value has now (a value of another rank, e.g. one of `eqstate.run`)."""
        sharding = self.out_constraints.get(state)
        if sharding is None:
            return value
        if state in self.in_constraints:  # from `state_shardings`
            _check_rank(state, value, sharding)
        elif _too_many_axes(value, sharding) is not None:
            return value
        return _constrained(value, sharding)

    def _in_trace_order(self, written: list, read: list) -> list:
        """The values of the plan's states in the order of `states`, constrained to
        their input shardings."""
        by_state = dict(
            zip((*self.updated_states, *self.read_states), (*written, *read))
        )
        values = [by_state[s] for s in self.states]
        for i, state in enumerate(self.states):
            if state in self.in_constraints:
                sharding = self.in_constraints[state]
                _check_rank(state, values[i], sharding)
                values[i] = _constrained(values[i], sharding)
        return values

    def fits(self, trace: Trace) -> bool:
        return (
            trace.states == self.states
            and trace.updated_states == self.updated_states
            and not trace.new_states
            and trace.simple_out == self.simple_out
        )


def _packed(values: Sequence[Any]) -> Any:
    """Values as the jitted functions take them, the cheapest for JAX to dispatch:
    `None` for none, one value bare, several in a tuple."""
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _unpacked(packed: Any, n: int) -> list:
    """The `n` values that `_packed` packed."""
    if n == 0:
        return []
    return [packed] if n == 1 else list(packed)


def _packed_getter(keys: list[int]) -> Callable[[dict], Any]:
    """Reads the values under `keys` from a dict, packed (see `_packed`)."""
    return itemgetter(*keys) if keys else _nothing


def _nothing(values: dict) -> None:
    return None


def _list_getter(keys: list[int]) -> Callable[[dict], list]:
    """Reads the values under `keys` from a dict, in a list."""
    return lambda values: [values[k] for k in keys]


def _constrained(value: Any, sharding: Any) -> Any:
    """`value` constrained to `sharding`: one sharding for every leaf, or a PyTree of
    them shaped as `value` (`None` leaves unconstrained). Unchanged inside
    `shard_map`, where values are each device's shard."""
    if compat.in_manual_axes():
        return value
    if isinstance(sharding, jax.sharding.Sharding):
        return constrained_to(value, sharding)
    return jax.tree_util.tree_map(
        lambda s, x: x if s is None else constrained_to(x, s),
        sharding,
        value,
        is_leaf=_is_none,
    )


def _too_many_axes(value: Any, sharding: Any) -> tuple[Any, Any] | None:
    """A leaf of `value` and its sharding (`sharding` is one for every leaf, or a
    PyTree of them, see `_constrained`) that splits more axes than the leaf has, or
    `None`. (An uneven split is legal in `jit`.)"""
    pairs = []
    if isinstance(sharding, jax.sharding.Sharding):
        pairs = [(sharding, x) for x in jax.tree_util.tree_leaves(value)]
    else:
        # A PyTree prefix of the value: each sharding covers a subtree.
        jax.tree_util.tree_map(
            lambda s, sub: pairs.extend((s, x) for x in jax.tree_util.tree_leaves(sub)),
            sharding,
            value,
            is_leaf=_is_none,
        )
    for leaf_sharding, x in pairs:
        spec = getattr(leaf_sharding, "spec", None)
        if spec is not None and len(spec) > jnp.ndim(x):
            return leaf_sharding, x
    return None


def _check_rank(state: State, value: Any, sharding: Any) -> None:
    """Raises `ValueError` naming `state` if `sharding` (from `state_shardings`)
    splits more axes than a leaf of `value` has."""
    found = _too_many_axes(value, sharding)
    if found is None:
        return
    leaf_sharding, x = found
    raise ValueError(
        f"`state_shardings` gives {state_label(state, value)} the sharding "
        f"{leaf_sharding}, whose PartitionSpec has {len(leaf_sharding.spec)} entries, "
        f"but its value has shape {jnp.shape(x)} (rank {jnp.ndim(x)}). Give it a "
        "sharding of a lower rank (`PartitionSpec()` for a scalar), e.g. with a "
        "mapping `{filter: sharding}` or a function `(state, value) -> Sharding | "
        "None` that matches only the states it fits."
    )


def _is_none(x: Any) -> bool:
    return x is None


def _leaf_shardings(value: Any) -> Any:
    """The shardings of the leaves of `value` placed on several devices, as a PyTree
    shaped as `value` (`None` for the other leaves); `None` if no leaf is."""
    shardings = jax.tree_util.tree_map(_multi_device_sharding, value)
    if all(s is None for s in jax.tree_util.tree_leaves(shardings, is_leaf=_is_none)):
        return None
    return shardings


def _multi_device_sharding(x: Any) -> Any:
    """The sharding of an array placed on several devices, else `None`."""
    sharding = getattr(x, "sharding", None)
    if sharding is None or len(sharding.device_set) < 2:
        return None
    return sharding


def _concrete_value(state: State, value: Any, frame: _context.Frame) -> Any:
    """`value`, the state's value seen by a call in `frame`, if it holds no tracer;
    inside a transform, where it does, the state's value in the context that holds it
    for this call (the outermost frame under `frame`: the world, or the dictionary of
    a `scope` or `run`) if that is concrete and has the same structure and shapes (so
    that it is the value traced); else `MISSING`. Never the world's value for a state
    that a dictionary holds: the two may be placed differently."""
    if not has_tracer(value):
        return value
    outer = _holder_of_values(frame).peek(state)
    if outer is MISSING or has_tracer(outer) or _shapes(outer) != _shapes(value):
        return MISSING
    return outer


def _holder_of_values(frame: _context.Frame) -> _context.Frame:
    """The frame at the bottom of `frame`'s chain of parents: the one that holds the
    values the frames above it traced (the world, or a dictionary frame)."""
    while True:
        parent = getattr(frame, "parent", None)
        if parent is None:
            return frame
        frame = parent


def _shapes(value: Any) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(value)
    return treedef, [jnp.shape(x) for x in leaves]


def _refcounts_above(values: list, limit: int) -> bool:
    return any(sys.getrefcount(x) > limit for x in values)


# References to a value that only the calling frame holds, as counted by
# `_refcounts_above`: the frame's dict (or container), the list passed in, and that
# function's own (measured here rather than assumed, as it varies across Pythons).
_holder = {0: object()}
_HELD_ONCE = next(sys.getrefcount(x) for x in [_holder[0]])
del _holder


def _held_elsewhere(written: list, single_leaf: bool) -> bool:
    """Whether donating the buffers of `written` could lose a value: one of them is
    held elsewhere too (by another state, an argument of the call, or the caller)."""
    if single_leaf:
        return _refcounts_above(written, _HELD_ONCE) or _key_data_held(written)
    roots, nested = _containers(written)
    if roots is None:
        return True
    # A container held elsewhere (a snapshot such as `values_of(...)`, the caller's
    # `StateDict`) keeps its arrays alive without raising their counts.
    if _refcounts_above(roots, _HELD_ONCE + 1) or _refcounts_above(nested, _HELD_ONCE):
        return True
    leaves = jax.tree_util.tree_leaves(written)
    return _refcounts_above(leaves, _HELD_ONCE) or _key_data_held(leaves)


def _key_data_held(leaves: list) -> bool:
    """Whether the data of a typed PRNG key among `leaves` is also held apart from
    the key: `jax.random.key_data(key)` is the key's own buffer, which donating the
    key deletes, and a key wrapping it (`jax.random.wrap_key_data`) shares it."""
    for x in leaves:
        if type(x) is not ArrayImpl and isinstance(x, jax.Array) and is_key(x):
            if sys.getrefcount(jax.random.key_data(x)) > _key_data_held_once():
                return True
    return False


@ft.cache
def _key_data_held_once() -> int:
    """The count `_key_data_held` sees for data that only its key holds (measured,
    as it varies across Pythons)."""
    with jax.transfer_guard("allow"):  # The first donated call may be guarded.
        key = jax.random.key(0)
    return sys.getrefcount(jax.random.key_data(key))


def _containers(values: list) -> tuple[list | None, list]:
    """The values of `values` that are tuples, lists or dicts, and the containers
    nested in them; `(None, [])` if one holds another kind of node."""
    roots = [v for v in values if isinstance(v, (tuple, list, dict))]
    nested: list = []
    pending = list(roots)
    while pending:
        items = pending.pop()
        for item in items.values() if isinstance(items, dict) else items:
            if isinstance(item, (tuple, list, dict)):
                nested.append(item)
                pending.append(item)
            elif item is not None and not isinstance(item, jax.Array):
                return None, []
    for v in values:
        if not isinstance(v, (tuple, list, dict, jax.Array)) and v is not None:
            return None, []
    return roots, nested


_CALLBACKS = frozenset({"pure_callback", "io_callback", "debug_callback"})


def may_fail_at_run_time(jaxpr: Any) -> bool:
    """Whether a jaxpr holds an operation that can raise while it runs (a callback,
    e.g. `eqx.error_if` or `jax.debug.callback`, or another side effect; not a
    collective's)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _CALLBACKS or any(
            map(compat.can_fail_at_run_time, eqn.effects)
        ):
            return True
        if any(may_fail_at_run_time(sub) for sub in sub_jaxprs(eqn.params)):
            return True
    return False


def _note_state_devices(exc: Exception, plan: _Plan, frame: _context.Frame) -> None:
    """Adds to JAX's error about a call's values on different devices which devices
    the call's states are on: JAX names them by eqstate's own argument names."""
    if not isinstance(exc, ValueError) or "incompatible devices" not in str(exc):
        return
    values = frame.read_many(plan.states)
    moved = []
    for s, v in zip(plan.states, values):
        if s in plan.out_constraints:
            then, now = _constraint_device_ids(plan.out_constraints[s]), _device_ids(v)
            if then != now:
                moved.append(f"{state_label(s)} on devices {then} then, {now} now")
    if moved:
        exc.add_note(
            "A written state keeps the sharding it had when the function was first "
            f"called, and these moved since: {'; '.join(moved)}. Call the jitted "
            "function's `clear_cache()` after moving states, or give them "
            "`state_shardings`."
        )
        return
    placed = "; ".join(
        f"{state_label(s)} on devices {_device_ids(v)}"
        for s, v in zip(plan.states, values)
    )
    exc.add_note(
        f"`eqstate_written` and `eqstate_read` are the call's states: {placed}. Put "
        "the arguments on their devices (`jax.device_put(x, state.value.sharding)`), "
        "or move the states (`eqstate.shard`, or `state.value = jax.device_put(...)`)."
    )


def _constraint_device_ids(sharding: Any) -> list[int]:
    """The devices of a plan's sharding constraint (one sharding, or a PyTree of them
    with `None` leaves)."""
    leaves = jax.tree_util.tree_leaves(
        sharding, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
    )
    return sorted(
        {
            d.id
            for s in leaves
            if isinstance(s, jax.sharding.Sharding)
            for d in s.device_set
        }
    )


def _device_ids(value: Any) -> list[int]:
    leaves = jax.tree_util.tree_leaves(value)
    return sorted(
        {d.id for x in leaves if isinstance(x, jax.Array) for d in x.devices()}
    )


def _jit_took_as_is(args: tuple, kwargs: dict) -> bool:
    """Whether a plan's `jax.jit` took these arguments (tracers) as eqstate would
    have: see `jax_jit_sees_as_eqstate`."""
    tree = (args, kwargs)
    return jax_jit_sees_as_eqstate(jax.tree_util.tree_leaves(tree), in_module(tree))


def can_plan(trace: Trace) -> bool:
    """Whether calls of `trace` can take the plan path: it creates no states."""
    return not trace.new_states


def _store_in_world(plan: _Plan, updated: Sequence[Any]) -> None:
    """Writes the new values of a plan's written states to the world, together."""
    if len(updated) == 1:
        _WORLD_VALUES[plan.written_keys[0]] = updated[0]
        return
    with _WORLD_LOCK:
        for key, value in zip(plan.written_keys, updated):
            _WORLD_VALUES[key] = value


def _needs_split(call: CallArgs, trace: Trace) -> bool:
    return not (call.jit_as_is and trace.simple_out)


def _run_split(
    plan: _Plan,
    jitted: "_PerKey",
    written: Any,
    read: Any,
    key: int,
    dynamic: list,
    splitter: ArgSplitter,
) -> tuple[Any, Any]:
    """Calls the jitted function for `key` (written values packed, see `_Plan.pack`),
    and rebuilds the output if the trace recorded how."""
    out, updated = jitted[key](written, read, *dynamic)
    if not plan.simple_out:
        out = splitter.output(key, out)
    return out, updated


class _PerKey(dict):
    """The jitted functions of a plan whose calls are split: one `jax.jit` per key
    (see `_split_args`), which is cheaper to call than one with a static argument."""

    def __init__(self, body: Callable, options: dict[str, Any]):
        super().__init__()
        self._body = body
        self._options = options

    def __missing__(self, key: int) -> Callable:
        """The jitted function for `key`, made on first use (forgetting the oldest
        beyond `KEYS_KEPT`: keys are never reused once forgotten)."""
        if len(self) >= KEYS_KEPT:
            self.pop(next(iter(self)), None)
        fn = self[key] = jax.jit(ft.partial(self._body, key), **self._options)
        return fn


# `jax.jit` options that refer to positions of arguments or outputs.
_POSITIONAL_OPTIONS = ("donate_argnums", "in_shardings", "out_shardings")


class JitDispatch:
    """Calls a function that uses states through plans; see the module documentation.

    **Arguments:**

    - `traces`: the function's traces.
    - `donate_states`, `state_shardings`: as for `jit`.
    - `jit_kwargs`: the other `jax.jit` options, for the function's own arguments.
    """

    def __init__(
        self,
        traces: FunctionTraces,
        *,
        donate_states: bool = False,
        jit_kwargs: dict[str, Any] | None = None,
        state_shardings: Any = None,
    ):
        self._traces = traces
        self._name = traces.name
        self._parser = traces.parser
        self._static_names = frozenset(traces.parser.static_argnames)
        self._static_positions = tuple(traces.parser.static_positions)
        self._has_static = bool(self._static_names or self._static_positions)
        self._donate = donate_states
        self._state_shardings = (
            None if state_shardings is None else sharding_rule(state_shardings)
        )
        self._jit_kwargs = dict(jit_kwargs or {})
        self._plans: dict[tuple, _Plan] = {}
        self._current: _Plan | None = None
        self._lock = threading.Lock()
        self._warned = False
        self._splitter = self._new_splitter()
        # Plans of split calls, by the splitter's key of their arguments; of the
        # others, by their static arguments (which may select other states).
        self._plans_by_key: dict[int, _Plan] = {}
        self._plans_by_static: dict[tuple, _Plan] = {}

    def _new_splitter(self) -> ArgSplitter:
        return ArgSplitter(self._parser.static_positions, self._parser.static_argnames)

    @property
    def planned(self) -> bool:
        """Whether calls go through a plan (after the first successful call)."""
        return self._current is not None

    def clear(self) -> None:
        """Drops every plan and trace."""
        with self._lock:
            self._plans.clear()
            self._plans_by_key.clear()
            self._plans_by_static.clear()
            self._current = None
            self._splitter = self._new_splitter()
        self._traces.clear()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Calls through the current plan. On a mismatch, or on arguments `jax.jit`
        refuses, takes the unplanned path, which picks a plan for next time."""
        plan = self._current
        if plan is None:
            return self._call_unplanned(args, kwargs)
        pair = self._splitter.pair
        if pair is not None and not (
            len(args) == 2
            and args[0] is pair.model
            and type(args[1]) is ArrayImpl
            and not kwargs
            and pair.copies == pair.containers
        ):
            pair = None  # Not `f(model, x)` with the last such call's model, unchanged.
        try:
            if (
                pair is not None
                and (fast := pair.fast) is not None
                and _current_frame() is WORLD
                and is_top_level()
            ):
                # At top level, with the plans unchanged since the last such call
                # (see `Recent.fast`): the branch below for that call's plan,
                # inlined (what eqstate adds to passing a model rather than closing
                # over it).
                plan, jitted = fast
                values = _WORLD_VALUES
                get = plan.get_read
                out, updated = jitted(
                    plan.get_written(values),
                    get(values) if get is not None else None,
                    *pair.leaves,
                    args[1],
                )
            else:
                frame = _current_frame()
                if frame is not WORLD or not is_top_level():
                    return self._call_in_frame(plan, frame, args, kwargs)
                split = plan.split
                bound = None
                if split:
                    if pair is not None:
                        # `Recent.split`, inlined.
                        key, dynamic = pair.key, [*pair.leaves, args[1]]
                    else:
                        key, dynamic = self._splitter.split(args, kwargs)
                    # Each argument structure (a model's handles) has a plan of its
                    # own; a `KeyError` sends a new one down the unplanned path.
                    plan = self._plans_by_key[key]
                else:
                    key, dynamic = _UNSPLIT
                    if self._has_static:
                        static = self._static_key(args, kwargs)
                        if len(self._plans_by_static) > 1:
                            # Static arguments that select other states have plans of
                            # their own (one in use: the current plan).
                            plan = self._plans_by_static.get(static, plan)
                        bound = plan.bound.get((len(args), len(kwargs), static))
                        if bound is None:
                            bound = self._bind(plan, args, kwargs, static)
                # The hot path, inlined: one dict lookup per state each way.
                values = _WORLD_VALUES
                written = plan.get_written(values)
                jitted = plan.jitted
                if plan.donates:
                    jitted, written = plan.function_for(written)
                get = plan.get_read
                read = get(values) if get is not None else None
                if split:
                    # `_run_split`, inlined (about 1% of a call at ten states).
                    out, updated = jitted[key](written, read, *dynamic)
                    if not plan.simple_out:
                        out = self._splitter.output(key, out)
                    elif pair is not None and not plan.donates:
                        pair.fast = (plan, jitted[key])
                elif bound:
                    jitted, at = bound
                    if at is None:
                        out, updated = jitted(written, read, *args)
                    else:
                        rest = [a for i, a in enumerate(args) if i not in at]
                        out, updated = jitted(written, read, *rest)
                elif kwargs or self._static_positions:
                    # Not `args` and `kwargs` themselves: a refused call takes the
                    # unplanned path with the caller's own static values, not their
                    # `Static` wrappers.
                    typed = kwargs
                    names = self._static_names
                    if names and not names.isdisjoint(kwargs):
                        typed = self._typed_static(kwargs)
                    if self._static_positions:
                        signed = self._signed_static(args)
                        out, updated = jitted(written, read, *signed, **typed)
                    else:
                        out, updated = jitted(written, read, *args, **typed)
                elif len(args) == 1:
                    # Spelled out: a call through `*args` builds JAX's dispatch a
                    # tuple.
                    out, updated = jitted(written, read, args[0])
                else:
                    out, updated = jitted(written, read, *args)
        except _REFUSALS as exc:
            return self._after_refusal(exc, plan, args, kwargs)
        except jax.errors.JaxRuntimeError as exc:
            raise_equinox_error(exc)
            raise
        one = plan.bare_written
        if one is not None:
            values[one] = updated
        elif updated:
            _store_in_world(plan, updated)
        return out

    def _after_refusal(
        self, exc: Exception, plan: _Plan, args: tuple, kwargs: dict
    ) -> Any:
        """Takes the unplanned path for a call that `plan` refused (one of
        `_REFUSALS`). Re-raises the errors of the function itself."""
        if getattr(exc, "_eqstate_from_trace", False):
            raise exc
        if isinstance(exc, _JIT_REFUSALS):
            raise_equinox_error(exc)
            raise_if_rule_closed_over_a_tracer(exc, self._name)
            self._raise_if_planned(exc, plan, args, kwargs)
        return self._call_unplanned(args, kwargs)

    def _call_plan_naming_devices(
        self, plan: _Plan, frame: _context.Frame, args: tuple, kwargs: dict
    ) -> tuple[Any, list]:
        """`_call_plan`, whose error about values on different devices also names
        the plan's states and their devices (JAX names eqstate's own arguments)."""
        try:
            return self._call_plan(plan, frame, args, kwargs)
        except ValueError as exc:
            _note_state_devices(exc, plan, frame)
            raise

    def _call_in_frame(
        self, plan: _Plan, frame: _context.Frame, args: tuple, kwargs: dict
    ) -> Any:
        """A planned call inside a scope or a transform: through the frame."""
        split = None
        if plan.split:
            split = self._splitter.split(args, kwargs)
            found = self._plans_by_key.get(split[0])
            if found is None:
                raise _PlanMismatch
            plan = found
        elif self._has_static:
            static = self._static_key(args, kwargs)
            plan = self._plans_by_static.get(static, plan)
        out, updated = self._call_plan(plan, frame, args, kwargs, split)
        if updated:
            frame.commit_values(plan.updated_states, updated)
        return out

    def _call_unplanned(self, args: tuple, kwargs: dict) -> Any:
        """Finds (or makes) the trace, and calls through the plan for its states (made
        current), or, for a function that creates states or returns leaves `jax.jit`
        cannot return, through the trace's own `jax.jit`."""
        frame = _context.current_frame()
        call = self._traces.parse(args, kwargs)
        trace = self._traces.trace_for(call, frame)
        with EQUINOX_ERRORS, rule_closure_errors(self._name):
            if can_plan(trace):
                done, out = self._call_planned(call, trace, frame, args, kwargs)
                if done:
                    return out
            return self._traces.call_in(frame, call, self.flat_options(), trace)

    def _call_plan(
        self,
        plan: _Plan,
        frame: _context.Frame,
        args: tuple,
        kwargs: dict,
        split: tuple[int, list] | None = None,
    ) -> tuple[Any, list]:
        jitted, written = plan.function_for(frame.read_many(plan.updated_states))
        read = plan.read_from(frame)
        if not plan.split:
            jitted, args, kwargs = self._jitted_call(plan, jitted, args, kwargs)
            out, updated = jitted(plan.pack(written), read, *args, **kwargs)
            return out, plan.unpack(updated)
        if split is None:
            split = self._splitter.split(args, kwargs)
        splitter = self._splitter
        packed = plan.pack(written)
        out, updated = _run_split(plan, jitted, packed, read, *split, splitter)
        if plan.placed:
            # Only placed plans are found by later calls (see `_call_planned`).
            if len(self._plans_by_key) >= KEYS_KEPT:
                self._plans_by_key.clear()
            self._plans_by_key[split[0]] = plan
            self._forget_fast_call()
        return out, plan.unpack(updated)

    def _forget_fast_call(self) -> None:
        """Makes the next call `f(model, x)` find its plan again (see `Recent.fast`),
        after the plans by key changed."""
        pair = self._splitter.pair
        if pair is not None:
            pair.fast = None

    def _static_key(self, args: tuple, kwargs: dict) -> tuple:
        """The static arguments of a call, each with its type (and a float with its
        sign), so that `1`, `1.0` and `True` select plans apart, as they select
        traces apart."""
        key = []
        if self._static_positions:
            n = len(args)
            positions = self._static_positions
            key = [typed_static(args[i]) for i in positions if -n <= i < n]
        if kwargs:
            for k in self._parser.static_argnames:
                if k in kwargs:
                    v = kwargs[k]
                    # `typed_static`, inlined but for floats: calling it here
                    # measured 2-3% of a call with a static flag at one state.
                    key.append(
                        (k, *typed_static(v))
                        if isinstance(v, float)
                        else (k, type(v), v)
                    )
        return tuple(key)

    def _remember_static(self, plan: _Plan, args: tuple, kwargs: dict) -> None:
        """Sends later calls with these static arguments to `plan` (not split)."""
        by_static = self._plans_by_static
        if len(by_static) >= KEYS_KEPT:
            by_static.clear()
        by_static[self._static_key(args, kwargs)] = plan

    def _jitted_call(
        self, plan: _Plan, jitted: Any, args: tuple, kwargs: dict
    ) -> tuple[Any, tuple, dict]:
        """The function that a call through a plan that is not split takes, and the
        arguments to give it: the plan's function with the call's static arguments
        bound, if it can have one (see `_bind`; the hot path of `__call__` inlines
        this), else `jitted` (the plan's function, or the same without donation)
        with them wrapped for `jax.jit` (see `_signed_static` and `_typed_static`)."""
        if self._has_static:
            static = self._static_key(args, kwargs)
            bound = plan.bound.get((len(args), len(kwargs), static))
            if bound is None:
                bound = self._bind(plan, args, kwargs, static)
            if bound:
                jitted, at = bound
                if at is not None:
                    args = tuple(a for i, a in enumerate(args) if i not in at)
                return jitted, args, {}
        return jitted, self._signed_static(args), self._typed_static(kwargs)

    def _bind(self, plan: _Plan, args: tuple, kwargs: dict, static: tuple) -> Any:
        """A `jax.jit` of the plan's body with this call's static arguments bound,
        and the positions of the static arguments among `args` (`None` for none),
        which the call leaves out; kept in `plan.bound` for the calls with the same
        ones. `jax.jit` then sees no static argument: hashing and comparing them at
        each call cost it 1.5 us with one static flag (JAX 0.10, CPU), more than
        eqstate's own work. `False` where the call cannot take one: a donating plan
        (see `function_for`), keyword arguments that are not static, or static
        arguments by position with options that count positions."""
        n = len(args)
        at = sorted(self._static_indices(n))
        bound = plan.bound
        if len(bound) >= KEYS_KEPT:
            bound.clear()
        key = (n, len(kwargs), static)
        if (
            plan.donates
            or plan.split
            or not self._static_names.issuperset(kwargs)
            or (at and any(self._jit_kwargs.get(k) for k in _POSITIONAL_OPTIONS))
        ):
            bound[key] = False
            return False
        traces, fixed_args, fixed_kwargs = (
            self._traces,
            [(i, args[i]) for i in at],
            kwargs,
        )

        # Named so that no keyword argument of the user's function collides with them.
        def body(eqstate_written, eqstate_read, *dynamic):
            args = list(dynamic)
            for i, a in fixed_args:
                args.insert(i, a)
            if not _jit_took_as_is(dynamic, {}):
                raise _PlanMismatch  # As in `_make_jitted`.
            call = (eqstate_written, eqstate_read, tuple(args), fixed_kwargs)
            return plan.evaluate(traces, *call)

        options = self._jit_options(False)
        del options["static_argnums"], options["static_argnames"]
        if isinstance(options.get("in_shardings"), jax.sharding.Sharding):
            jitted = OneShardingJit(body, options.pop("in_shardings"), 2, options)
        else:
            jitted = jax.jit(body, **options)
        # Another thread may have bound the same call: one function, compiled once.
        return bound.setdefault(key, (jitted, frozenset(at) or None))

    def _signed_static(self, args: tuple) -> tuple:
        """`args` with each float at a static position wrapped, so that `jax.jit`,
        which keys `static_argnums` by value and type, keys `0.0` and `-0.0` apart
        too. The body unwraps them."""
        n = len(args)
        for i in self._static_positions:
            if -n <= i < n and isinstance(args[i], float):
                break
        else:
            return args
        static = self._static_indices(n)
        return tuple(
            Static(a) if i in static and isinstance(a, float) else a
            for i, a in enumerate(args)
        )

    def _typed_static(self, kwargs: dict) -> dict:
        """`kwargs` with each static one wrapped so that `jax.jit` keys it by type
        too, as it keys `static_argnums` (`1`, `1.0` and `True` are equal; some JAX
        releases key `static_argnames` by value alone). The body unwraps them."""
        names = self._parser.static_argnames
        if not names:
            return kwargs
        return {k: Static(v) if k in names else v for k, v in kwargs.items()}

    def _static_indices(self, n: int) -> set[int]:
        """The indices, among `n` positional arguments, of the static ones (`-1` and
        `n - 1` are one)."""
        return {i % n for i in self._static_positions if -n <= i < n}

    def _dynamic_part(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A call's arguments but the static ones, which `jax.jit` does not trace."""
        n = len(args)
        at = self._static_indices(n)
        names = self._static_names
        return (
            tuple(a for i, a in enumerate(args) if i not in at),
            {k: v for k, v in kwargs.items() if k not in names},
        )

    def _raise_if_planned(
        self, exc: Exception, plan: _Plan, args: tuple, kwargs: dict
    ) -> None:
        """Re-raises `exc` if the call fits `plan`, the plan it went through: then the
        error came from running it (JAX reports some runtime errors as
        `ValueError`), and the unplanned path would only run it again. Otherwise
        `jax.jit` refused the arguments (a static leaf, a handle, ...): returns, and
        the unplanned path gives the answer or a clear error. Not the current plan:
        another thread may have changed it meanwhile, to one that fits."""
        call = self._traces.parse(args, kwargs)
        trace = self._traces.trace_for(call, _context.current_frame())
        if (
            can_plan(trace)
            and plan.split == _needs_split(call, trace)
            and plan.fits(trace)
        ):
            self._check_in_shardings(args, kwargs)
            _note_state_devices(exc, plan, _context.current_frame())
            raise exc

    def _check_in_shardings(self, args: tuple, kwargs: dict) -> None:
        """Raises `ValueError` if `in_shardings` has not one entry per positional
        argument that is not static, counted as the user passed them: `jax.jit`'s own
        error counts the two arguments that carry the states too. (With keyword
        arguments, `jax.jit`'s error says it takes none with `in_shardings`.)"""
        in_shardings = self._jit_kwargs.get("in_shardings")
        if not isinstance(in_shardings, (tuple, list)) or kwargs:
            return
        n = len(args)
        static = self._static_indices(n)
        dynamic = n - len(static)
        if len(in_shardings) != dynamic:
            raise ValueError(
                f"`jit({self._name}, in_shardings=...)` has {len(in_shardings)} "
                f"entries, but this call passes {dynamic} positional arguments that "
                f"are not static ({n} in all): give one sharding (or PyTree of them) "
                "per such argument, as `jax.jit` takes them, or one Sharding for all."
            )

    def _call_planned(
        self,
        call: CallArgs,
        trace: Trace,
        frame: _context.Frame,
        args: tuple,
        kwargs: dict,
    ) -> tuple[bool, Any]:
        """Calls through the plan for `trace` and makes it current. Returns
        `(False, None)` if the call turns out not to fit it."""
        plan = self._plan_for(trace, frame, _needs_split(call, trace))
        self._check_in_shardings(args, kwargs)
        try:
            out, updated = self._call_plan_naming_devices(plan, frame, args, kwargs)
        except (_PlanMismatch, OutputMismatch):
            return False, None
        except KeyError as exc:
            if getattr(exc, "_eqstate_from_trace", False):
                raise
            # Another thread made the splitter forget a part of this call's key
            # before JAX traced it: the call takes the path without a plan.
            return False, None
        if plan.placed:
            # A plan whose placements are not known yet takes no call but through
            # here, which places it once a call sees concrete values (`_plan_for`):
            # the top-level fast path is not slowed by checking.
            self._current = plan
            if self._has_static and not plan.split:
                self._remember_static(plan, args, kwargs)
        if updated:
            frame.commit_values(plan.updated_states, updated)
        return True, out

    def lower_call(self, args: tuple, kwargs: dict) -> Any:
        """`jax.jit(...).lower` of the call with these arguments (the state values are
        the current ones in the innermost context)."""
        frame = _context.current_frame()
        call = self._traces.parse(args, kwargs)
        trace = self._traces.trace_for(call, frame)
        if not can_plan(trace):
            values = frame.read_many(trace.states)
            return flat_jit(trace, self.flat_options()).lower(call.leaves, values)
        plan = self._plan_for(trace, frame, _needs_split(call, trace))
        self._check_in_shardings(args, kwargs)
        written = plan.pack(frame.read_many(plan.updated_states))
        read = plan.read_from(frame)
        if plan.split:
            key, dynamic = self._splitter.split(args, kwargs)
            return plan.jitted[key].lower(written, read, *dynamic)
        jitted, args, kwargs = self._jitted_call(plan, plan.jitted, args, kwargs)
        return jitted.lower(written, read, *args, **kwargs)

    def _plan_for(self, trace: Trace, frame: _context.Frame, split: bool) -> _Plan:
        key = (trace.states, trace.updated_states, split, trace.simple_out)
        with self._lock:
            plan = self._plans.get(key)
            if plan is None:
                if split:
                    self._refuse_positional_options()
                donate = self._donate and bool(trace.updated_states)
                if donate and may_fail_at_run_time(trace.jaxpr.jaxpr):
                    self._warn_not_donating()
                    donate = False
                if len(self._plans) >= KEYS_KEPT:
                    self._forget_oldest_plan()
                plan = _Plan(trace, split, donate)
                self._constrain(plan, frame)  # Raises for a sharding that cannot fit.
                self._compile(plan)
                self._plans[key] = plan
            elif not plan.placed:
                self._constrain(plan, frame)
                if plan.placed:
                    self._compile(plan)  # Its functions have the old constraints.
        return plan

    def _compile(self, plan: _Plan) -> None:
        plan.bound = {}
        plan.jitted = self._make_jitted(plan, plan.donates)
        if plan.donates:
            plan.undonated = self._make_jitted(plan, False)

    def _forget_oldest_plan(self) -> None:
        """Drops the oldest plan but the current one: a plan holds its states'
        handles, and so their values, which a model dropped by its caller must not
        keep alive for good."""
        old = next((k for k, p in self._plans.items() if p is not self._current), None)
        if old is None:
            return
        plan = self._plans.pop(old)
        for key, found in list(self._plans_by_key.items()):
            if found is plan:
                self._plans_by_key.pop(key, None)
        self._forget_fast_call()
        for static, found in list(self._plans_by_static.items()):
            if found is plan:
                self._plans_by_static.pop(static, None)

    def _warn_not_donating(self) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"`jit({self._name}, donate_states=True)` does not donate: the "
                "function holds an operation that can fail while it runs (a callback "
                "such as `eqx.error_if`, `jax.debug.callback` or `jax.debug.print`), "
                "and a failed call must leave the states' previous values readable, "
                "which donated buffers are not. Move the check out of the function to "
                "donate.",
                stacklevel=7,
            )

    def _constrain(self, plan: _Plan, frame: _context.Frame) -> None:
        """Sets the plan's constraints (see `_Plan`) from the states' values in
        `frame`. A written state keeps the placement of its concrete value: inside a
        transform, of its value in the context that holds it (the world, or a
        `scope`'s or `run`'s dictionary), if that is the value traced; else its
        placement is not known yet, and the plan not `placed`."""
        ins, outs, placed = {}, {}, True
        rule = self._state_shardings
        values = frame.read_many(plan.states) if plan.states else []
        updated = set(plan.updated_states)
        for state, value in zip(plan.states, values):
            sharding = None if rule is None else rule(state, value)
            if sharding is not None:
                _check_rank(state, value, sharding)
                ins[state] = sharding
                if state in updated:
                    outs[state] = sharding
            elif state in updated:
                concrete = _concrete_value(state, value, frame)
                placed = placed and concrete is not MISSING
                shardings = None if concrete is MISSING else _leaf_shardings(concrete)
                if shardings is not None:
                    outs[state] = shardings
        # Set together: another thread may be tracing the plan's functions.
        plan.in_constraints, plan.out_constraints, plan.placed = ins, outs, placed

    def _make_jitted(self, plan: _Plan, donate: bool) -> Any:
        traces, splitter = self._traces, self._splitter

        # Named so that no keyword argument of the user's function collides with them.
        def body(eqstate_written, eqstate_read, *args, **kwargs):
            args = tuple(a.value if isinstance(a, Static) else a for a in args)
            kwargs = unwrapped(kwargs)
            if not _jit_took_as_is(*self._dynamic_part(args, kwargs)):
                # A call whose arguments `jax.jit` traces where eqstate would not
                # (e.g. a Module's `inference: bool`): it takes a split plan.
                raise _PlanMismatch
            return plan.evaluate(traces, eqstate_written, eqstate_read, args, kwargs)

        def split_body(key, written, read, *dynamic):
            args, kwargs = splitter.rebuild(key, dynamic)
            out, updated = plan.evaluate(traces, written, read, args, kwargs)
            if not plan.simple_out:
                out = splitter.record_output(key, out)
            return out, updated

        if plan.split:
            return _PerKey(split_body, self._split_options(donate))
        options = self._jit_options(donate)
        if isinstance(options.get("in_shardings"), jax.sharding.Sharding):
            sharding = options.pop("in_shardings")
            return OneShardingJit(body, sharding, 2, options)
        return jax.jit(body, **options)

    def flat_options(self) -> dict[str, Any]:
        """The `jax.jit` options for calls that cannot take a plan (the function
        creates states or returns non-array leaves): its arguments are flattened, so
        options that refer to argument positions or to states cannot apply, and are
        refused rather than ignored."""
        positional = _POSITIONAL_OPTIONS
        used = sorted(k for k in positional if self._jit_kwargs.get(k))
        used += ["donate_states"] if self._donate else []
        used += ["state_shardings"] if self._state_shardings is not None else []
        if used:
            name = self._name
            raise NotImplementedError(
                f"`jit({name}, {', '.join(f'{k}=...' for k in used)})`: these options "
                f"need a function that creates no states and returns only arrays, but "
                f"{name} does not. Drop the options, or split the function (create the "
                "states in one jitted function, compute in another)."
            )
        return {k: v for k, v in self._jit_kwargs.items() if k not in positional}

    def _refuse_positional_options(self) -> None:
        used = [k for k in _POSITIONAL_OPTIONS if self._jit_kwargs.get(k)]
        if used:
            name = self._name
            raise NotImplementedError(
                f"`jit({name}, {', '.join(f'{k}=...' for k in used)})`: these options "
                "refer to positions of arguments and outputs that `jax.jit` takes as "
                f"they are, but this call of {name} passes (or returns) leaves it "
                "does not take: state handles (e.g. a model holding states), strings "
                "or other static values. Pass only arrays to use these options, e.g. "
                "close over the model."
            )

    def _split_options(self, donate_states: bool) -> dict[str, Any]:
        # A jitted body takes `(written, read, *dynamic_leaves)` (see `_PerKey`).
        options = {
            k: v for k, v in self._jit_kwargs.items() if k not in _POSITIONAL_OPTIONS
        }
        if donate_states:
            options["donate_argnums"] = (0,)
        return options

    def _jit_options(self, donate_states: bool) -> dict[str, Any]:
        # The jitted body takes `(written, read, *args, **kwargs)`: the user's
        # positional options shift by two (negative indices count from the end).
        options = dict(self._jit_kwargs)
        shift = lambda nums: tuple(i + 2 if i >= 0 else i for i in nums)  # noqa: E731
        options["static_argnums"] = shift(self._parser.static_positions)
        options["static_argnames"] = self._parser.static_argnames
        donate = shift(options.pop("donate_argnums", ()))
        if donate_states:
            donate = (0, *donate)
        if donate:
            options["donate_argnums"] = donate
        in_shardings = options.pop("in_shardings", None)
        if isinstance(in_shardings, jax.sharding.Sharding):
            options["in_shardings"] = in_shardings  # See `OneShardingJit`.
        elif in_shardings is not None:
            # States are placed by sharding constraints inside the body instead.
            options["in_shardings"] = (None, None, *in_shardings)
        return options
