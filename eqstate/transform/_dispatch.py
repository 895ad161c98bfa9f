"""How `jit` calls a function that uses states: one `jax.jit` dispatch per call.

Every call is split (see `_split_args`) into a key, standing for its arguments'
structures and static values, and its dynamic leaves. A *plan* is the compiled form
of the calls with one key that touch one set of states: a `jax.jit` made with the
key's static values bound.

- The fast path: the key names a plan. The call reads the values of its states,
  hands them and the dynamic leaves to its `jax.jit` (JAX's C++ dispatch does the
  rest), and writes the new values back.
- The slow path, for a new key, or a call that needs other states than its plan's:
  finds the function's trace (`FunctionTraces`, tracing on a miss) and the plan for
  its states and the key (made on a miss), then calls as the fast path does. A
  function that creates states, or a call no plan can take, is called through the
  trace's own `jax.jit` instead (`FunctionTraces.call_in`).

The Python body of a plan's `jax.jit` runs only when JAX traces it (a first call, new
shapes): it rebuilds the call, finds its trace, checks that it touches the plan's
states (else `_PlanMismatch`: the call takes the slow path), and evaluates it.
"""

import collections
import contextlib
import threading
import warnings
from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Any

import jax
import jax.numpy as jnp
from jax.core import Tracer

from .. import _context, _jax_compat as compat
from .._context import current_frame as _current_frame, WORLD
from .._custom_types import MISSING
from .._jax_compat import is_top_level
from .._placement import private_copies
from .._pretty_print import state_label
from .._state import check_keys, KEY_LOCK, RandomState, State
from .._state_dict import sharding_rule
from .._write_checks import has_tracer
from ._common import constrained_to
from ._equinox_errors import EQUINOX_ERRORS, raise_equinox_error, RUNTIME_ERRORS
from ._function_traces import FunctionTraces
from ._leaves import ArrayImpl
from ._rule_errors import raise_if_rule_closed_over_a_tracer, rule_closure_errors
from ._split_args import (
    ArgSplitter,
    ARRAY_KEYS,
    dynamic_count,
    is_static,
    KEYS_KEPT,
    output,
    OutputMismatch,
    positional_specs,
    rebuild,
    record_output,
    template,
)
from ._trace import flat_jit, StaleTrace, sub_jaxprs, Trace
from ._view import Overlay


compat.hide_from_tracebacks(__file__)

_WORLD_VALUES = WORLD.by_id
_WORLD_LOCK = WORLD.lock


class _PlanMismatch(Exception):
    """The call needs other states than the plan's (raised while JAX traces)."""


class _Retrace(Exception):
    """The call must take the slow path."""


# What a call through a plan raises when it must take the slow path instead: a
# mismatch, a state missing from the world (the slow path names it), or an output
# that cannot be rebuilt from its key.
_REFUSALS = (_PlanMismatch, KeyError, OutputMismatch)
# Why a call does not donate (see `JitDispatch._warn_not_donating`).
_CALLBACK = (
    "in any call: the function holds an operation that can fail while it runs (a "
    "callback such as `eqx.error_if`, `jax.debug.callback` or `jax.debug.print`), "
    "and a failed call must leave the states' previous values readable, which "
    "donated buffers are not. Move the check out of the function to donate."
)
_NAN_CHECKS = (
    "while `jax.debug_nans` or `jax.debug_infs` is on: JAX runs a call that made a "
    "NaN again with its inputs, which donation would have deleted."
)
_SHARED = (
    "in calls where such a value is also another input of the call (another state's "
    "value, or an argument): XLA cannot donate a buffer it also reads. Each is "
    "copied first, and the copy donated. Give each state its own value "
    "(`jnp.copy(x)`) to donate it in place."
)
_IN_A_SCOPE = (
    "in calls inside `eqstate.scope` or `eqstate.run`: the values there are the "
    "dictionary's, which may share them with the world. Call it outside to donate."
)
# What XLA says when a call donates a buffer it also takes otherwise (twice, or also
# undonated): it refuses the call before consuming anything.
_DONATED_TWICE = ("donate the same buffer twice", "previously donated in the same call")
# `jax.jit` options that refer to positions of arguments or outputs.
_POSITIONAL_OPTIONS = ("donate_argnums", "in_shardings", "out_shardings")
_NO_LOCK = contextlib.nullcontext()


def _mark_from_trace(exc: BaseException) -> None:
    try:
        exc._eqstate_from_trace = True  # pyright: ignore[reportAttributeAccessIssue]
    except AttributeError:  # pragma: no cover - exotic exception types
        pass


class _Plan:
    """The compiled form of the calls with one key that touch one set of states."""

    # The plan's `jax.jit`, the same without donation (made on first use), and the
    # record that rebuilds the output (`None`: it is returned as it is).
    jitted: Any
    undonated: Any
    out: tuple | None
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

    def __init__(self, trace: Trace, specs: tuple, donates: bool):
        self.specs = specs  # what the key's parts stand for (see `_split_args`)
        self.simple_out = trace.simple_out
        self.states = trace.states
        self.updated_states = trace.updated_states
        updated = set(trace.updated_states)
        self.read_states = tuple(s for s in trace.states if s not in updated)
        self.donates = donates  # its written states (`donate_states`)
        # The random states it advances: its calls in the world hold the key lock
        # from their read to their write, and check the keys first (see
        # `JitDispatch.__call__`).
        self.keys = tuple(s for s in trace.updated_states if isinstance(s, RandomState))
        self.undonated = self.out = None
        # The plan holds the handles, so their ids stay valid world keys. The jitted
        # function takes the values of the written and of the read states packed
        # (see `_packed`), and returns the written ones so.
        self._written_keys = [id(s) for s in trace.updated_states]
        self.get_written = _packed_getter(self._written_keys)
        self.get_read = _packed_getter([id(s) for s in self.read_states])
        # The key of the only written state, whose value travels bare.
        one = len(self._written_keys) == 1
        self.bare_written = self._written_keys[0] if one else None

    def read(self, frame: _context.Frame) -> tuple[Any, Any]:
        """The values of the written and of the read states in `frame`, packed (in
        the world at top level, `JitDispatch.__call__` reads them itself), the
        failed keys of the random states it advances replaced first (see
        `check_keys`)."""
        if self.keys and frame is WORLD and is_top_level():
            check_keys(self.keys)
        written = frame.read_many(self.updated_states)
        return _packed(written), _packed(frame.read_many(self.read_states))

    def write(self, frame: _context.Frame, updated: Any) -> None:
        """Writes the new values of the written states (packed) to `frame`."""
        keys = self._written_keys
        if frame is WORLD and is_top_level():
            if len(keys) == 1:
                _WORLD_VALUES[keys[0]] = updated
            elif keys:
                with _WORLD_LOCK:  # together
                    for key, value in zip(keys, updated):
                        _WORLD_VALUES[key] = value
        elif keys:
            frame.commit_values(self.updated_states, _unpacked(updated, len(keys)))

    def evaluate(
        self, traces: FunctionTraces, written: Any, read: Any, args: tuple, kwargs: dict
    ) -> tuple[Any, Any]:
        """The body of the plan's `jax.jit` (run when JAX traces it): finds the trace
        for the call and evaluates it. Takes the written states' values packed, and
        returns them so with the output. Raises `_PlanMismatch` if the call needs
        other states than the plan's."""
        written = _unpacked(written, len(self.updated_states))
        values = self._in_trace_order(written, _unpacked(read, len(self.read_states)))

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
            # The call counts its own lookup: the slow path before, the fast path
            # after it (see `JitDispatch._reused`), unless this one misses.
            misses = traces.stats.misses
            trace, _ = traces.lookup(call, parent, values_of, count_hit=False)
            if traces.stats.misses != misses:
                traces.stats.not_reused()
        except StaleTrace:
            # The states or their shapes fit no trace of the plan's states.
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
        out = trace.build_output(out, ())
        if not self.simple_out:
            self.out, out = record_output(self.out, out)
        return _packed(updated), out

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


def _in_order(written_first: bool, returned: tuple) -> tuple[Any, Any]:
    """`(written values packed, output)` from what a plan's function returned, in
    the order of its donated inputs (see `JitDispatch._jax_jit`)."""
    return returned if written_first else returned[::-1]


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


def _packed_getter(keys: list[int]) -> Callable[[dict], Any] | None:
    """Reads the values under `keys` from a dict, packed (see `_packed`); `None` for
    no keys."""
    return itemgetter(*keys) if keys else None


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


# What XLA says when a call donates a buffer that it also takes otherwise (twice, or
# also undonated): it refuses the call before consuming anything.
def _donated_twice(exc: BaseException) -> bool:
    return any(text in str(exc) for text in _DONATED_TWICE)


def _note_deleted_values(
    exc: BaseException, plan: _Plan, frame: _context.Frame
) -> None:
    """Adds to the error of a failed call which of its states hold a deleted array,
    and how to recover."""
    lost = ", ".join(
        state_label(s, v)
        for s, v in ((s, frame.peek(s)) for s in plan.states)
        if any(_is_deleted(x) for x in jax.tree.leaves(v))
    )
    if not lost:
        return
    if isinstance(exc, jax.errors.JaxRuntimeError) and plan.donates:
        what = (
            f"XLA refused this call after it had taken the donated buffers of {lost}: "
            "their values are lost (each holds a deleted array), the other states "
            "keep theirs. Give them values again (e.g. load a checkpoint with "
            "`eqstate.load`), or leave `donate_states` off: a refused call then "
            "leaves every value as it was."
        )
    else:
        what = (
            f"{lost} held a deleted array when the call began: a call that donated "
            "it consumed it, maybe in another thread. Give it a value again (e.g. "
            "load a checkpoint with `eqstate.load`); keep `jnp.copy(x)` of a value "
            "that must outlive a donating call, and let threads that read such "
            "states take turns with the calls that donate them."
        )
    exc.add_note(what)


def _is_deleted(x: Any) -> bool:
    return isinstance(x, jax.Array) and not isinstance(x, Tracer) and x.is_deleted()


def _note_state_devices(exc: Exception, plan: _Plan, frame: _context.Frame) -> None:
    """Adds to JAX's error about a call's values on different devices which devices
    the call's states are on: JAX names them by eqstate's own argument names."""
    if "incompatible devices" not in str(exc):
        return
    values = frame.read_many(plan.states)
    moved = []
    for s, v in zip(plan.states, values):
        if s in plan.out_constraints:
            then, now = _device_ids(plan.out_constraints[s]), _device_ids(v)
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


def _device_ids(tree: Any) -> list[int]:
    """The ids of the devices of the arrays and shardings in `tree`."""
    found = set()
    is_sharding = lambda x: isinstance(x, jax.sharding.Sharding)  # noqa: E731
    for x in jax.tree_util.tree_leaves(tree, is_leaf=is_sharding):
        if is_sharding(x):
            found.update(d.id for d in x.device_set)
        elif isinstance(x, jax.Array):
            found.update(d.id for d in x.devices())
    return sorted(found)


def can_plan(trace: Trace) -> bool:
    """Whether calls of `trace` can take a plan: it creates no states."""
    return not trace.new_states


_DYNAMIC = object()  # A dynamic leaf, in an argument's template (see `template`).


def _per_leaf(entry: Any, spec: Any) -> list:
    """An `in_shardings` entry for an argument (a sharding, `None` or a PyTree prefix
    of the argument) as one entry per dynamic leaf of the argument split as
    `spec`."""
    shardings: list = []
    jax.tree_util.tree_map(
        lambda s, sub: shardings.extend(
            s for x in jax.tree_util.tree_leaves(sub) if x is _DYNAMIC
        ),
        entry,
        template(spec, _DYNAMIC),
        is_leaf=lambda x: x is None or isinstance(x, jax.sharding.Sharding),
    )
    return shardings


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
        self._donate = donate_states
        self._state_shardings = (
            None if state_shardings is None else sharding_rule(state_shardings)
        )
        self._jit_kwargs = dict(jit_kwargs or {})
        self._plans: dict[tuple, _Plan] = {}
        self._entries: dict[tuple, _Plan] = {}  # the plan a fast call takes, by key
        self._lock = threading.Lock()
        self._warned: set[str] = set()  # reasons for not donating, warned about
        self._new_splitter()
        # Counts the fast calls, each of which reused a trace (`next` on a count is
        # atomic, and far cheaper than a lock).
        self._reused = traces.stats.reused

    def _new_splitter(self) -> None:
        parser = self._traces.parser
        self._splitter = ArgSplitter(parser.static_positions, parser.static_argnames)
        self._split = self._splitter.split

    @property
    def planned(self) -> bool:
        """Whether calls go through a plan (after the first successful call)."""
        return bool(self._entries)

    def clear(self) -> None:
        """Drops every plan and trace."""
        with self._lock:
            self._plans.clear()
            self._entries.clear()
            self._new_splitter()
        self._traces.clear()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The fast path for a key seen before, else the slow path. At top level in
        the world, the call reads and writes the values inline (one dictionary
        lookup per state), holding the key lock from the read to the write for a
        plan that advances a random state (see `eqstate._state.KEY_LOCK`);
        elsewhere it goes through `_call`."""
        key: Any = None
        leaves: Sequence[Any] = args
        if not kwargs and len(args) <= self._splitter.no_static_below:
            for arg in args:  # `ArgSplitter.split`, inlined for arrays alone
                if type(arg) is not ArrayImpl:
                    break
            else:
                key = ARRAY_KEYS[len(args)]
        if key is None:
            try:
                key, leaves = self._split(args, kwargs)
            except TypeError:  # an unhashable static value: the slow path names it
                return self._call_slow(args, kwargs)
        plan = self._entries.get(key)
        if plan is None:
            return self._call_slow(args, kwargs)
        if (
            _current_frame() is not WORLD
            or not is_top_level()
            or (plan.donates and compat.nan_checks_enabled())
        ):
            return self._call(plan, leaves, args, kwargs)
        keys = plan.keys
        try:
            if keys:  # from the read of the keys to the write of their successors
                KEY_LOCK.acquire()
                check_keys(keys)
            get = plan.get_written
            written = None if get is None else get(_WORLD_VALUES)
            get = plan.get_read
            read = None if get is None else get(_WORLD_VALUES)
            returned = plan.jitted(written, read, *leaves)
        except Exception as exc:
            return self._failed(exc, plan, leaves, args, kwargs, WORLD)
        else:
            if plan.donates:  # `_in_order(plan.donates, returned)`, inlined
                updated, out = returned
            else:
                out, updated = returned
            if plan.bare_written is not None:
                _WORLD_VALUES[plan.bare_written] = updated
            else:
                plan.write(WORLD, updated)
        finally:
            if keys:
                KEY_LOCK.release()
        next(self._reused)
        return out if plan.out is None else output(plan.out, out)

    def _call(
        self,
        plan: _Plan,
        leaves: Sequence[Any],
        args: tuple,
        kwargs: dict,
        slow: bool = False,
    ) -> Any:
        """Calls the plan in the current frame: reads the values of its states
        (`_Plan.read`), calls, and writes the new values back (`_Plan.write`), in the
        world holding the key lock if the plan advances a random state (see
        `eqstate._state.KEY_LOCK`). Where the call needs another plan, it takes the
        slow path; called from the slow path (`slow`), it raises `_Retrace`."""
        frame = _current_frame()
        jitted, written_first = self._jitted(plan, frame)
        world = plan.keys and frame is WORLD and is_top_level()
        with KEY_LOCK if world else _NO_LOCK:
            try:
                written, read = plan.read(frame)
                returned = jitted(written, read, *leaves)
                updated, out = _in_order(written_first, returned)
            except Exception as exc:
                return self._failed(
                    exc, plan, leaves, args, kwargs, frame, jitted, slow
                )
            plan.write(frame, updated)
        if not slow:
            next(self._reused)  # The slow path counted its own lookup.
        return out if plan.out is None else output(plan.out, out)

    def _failed(
        self,
        exc: Exception,
        plan: _Plan,
        leaves: Sequence[Any],
        args: tuple,
        kwargs: dict,
        frame: _context.Frame,
        jitted: Any = None,
        slow: bool = False,
    ) -> Any:
        """What a call whose plan raised `exc` does: the slow path if it needs
        another plan; the call again, donating copies of the values XLA refused to
        donate (it took nothing); else it raises a clearer error, or `exc` with what
        eqstate knows added."""
        if isinstance(exc, _REFUSALS) and not getattr(exc, "_eqstate_from_trace", 0):
            if slow:
                raise _Retrace from None
            return self._call_slow(args, kwargs)
        jitted = plan.jitted if jitted is None else jitted
        if jitted is plan.jitted and plan.donates and _donated_twice(exc):
            written, read = plan.read(frame)
            written = self._unaliased(plan, written, (read, leaves))
            updated, out = _in_order(True, jitted(written, read, *leaves))
            plan.write(frame, updated)
            return out if plan.out is None else output(plan.out, out)
        if isinstance(exc, RUNTIME_ERRORS):
            raise_equinox_error(exc)
        raise_if_rule_closed_over_a_tracer(exc, self._name)
        if isinstance(exc, ValueError):
            _note_state_devices(exc, plan, frame)
        if isinstance(exc, RuntimeError):
            _note_deleted_values(exc, plan, frame)
        raise exc

    def _call_slow(self, args: tuple, kwargs: dict) -> Any:
        """Finds (or makes) the trace and calls through the plan for its states and
        the call's key (remembered for the fast path), or, for a function that
        creates states or a call no plan can take, through the trace's own
        `jax.jit`."""
        frame = _context.current_frame()
        call = self._traces.parse(args, kwargs)
        trace = self._traces.trace_for(call, frame)
        with EQUINOX_ERRORS, rule_closure_errors(self._name):
            if can_plan(trace):
                key, plan, leaves = self._plan_for(trace, frame, args, kwargs)
                try:
                    out = self._call(plan, leaves, args, kwargs, slow=True)
                except _Retrace:
                    pass  # The plan did not fit: its states changed meanwhile.
                else:
                    if plan.placed:
                        # A plan whose placements are not known yet takes no call
                        # but through here, which places it once a call sees
                        # concrete values (see `_constrain`).
                        with self._lock:
                            self._entries.pop(key, None)
                            while len(self._entries) >= KEYS_KEPT:
                                self._entries.pop(next(iter(self._entries)))
                            self._entries[key] = plan
                    return out
            return self._traces.call_in(frame, call, self.flat_options(), trace)

    def lower_call(self, args: tuple, kwargs: dict) -> Any:
        """`jax.jit(...).lower` of the call with these arguments (the state values are
        the current ones in the innermost context)."""
        frame = _context.current_frame()
        call = self._traces.parse(args, kwargs)
        trace = self._traces.trace_for(call, frame)
        if not can_plan(trace):
            values = frame.read_many(trace.states)
            return flat_jit(trace, self.flat_options()).lower(call.leaves, values)
        _, plan, leaves = self._plan_for(trace, frame, args, kwargs)
        return plan.jitted.lower(*plan.read(frame), *leaves)

    def _plan_for(
        self, trace: Trace, frame: _context.Frame, args: tuple, kwargs: dict
    ) -> tuple[tuple, _Plan, Sequence[Any]]:
        """The call's key, the plan for `trace` and the key (made on a miss), and
        the call's dynamic leaves."""
        key, leaves = self._split(args, kwargs)
        try:
            specs = self._splitter.specs(key)
        except KeyError:
            # Another thread made the splitter forget a part of the key, and with it
            # every split it remembered: this one splits afresh.
            key, leaves = self._split(args, kwargs)
            specs = self._splitter.specs(key)
        plan_key = (trace.states, trace.updated_states, trace.simple_out, key)
        with self._lock:
            plan = self._plans.get(plan_key)
            if plan is None:
                donate = self._donate and bool(trace.updated_states)
                if donate and may_fail_at_run_time(trace.jaxpr.jaxpr):
                    self._warn_not_donating(_CALLBACK, trace.updated_states)
                    donate = False
                if len(self._plans) >= KEYS_KEPT:
                    # A plan holds its states' handles, and so their values, which
                    # a model dropped by its caller must not keep alive for good.
                    old = self._plans.pop(next(iter(self._plans)))
                    for k in [k for k, p in self._entries.items() if p is old]:
                        del self._entries[k]
                plan = _Plan(trace, specs, donate)
                self._constrain(plan, frame)  # Raises for a sharding that cannot fit.
                self._compile(plan)
                self._plans[plan_key] = plan
            elif not plan.placed:
                self._constrain(plan, frame)
                if plan.placed:
                    self._compile(plan)  # It has the old constraints.
        return key, plan, leaves

    def _jitted(self, plan: _Plan, frame: _context.Frame) -> tuple[Any, bool]:
        """The function a call of `plan` in `frame` takes, and whether it returns the
        written values first (see `_jax_jit`): for a donating plan the donating one,
        but without donation while JAX's NaN/Inf checks are on (they re-run a failing
        call with its inputs) and in a `scope` or `run` (the values are its
        dictionary's, which may share them with the world). Said here, not found
        from the function: another thread may compile the plan anew meanwhile."""
        if not plan.donates or not is_top_level():
            # JAX ignores donation inside a trace.
            return plan.jitted, plan.donates
        if compat.nan_checks_enabled():
            reason = _NAN_CHECKS
        elif frame is not WORLD:
            reason = _IN_A_SCOPE
        else:
            return plan.jitted, True
        self._warn_not_donating(reason, plan.updated_states)
        if plan.undonated is None:
            plan.undonated = self._jax_jit(plan, donate_states=False)
        return plan.undonated, False

    def _unaliased(self, plan: _Plan, written: Any, others: Any) -> Any:
        """The packed `written` values with a copy of each that shares an array with
        another value of the call (`others`: its other inputs), which XLA cannot
        donate; warned about once per function."""
        values = _unpacked(written, len(plan.updated_states))
        counts = collections.Counter(map(id, jax.tree.leaves((values, others))))
        shared = [
            i
            for i, v in enumerate(values)
            if any(counts[id(x)] > 1 for x in jax.tree.leaves(v))
        ] or list(range(len(values)))  # Buffers shared by other array objects.
        self._warn_not_donating(_SHARED, [plan.updated_states[i] for i in shared])
        copied = [private_copies(v) if i in shared else v for i, v in enumerate(values)]
        return _packed(copied)

    def _warn_not_donating(self, reason: str, states: Sequence[State]) -> None:
        if reason in self._warned:
            return
        self._warned.add(reason)
        labels = [state_label(s) for s in states[:3]]
        if len(states) > 3:
            labels.append(f"{len(states) - 3} more")
        warnings.warn(
            f"`jit({self._name}, donate_states=True)` does not donate the values of "
            f"{', '.join(labels)} {reason}",
            stacklevel=4,
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

    def _compile(self, plan: _Plan) -> None:
        plan.jitted = self._jax_jit(plan, plan.donates)
        plan.undonated = None

    def _jax_jit(self, plan: _Plan, donate_states: bool) -> Any:
        """The `jax.jit` of the plan's calls: it takes `(written, read, *dynamic
        leaves)`, and `jit`'s options for the arguments apply to the leaves of
        those arguments."""
        traces, specs = self._traces, plan.specs

        # The arguments are named so that JAX's errors about them name eqstate's. The
        # outputs come in the order of the donated inputs: `jax.jit` gives each
        # donated buffer to the first output of its type, so any other order pairs an
        # input with another value's output (a model's weight with an optimiser's
        # moment), and XLA copies both.
        def body(eqstate_written, eqstate_read, *dynamic):
            args, kwargs = rebuild(specs, dynamic)
            returned = plan.evaluate(
                traces, eqstate_written, eqstate_read, args, kwargs
            )
            return returned if donate_states else returned[::-1]

        options = {
            k: v for k, v in self._jit_kwargs.items() if k not in _POSITIONAL_OPTIONS
        }
        positional = positional_specs(specs)
        counts = [dynamic_count(spec) for spec in positional]
        start = [2 + sum(counts[:i]) for i in range(len(counts))]
        n = len(counts)
        donated = [0] if donate_states else []
        for i in self._jit_kwargs.get("donate_argnums", ()):
            if -n <= i < n:
                donated += range(start[i], start[i] + counts[i])
        in_shardings = self._jit_kwargs.get("in_shardings")
        if in_shardings is not None:
            options["in_shardings"] = self._leaf_shardings(in_shardings, specs)
        if self._jit_kwargs.get("out_shardings") is not None:
            if not plan.simple_out:
                raise NotImplementedError(
                    f"`jit({self._name}, out_shardings=...)`: this option refers to "
                    f"positions of outputs that `jax.jit` returns as they are, but "
                    f"{self._name} returns leaves it does not take: state handles "
                    "(e.g. a model holding states), strings or other static values. "
                    "Return only arrays to use it."
                )
            options["out_shardings"] = self._jit_kwargs["out_shardings"]
        return jax.jit(body, donate_argnums=tuple(sorted(set(donated))), **options)

    def _leaf_shardings(self, in_shardings: Any, specs: tuple) -> tuple:
        """`in_shardings` for the function that takes `(written, read, *dynamic
        leaves)`, as `jax.jit` reads them for the user's arguments: one sharding for
        all, or one entry per positional argument that is not static. Raises
        `ValueError` as `jax.jit` does for keyword arguments, or for another number
        of entries (counted as the user passed the arguments)."""
        positional = positional_specs(specs)
        if len(specs) > len(positional) and dynamic_count(specs[-1]):
            raise ValueError(
                f"`jit({self._name}, in_shardings=...)` was given keyword arguments: "
                "as `jax.jit`, it does not support kwargs when in_shardings is "
                "specified. Pass them by position."
            )
        dynamic = [s for s in positional if not is_static(s)]
        entries = in_shardings
        if isinstance(in_shardings, jax.sharding.Sharding):
            entries = [in_shardings] * len(dynamic)
        elif len(entries) != len(dynamic):
            raise ValueError(
                f"`jit({self._name}, in_shardings=...)` has {len(entries)} entries, "
                f"but this call passes {len(dynamic)} positional arguments that are "
                f"not static ({len(positional)} in all): give one sharding (or "
                "PyTree of them) per such argument, as `jax.jit` takes them, or one "
                "Sharding for all."
            )
        leaves = [s for e, spec in zip(entries, dynamic) for s in _per_leaf(e, spec)]
        return (None, None, *leaves)

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
