"""Where state reads and writes go.

Contexts form a stack of *frames*, innermost first, held in a `ContextVar` so that every
thread and async task has its own:

- the **world** is the outermost frame: process-wide, guarded by a lock, holding values
  by handle identity and dropping them when a handle is garbage collected;
- a **dictionary frame** (`scope`, `run`, `jaxpr_call` with a `StateDict`) is strict: it
  sees only its own states;
- a **trace frame** (a StatefulFunction being traced) falls through to its parent on the
  first access of a state and turns the value into an input of its jaxpr.

Frames keep their own values and hand them to their parent only when the call that
pushed them succeeds, so a failure needs no rollback. What a value may be, and what a
write may change, is checked in `_write_checks`.
"""

import abc
import contextlib
import contextvars
import functools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.tree_util as jtu

from . import _jax_compat as compat
from ._custom_types import MISSING
from ._errors import (
    EXPIRED_STATE,
    RAW_TRANSFORM_READ,
    RAW_TRANSFORM_WRITE,
    StateNotFoundError,
    TraceContextError,
)
from ._pretty_print import state_label
from ._write_checks import check_write, has_tracer, refuse_leaked_tracers, to_value


# The handles created inside a trace that has ended, with what a use of one says.
_EXPIRED: "weakref.WeakKeyDictionary[Any, tuple[str, str]]" = (
    weakref.WeakKeyDictionary()
)


def expire(state: Any, where: str, message: str = EXPIRED_STATE) -> None:
    """Marks `state` as created inside the trace of `where`, which has ended: a read of
    it outside that trace raises `TraceContextError` with `message`, a template with
    `{label}` and `{where}` (by default: it escaped through a side effect)."""
    _EXPIRED[state] = (message, where)


def _not_found(state: Any, where: str) -> Exception:
    expired = _EXPIRED.get(state)
    if expired is not None:
        message, where = expired
        return TraceContextError(message.format(label=state_label(state), where=where))
    return StateNotFoundError(f"{state_label(state)} {where}")


_NOT_IN_WORLD = (
    "has no value in the world. It was created inside `eqstate.scope`, "
    "`eqstate.run` or `eqstate.make_with_states`, so its value lives in the StateDict "
    "those return. Pass that dictionary: `eqstate.run(fn, states, *args)` or "
    "`with eqstate.scope(states): ...`."
)

_NOT_IN_DICT = (
    "is not in the StateDict this code runs against (`eqstate.scope`, `eqstate.run` "
    "or `jaxpr_call`), and that dictionary is strict: states outside it are not visible. "
    "Add the state to the dictionary, e.g. `states | eqstate.world().filter(state)`."
)


RAW_TRANSFORM_CREATE = (
    "Cannot create {label} inside a raw JAX transform (`jax.jit`, `jax.vmap`, ...) "
    "nested in an eqstate context: its value would leak out of the trace. Use the "
    "eqstate version of the transform (e.g. `eqstate.transform.vmap_new_states` "
    "instead of `jax.vmap`)."
)


class Frame(abc.ABC):
    """A context that holds state values: where `.value` reads and writes go.

    Six methods make a frame. A frame stores values as they are given (arrays,
    checked by the caller or by `write`) and never changes its parent's: what it
    hands on goes through the parent's `commit`, once the call that made the frame
    has succeeded. A refused operation (any error) leaves the frame as it was.

    A frame made inside a JAX trace keeps it in `jax_trace` and refuses, with
    `check_trace`, writes made from any other trace: a raw JAX transform nested in
    the frame would otherwise store its tracers there. The world has no such trace
    and checks for the top level instead.
    """

    __slots__ = ("jax_trace",)

    # Whether `eqstate.world()` here may take the values at once (outside any trace):
    # frames that hold or pass on plain values. Others (a lane of `vmap_new_states`)
    # decide what a read gives, so a snapshot reads through them.
    snapshots_at_once = False

    @abc.abstractmethod
    def read(self, state: Any) -> Any:
        """`state.value` in user code: the value, recorded as read by the frame.
        Raises `StateNotFoundError` for a state the frame cannot see, and
        `TraceContextError` where the value would leave its trace (read from a raw
        transform that stages out)."""

    @abc.abstractmethod
    def write(self, state: Any, value: Any) -> None:
        """`state.value = value` in user code: checks `value` against the current
        value (`check_write`), refuses a tracer that cannot belong here, stores it
        and records the write."""

    @abc.abstractmethod
    def fetch(self, state: Any) -> Any:
        """The value a child frame imports (a trace's first access of `state`):
        as `read`, without the check of the JAX trace, which the child makes."""

    @abc.abstractmethod
    def commit(
        self, updates: dict[Any, Any], new: Sequence[tuple[Any, Any]] = ()
    ) -> None:
        """Stores, all at once, the writes of a call that succeeded (`updates`,
        already checked) and the `(state, value)` pairs of the states it created."""

    @abc.abstractmethod
    def add_new(self, state: Any, value: Any) -> None:
        """Registers `state`, created while this frame is innermost, with `value`."""

    @abc.abstractmethod
    def peek(self, state: Any) -> Any:
        """The value, or `MISSING`, recording nothing and raising nothing (for
        messages and printing)."""

    def read_many(self, states: Sequence[Any]) -> list[Any]:
        """The values of `states`, each read as by `read`."""
        return [self.read(s) for s in states]

    def commit_values(self, states: Sequence[Any], values: Sequence[Any]) -> None:
        """`commit` of `zip(states, values)`, with no new state."""
        self.commit(dict(zip(states, values)))

    def differentiates_inside(self) -> bool:
        """Whether a raw JAX differentiation (`jax.grad`, `eqx.filter_grad`, ...) runs
        inside this frame, around the current code: a value read from here is a
        constant to it."""
        trace = getattr(self, "jax_trace", None)  # The world has none.
        return compat.differentiation_inside(trace) is not None

    def check_trace(self, state: Any, *, creates: bool = False) -> None:
        """Raises `TraceContextError` naming `state` unless the current JAX trace is
        the one this frame was made in: a write (or with `creates`, a creation) from
        a raw JAX transform nested in this frame would leak its tracer."""
        if compat.current_trace() is not self.jax_trace:
            message = RAW_TRANSFORM_CREATE if creates else RAW_TRANSFORM_WRITE
            raise TraceContextError(message.format(label=state_label(state)))

    def check_commit_trace(
        self, updates: dict[Any, Any], new: Sequence[tuple[Any, Any]]
    ) -> None:
        """`check_trace` for a `commit`, naming its first write, else its first new
        state."""
        if updates:
            self.check_trace(next(iter(updates)))
        elif new:
            self.check_trace(new[0][0], creates=True)


class AnswersNested(abc.ABC):
    """A frame that answers what the traces of transforms nested in it ask (a lane of
    `vmap_new_states`, which re-keys the random states they create). Frames whose
    `passes_nested_on` is true (a trace, an overlay) pass such questions on to their
    `parent`; see `answering_nested`."""

    __slots__ = ()

    @abc.abstractmethod
    def nested_new_value(self, state: Any, value: Any) -> Any:
        """The value that `state`, created by a transform traced inside this frame
        (a jitted constructor), starts from, in place of `value`."""

    @abc.abstractmethod
    def nested_mark(self) -> Any:
        """What `rewind_nested` takes to undo what nested traces ask from now on."""

    @abc.abstractmethod
    def rewind_nested(self, mark: Any) -> None:
        """Undoes what nested traces asked since `mark`: the two-pass fallback throws
        away its discovery pass, which must leave nothing behind."""


def answering_nested(frame: Frame) -> AnswersNested | None:
    """The frame that answers the questions of traces nested in `frame` (see
    `AnswersNested`), or None: then a new state starts from its own value."""
    while getattr(frame, "passes_nested_on", False):
        frame = frame.parent  # pyright: ignore[reportAttributeAccessIssue]
    return frame if isinstance(frame, AnswersNested) else None


class _Values(dict):
    """Values by `id(state)`. A value registered lazily (`World.add_lazy`) is made on
    its first lookup, however it is looked up (the jit fast path indexes this dict)."""

    __slots__ = ("lazy",)

    def __init__(self):
        super().__init__()
        self.lazy: dict[int, Any] = {}

    def __missing__(self, key: int) -> Any:
        with _LAZY_LOCK:  # Two threads' first lookups make the value once.
            if dict.__contains__(self, key):
                return dict.__getitem__(self, key)
            make = self.lazy.get(key)
            if make is None:
                raise KeyError(key)
            # Made outside any trace it was first looked up in: a world value must
            # be concrete, never a tracer that dies with that trace.
            with jax.ensure_compile_time_eval():
                value = self[key] = to_value(make())
            # Dropped only once made: after a failure (a transfer guard, say) the
            # next lookup tries again.
            del self.lazy[key]
        return value


_LAZY_LOCK = threading.Lock()


class World(Frame):
    """The outermost, process-wide frame."""

    __slots__ = ("__weakref__", "_refs", "_values", "good_keys", "lock")

    def __init__(self):
        # Values by `id(state)`: the jit fast path reads and writes this dict directly.
        self._values = _Values()
        self._refs: dict[int, weakref.ref] = {}
        self.lock = threading.RLock()
        # The last key of each random state seen good, by `id(state)` (see
        # `eqstate._state.checked_key`).
        self.good_keys: dict[int, Any] = {}

    @property
    def by_id(self) -> dict[int, Any]:
        """The values, keyed by `id(state)`. Only for callers that hold the handles
        (so that the ids stay theirs) and have checked `compat.is_top_level()`."""
        return self._values

    def __len__(self) -> int:
        return len(self._values)

    def snapshot(self) -> list[tuple[Any, Any]]:
        """The live `(state, value)` pairs, in creation order."""
        pairs = []
        with self.lock:
            # A copy: the garbage collector may drop entries (`_drop_entry`) while
            # this loop allocates, and the lock is re-entrant.
            for key, ref in list(self._refs.items()):
                state = ref()
                if state is not None:
                    pairs.append((state, self._values.get(key, MISSING)))
        # Lazy values are made after the lock is released: a thread making one holds
        # `_LAZY_LOCK`, and a garbage collection there waits for `self.lock`.
        return [(s, self.fetch(s) if v is MISSING else v) for s, v in pairs]

    def read(self, state):
        if not compat.is_top_level() and not compat.evaluates_at_once():
            raise TraceContextError(RAW_TRANSFORM_READ.format(label=state_label(state)))
        try:
            return self._values[id(state)]
        except KeyError:
            raise _not_found(state, _NOT_IN_WORLD) from None

    def read_many(self, states: Sequence[Any]) -> list[Any]:
        """The values of `states`, checked once for a raw JAX transform."""
        if not states:
            return []
        if not compat.is_top_level() and not compat.evaluates_at_once():
            raise TraceContextError(
                RAW_TRANSFORM_READ.format(label=state_label(states[0]))
            )
        values = self._values
        try:
            return [values[id(s)] for s in states]
        except KeyError:
            missing = next(s for s in states if id(s) not in values)
            raise _not_found(missing, _NOT_IN_WORLD) from None

    def fetch(self, state):
        try:
            return self._values[id(state)]
        except KeyError:
            raise _not_found(state, _NOT_IN_WORLD) from None

    def check_trace(self, state, *, creates=False):
        # The world was made outside any trace: only a write at the top level is safe.
        if not compat.is_top_level():
            message = RAW_TRANSFORM_CREATE if creates else RAW_TRANSFORM_WRITE
            raise TraceContextError(message.format(label=state_label(state)))

    def write(self, state, value):
        self.check_trace(state)
        refuse_leaked_tracers(state, value, eager=True)
        value = check_write(state, self.fetch(state), value)
        with self.lock:
            self._values[id(state)] = value

    def commit(self, updates, new=()):
        if not compat.is_top_level():
            state = next(iter(updates)) if updates else new[0][0]
            raise TraceContextError(
                RAW_TRANSFORM_WRITE.format(label=state_label(state))
            )
        for state, value in [*updates.items(), *new]:
            refuse_leaked_tracers(state, value, eager=True)
        with self.lock:
            for state, value in updates.items():
                self._values[id(state)] = value
            for state, value in new:
                self._register(state, value)

    def commit_values(self, states, values):
        if not compat.is_top_level():
            raise TraceContextError(
                RAW_TRANSFORM_WRITE.format(label=state_label(states[0]))
            )
        with self.lock:
            stored = self._values
            for state, value in zip(states, values):
                stored[id(state)] = value

    def add_new(self, state, value):
        if not compat.is_top_level() or has_tracer(value):
            raise TraceContextError(
                f"Cannot create {state_label(state)} inside a JAX transform that "
                "eqstate does not know about: its value would be a tracer leaking out "
                "of the trace. Create states eagerly, inside an eqstate transform "
                "(`eqstate.transform.jit`, `eqstate.transform.vmap_new_states`, ...), "
                "or with `eqstate.make_with_states`."
            )
        with self.lock:
            self._register(state, value)

    def add_lazy(self, state: Any, make: Any) -> None:
        """Registers `state` with the value `make()`, made on its first access. The
        default random state uses this: creating its key at import would start JAX's
        backend, after which `jax.distributed.initialize()` can no longer run."""
        with self.lock:
            self._values.lazy[id(state)] = make
            self._track(state)

    def _register(self, state: Any, value: Any) -> None:
        self._values[id(state)] = value
        self._track(state)

    def _track(self, state: Any) -> None:
        key = id(state)
        drop = functools.partial(_drop_entry, weakref.ref(self), key)
        self._refs[key] = weakref.ref(state, drop)

    def peek(self, state):
        try:
            return self._values[id(state)]
        except KeyError:
            return MISSING


def _drop_entry(world_ref: weakref.ref, key: int, _: weakref.ref) -> None:
    """Forgets a garbage-collected handle's value (a weakref callback)."""
    world = world_ref()
    if world is not None:
        with world.lock:
            world._values.pop(key, None)
            world._values.lazy.pop(key, None)
            world._refs.pop(key, None)
            world.good_keys.pop(key, None)


WORLD = World()
_current: contextvars.ContextVar[Frame] = contextvars.ContextVar(
    "eqstate_frame", default=WORLD
)


# Read on every call of a jitted function, so bound once rather than wrapped.
current_frame: Callable[[], Frame] = _current.get
"""The innermost frame of this thread or task."""


def enter(frame: Frame) -> tuple[contextvars.Token, Any]:
    """Makes `frame` the innermost frame; undo with `leave(token)`.

    A frame made inside a JAX trace (a trace of eqstate's, `run` under a raw
    transform) may be read from raw transforms nested in it, whose traces JAX caches
    by function: while it is innermost, those caches are keyed by an era that a read
    from such a transform ends (see `compat.new_trace_era`), so that a trace holding
    the value read is never reused with a stale value or a dead tracer."""
    era = None
    trace = getattr(frame, "jax_trace", None)
    if trace is not None and not compat.is_eval_trace(trace):
        era = (compat.enter_trace_era(),)
    return _current.set(frame), era


def leave(token: tuple[contextvars.Token, Any]) -> None:
    frame_token, era = token
    _current.reset(frame_token)
    if era is not None:
        compat.leave_trace_era(era[0])


def read_from_nested_transform(state: Any, strict: bool) -> None:
    """Called when a frame is read from inside a raw transform nested in it that
    stages out: refuses it if `strict` (an eager frame), else begins a new era."""
    if strict or not compat.KEEPS_TRACES_APART:
        raise TraceContextError(RAW_TRANSFORM_READ.format(label=state_label(state)))
    compat.new_trace_era()


_SCOPE_ENDED = (
    "Cannot use {label} through an `eqstate.scope` (or `eqstate.run`) that has ended: "
    "its result is final. Code that inherited the scope's context (an asyncio task "
    "created inside the `with` block, `asyncio.to_thread`, `contextvars.copy_context()`, "
    "a thread started with a copied context) can no longer read, write or create states "
    "through it. Finish that work inside the scope (e.g. `await` the task before the "
    "block exits), or give it a scope of its own."
)


def scope_ended(label: str) -> TraceContextError:
    """The error for a use of `label` through an ended `DictFrame`."""
    return TraceContextError(_SCOPE_ENDED.format(label=label))


class DictFrame(Frame):
    """A strict frame over an explicit dictionary of values.

    A task or thread that copied the context in which the frame is innermost keeps
    it after the `scope` that made it has ended: `end` makes every later use raise.
    """

    __slots__ = ("eager", "ended", "new_states", "values")
    snapshots_at_once = True

    def __init__(self, values: Iterable[tuple[Any, Any]]):
        self.values: dict[Any, Any] = dict(values)
        self.new_states: list[Any] = []
        self.jax_trace = compat.current_trace()
        self.eager = compat.is_top_level()
        self.ended = False

    def end(self) -> None:
        """Refuses every later read, write and creation, and drops the values."""
        self.ended = True
        self.values = {}
        self.new_states = []

    def read(self, state):
        if compat.stages_inside(self.jax_trace):
            # Only a frame made under a trace keys JAX's caches (see `enter`).
            read_from_nested_transform(state, strict=self.eager)
        return self.fetch(state)

    def fetch(self, state):
        try:
            return self.values[state]
        except KeyError:
            if self.ended:
                raise scope_ended(state_label(state)) from None
            raise _not_found(state, _NOT_IN_DICT) from None

    def write(self, state, value):
        # An ended frame holds no value, so `fetch` refuses the write.
        self.check_trace(state)
        refuse_leaked_tracers(state, value, self.eager)
        self.values[state] = check_write(state, self.fetch(state), value)

    def commit(self, updates, new=()):
        if self.ended and (updates or new):
            state = next(iter(updates)) if updates else new[0][0]
            raise scope_ended(state_label(state))
        self.check_commit_trace(updates, new)
        self.values.update(updates)
        for state, value in new:
            self.values[state] = value
            self.new_states.append(state)

    def add_new(self, state, value):
        if self.ended:
            raise scope_ended(state_label(state))
        self.check_trace(state, creates=True)
        refuse_leaked_tracers(state, value, self.eager)
        self.values[state] = value
        self.new_states.append(state)

    def peek(self, state):
        return self.values.get(state, MISSING)


class TraceFrame(Frame):
    """The frame of a StatefulFunction while it traces its function.

    On the first access of a state it imports the value from its parent: in single-pass
    mode the value becomes a new input of the jaxpr being traced; in the two-pass
    fallback it comes from `preloaded`, and states missing from there are recorded in
    `missing` (their parent value is used so that the trace can go on).
    """

    passes_nested_on = True  # See `AnswersNested`.
    __slots__ = (
        "accessed",
        "ended",
        "imported",
        "missing",
        "new_states",
        "parent",
        "preloaded",
        "reads",
        "rule_mapped",
        "values",
        "written",
    )

    def __init__(self, parent: Frame, preloaded: dict[Any, Any] | None):
        self.parent = parent
        self.jax_trace = compat.current_trace()
        self.values: dict[Any, Any] = {}
        self.imported: dict[Any, Any] = {}  # The values from before the trace.
        self.ended = False
        self.accessed: list[Any] = []
        self.written: set[Any] = set()
        # States whose value from before the trace the function looked at.
        self.reads: set[Any] = set()
        self.new_states: list[Any] = []
        self.preloaded = preloaded
        self.missing: list[Any] = []
        # States an inner `vmap` maps per lane, around custom rules (`mapped_in_rules`).
        self.rule_mapped: set[Any] = set()

    def _import(self, state: Any) -> Any:
        if self.preloaded is None:
            outer = self.parent.fetch(state)
            leaves, treedef = jtu.tree_flatten(outer)
            leaves = [compat.new_input(self.jax_trace, x) for x in leaves]
            value = jtu.tree_unflatten(treedef, leaves)
        else:
            value = self.preloaded.get(state, MISSING)
            if value is MISSING:
                # Lent for this read only, never kept: the parent may compute it in an
                # inner trace (a `vmap` lane view), whose tracers must not outlive it.
                if state not in self.missing:
                    self.missing.append(state)
                    self.accessed.append(state)
                return self.parent.fetch(state)
        self.values[state] = self.imported[state] = value
        self.accessed.append(state)
        return value

    def original(self, state: Any) -> Any:
        """The state's value from before this trace (imported now if it was not),
        whatever the function wrote since; read as `read` reads it."""
        self.reads.add(state)
        value = self.imported.get(state, MISSING)
        if value is not MISSING:
            return value
        if state in self.values:  # Created in this trace.
            return self.values[state]
        return self._import(state)

    def current(self, state: Any) -> Any:
        """The state's value in this trace, imported on first access."""
        value = self.values.get(state, MISSING)
        return self._import(state) if value is MISSING else value

    def read(self, state):
        if compat.stages_inside(self.jax_trace):
            read_from_nested_transform(state, strict=False)
        return self.fetch(state)

    def fetch(self, state):
        if state not in self.written:  # After a write, the function sees its own value.
            self.reads.add(state)
        return self.current(state)

    def write(self, state, value):
        self.check_trace(state)
        old = self.current(state)
        self.values[state] = check_write(state, old, value)
        self.written.add(state)

    def commit(self, updates, new=()):
        self.check_commit_trace(updates, new)
        self.values.update(updates)
        self.written.update(updates)
        for state, value in new:
            self.values[state] = value
            self.new_states.append(state)

    def add_new(self, state, value):
        self.check_trace(state, creates=True)
        refuse_leaked_tracers(state, value, eager=False)
        lane = answering_nested(self.parent)
        if lane is not None:
            value = lane.nested_new_value(state, value)
        self.values[state] = value
        self.new_states.append(state)

    def peek(self, state):
        value = self.values.get(state, MISSING)
        return self.parent.peek(state) if value is MISSING else value

    def release(self) -> None:
        """Drops the tracers this frame holds, once its trace has ended, so that
        nothing keeps them alive (JAX's leak checker would flag them)."""
        self.values.clear()
        self.imported.clear()
        self.ended = True
        self.preloaded = None
        self.jax_trace = None


_IN_RULE = (
    "{label} is read by a custom differentiation rule (`jax.custom_jvp` or "
    "`jax.custom_vjp`), which JAX runs when it differentiates the function, {why} "
    "Pass the value to the custom function as an argument instead."
)


class RuleFrame(Frame):
    """The frame while a trace is evaluated, for the custom differentiation rules JAX
    runs then: they see the values the function was traced with, for the states it
    reads and does not write (a written state's value depends on where the rule
    runs, which eqstate cannot tell). Anything else raises `TraceContextError`."""

    __slots__ = ("mapped", "values")

    def __init__(self, values: dict[Any, Any], mapped: Iterable[Any] = ()):
        self.values = values
        self.mapped = frozenset(mapped)
        self.jax_trace = None

    def read(self, state):
        if state in self.mapped:
            raise TraceContextError(
                _IN_RULE.format(
                    label=state_label(state),
                    why="but an `eqstate.transform.vmap` inside the function maps it "
                    "(`in_states`), and the rule, run from outside that vmap, would "
                    "see every member's value instead of its own. Differentiate "
                    "inside the vmap (a vmap of grad).",
                )
            )
        value = self.values.get(state, MISSING)
        if value is MISSING:
            raise TraceContextError(
                _IN_RULE.format(
                    label=state_label(state),
                    why="but the function writes it, or does not read it itself.",
                )
            )
        _RULE_READS[0] += 1
        return value

    fetch = read

    def differentiates_inside(self) -> bool:
        return False  # The rules of a differentiation read the traced values.

    def write(self, state, value):
        raise TraceContextError(
            f"Cannot write {state_label(state)} inside a custom differentiation rule "
            "(`jax.custom_jvp` or `jax.custom_vjp`): JAX runs rules when it "
            "differentiates, and their side effects have no place in the result. "
            "Write the state in the function itself."
        )

    def commit(self, updates, new=()):
        self.write(next(iter(updates)) if updates else new[0][0], None)

    def add_new(self, state, value):
        self.write(state, value)

    def peek(self, state):
        return self.values.get(state, MISSING)


# How many times a custom rule has read a state (see `rule_reads`).
_RULE_READS = [0]


def rule_reads() -> int:
    """How many times a custom differentiation rule has read a state so far. JAX
    keeps what a rule computed (the values it read included) with the equations of
    the jaxpr it ran from, and those may be shared by several traces: a trace with
    custom rules made before the latest such read is not evaluated again."""
    return _RULE_READS[0]


@contextlib.contextmanager
def rules_see(values: dict[Any, Any], mapped: Iterable[Any] = ()) -> Iterator[None]:
    """Runs the `with` block in a `RuleFrame` over `values`, in which reading a
    state in `mapped` raises."""
    token = enter(RuleFrame(values, mapped))
    try:
        yield
    finally:
        leave(token)


def mapped_in_rules(states: Iterable[Any]) -> None:
    """Records, in every trace around the current frame, that `states` are mapped per
    lane by a `vmap` whose function has custom rules: when such a trace is
    differentiated, the rules run outside the vmap and would see the whole stacked
    value, so their reads of these states raise instead."""
    frame: Any = current_frame()
    while frame is not None:
        if isinstance(frame, TraceFrame):
            frame.rule_mapped.update(states)
        frame = getattr(frame, "parent", None)


def label_here(state: Any) -> str:
    """`state_label` with the value's summary when the current context knows it."""
    value = current_frame().peek(state)
    return state_label(state) if value is MISSING else state_label(state, value)
